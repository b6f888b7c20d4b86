"""Checks a run before any process starts: config, data, output folder, model and layout."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import continuing_run, resolve_resume
from .config import Config
from .data import read_glue_dir
from .families import get_family
from .families.base import check_model_source
from .layout import resolve_degrees
from .reporting import choose_output_dir


def check_layout(config: Config, hf_config, world_size: int, local_world_size: int):
    """Degrees for `world_size` processes (`local_world_size` per node) that divide the model and the batch;
    returns them and a description of the pipeline part ("" without one)."""
    from .trainer import check_batch_split

    family = get_family(config.family)
    degrees = resolve_degrees(world_size, local_world_size, config.tensor_parallel_degree, config.sharding,
                              config.shard_group_size, config.pipeline_parallel_degree)
    family.check_tp(hf_config, degrees.tp)
    check_batch_split(config.batch_size, degrees.dp, config.gradient_accumulation_steps)
    pipeline = ""
    if degrees.pp > 1:
        from .parallel.pipeline import check_microbatches, check_stages

        virtual = config.virtual_stages if config.pipeline_schedule == "interleaved" else 1
        check_stages(hf_config.num_hidden_layers, degrees.pp, virtual, config.partition)
        microbatches = config.microbatches or 2 * degrees.pp
        check_microbatches(config.batch_size // (degrees.dp * config.gradient_accumulation_steps), microbatches)
        pipeline = f"{degrees.pp} pipeline stages ({config.pipeline_schedule}, {microbatches} micro-batches) x "
    return degrees, pipeline


def preflight(config: Config, nproc: int) -> str:
    """Raise UserError on the first problem; return a one-line description of what will run."""
    family = get_family(config.family)
    if config.data_dir:
        read_glue_dir(config.data_dir)
    choose_output_dir(config.output_dir, config.recipe, config.overwrite, continuing_run(config))
    if config.resume not in ("auto", "none"):
        resolve_resume(config.resume, Path(config.resume))
    if config.size == "full":
        check_model_source(config.model or family.default_model)
    hf_config = family.config_for(config, config.tokenizer_vocab_size)
    degrees, pipeline = check_layout(config, hf_config, nproc, nproc)
    sharding = "" if config.sharding == "none" else f" | sharding {config.sharding}"
    if config.engine == "deepspeed":  # fp16 on a CPU, MiCS, a JSON contradicting the recipe: one line, here
        import torch

        from .layout import resolve_device
        from .parallel import deepspeed_engine
        from .precision import resolve_precision

        device = torch.device(resolve_device(config.device))
        generated = deepspeed_engine.preflight(config, degrees.dp, device.type,
                                               resolve_precision(config.precision, device, config.engine))
        sharding += f" | deepspeed ZeRO-{generated['zero_optimization']['stage']}"
    if config.sharding == "hybrid":
        sharding += f" ({degrees.dp_replicate} groups of {degrees.dp_shard})"
    return (f"ok: {config.recipe} | {config.size} {family.name} | task {config.task} | {nproc} processes = "
            f"{pipeline}{degrees.dp} data-parallel x {degrees.tp} tensor-parallel{sharding} | "
            f"data {config.data_dir or 'Hub (sample if offline)'}")
