"""Checks a run before any process starts: config, data, output folder, model and layout."""

from __future__ import annotations

from .config import Config
from .data import read_glue_dir
from .families import get_family
from .families.base import check_model_source
from .layout import resolve_tp_degree
from .reporting import choose_output_dir


def preflight(config: Config, nproc: int) -> str:
    """Raise UserError on the first problem; return a one-line description of what will run."""
    family = get_family(config.family)
    if config.data_dir:
        read_glue_dir(config.data_dir)
    choose_output_dir(config.output_dir, config.recipe, config.overwrite)
    if config.size == "full":
        check_model_source(config.model or family.default_model)
    from .trainer import check_batch_split, tiny_vocab_size

    hf_config = family.hf_config(config.model, config.size, tiny_vocab_size(config.tokenizer_vocab_size),
                                 max(config.max_length, 128), config.model_config)
    tp = resolve_tp_degree(config.tensor_parallel_degree, nproc, nproc)
    family.check_tp(hf_config, tp)
    check_batch_split(config.batch_size, nproc // tp, config.gradient_accumulation_steps)
    return (f"ok: {config.recipe} | {config.size} {family.name} | task {config.task} | {nproc} processes = "
            f"{nproc // tp} data-parallel x {tp} tensor-parallel | data {config.data_dir or 'Hub (sample if offline)'}")
