"""Checks a run before any process starts: config, data, output folder, model and layout."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import Config, refuse_compile_with_tp
from .data.chat import tokenize_sft
from .data.kto import tokenize_kto
from .data.preference import tokenize_pairs
from .data.prepare import TinyTokenizer, check_inserted_tokens, load_raw, load_tokenizer, run_tokenizer
from .data.prompts import tokenize_prompts
from .data.reward import tokenize_reward_pairs
from .errors import UserError
from .families import get_family
from .loop.generation import NO_PROMPTS
from .model import lora
from .model.hub import check_model_source, resolve_model_path
from .model.pretrained import refuse_custom_code
from .outputs.checkpoint import check_resume
from .outputs.runfolder import (
    check_free,
    check_run_folders,
    check_writable,
    checkpoint_root,
    choose_output_dir,
    continuing_run,
    run_folders,
)
from .parallel.layout import Engine, check_batch_split, pipeline_microbatches, resolve_device, resolve_dims
from .resolve import choose_model, resolve
from .tasks import HeadKind, check_hub_data
from .tasks.kinds import kind_of

if TYPE_CHECKING:
    from .tasks.task import Task


def check_layout(config: Config, hf_config, world_size: int, local_world_size: int):
    """Degrees and mode (`ParallelDims`) for `world_size` processes (`local_world_size` per node) that divide the
    model and the batch; returns them and a description of the pipeline part ("" without one)."""
    family = get_family(config.model.family)
    dims = resolve_dims(
        world_size,
        local_world_size,
        config.parallel.tensor_parallel_degree,
        config.parallel.sharding,
        config.parallel.shard_group_size,
        config.parallel.pipeline_parallel_degree,
    )
    family.check_tp(hf_config, dims.tp)
    refuse_compile_with_tp(
        config.training.compile, dims.tp
    )  # the degree tensor_parallel_degree=auto gives, as every rank
    check_batch_split(config.training.batch_size, dims.dp, config.training.gradient_accumulation_steps)
    pipeline = ""
    if dims.pp_enabled:
        from .parallel.pipeline import check_microbatches, check_stages

        virtual = config.parallel.virtual_stages if config.parallel.pipeline_schedule == "interleaved" else 1
        check_stages(hf_config.num_hidden_layers, dims.pp, virtual, config.parallel.partition)
        family.check_pipeline(hf_config, choose_model(config).head)  # as every rank does before cutting (a shrunk copy)
        microbatches = pipeline_microbatches(config.parallel.microbatches, dims.pp)
        check_microbatches(
            config.training.batch_size // (dims.dp * config.training.gradient_accumulation_steps), microbatches
        )
        pipeline = f"{dims.pp} pipeline stages ({config.parallel.pipeline_schedule}, {microbatches} micro-batches) x "
    return dims, pipeline


def planned_layout(config: Config, hf_config, world_size: int, local_world_size: int):
    """The layout a run of `config` starts on `world_size` processes (`local_world_size` per node), as the
    planner's Candidate (tools/planner.py), after the run's own layout checks (one line if it would refuse).
    activation_checkpointing=N (every N-th block) is planned as off: an upper bound."""
    from .tools.planner import Candidate

    dims, _ = check_layout(config, hf_config, world_size, local_world_size)
    microbatches = pipeline_microbatches(config.parallel.microbatches, dims.pp) if dims.pp_enabled else 1
    every_block = config.memory.activation_checkpointing is True or config.memory.activation_checkpointing == 1
    return Candidate(dims.tp, dims.pp, dims.dp, dims.sharding, every_block, microbatches, dims.optimizer_shards)


def layout_refusal(config: Config, hf_config, world_size: int, local_world_size: int, candidate) -> str | None:
    """Why a run of `config` with `candidate`'s overrides (Candidate.overrides, the keys the planner prints) would
    not start that layout: its refusal (validate, the layout checks), or a different layout; None: it would."""
    from .config import parse_override
    from .resolve import validate

    keys = dict(parse_override(text) for text in candidate.overrides(local_world_size))
    changed = config.replace(**keys)
    try:
        validate(changed, "plan")
        started = planned_layout(changed, hf_config, world_size, local_world_size)
    except UserError as exc:
        return str(exc)
    return None if started == candidate else f"starts {started} instead"


def _expected(value, default) -> str | None:
    """What `value` must be to replace `default` in a transformers config, or None when it is that."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, int):
        return None if number and isinstance(value, int) else "an integer"
    if isinstance(default, float):
        return None if number else "a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None


def check_model_config(config: Config, model_path: str | None = None):
    """`model_config` values of the types the transformers config holds, giving sizes a model can have; returns
    the resulting transformers config (tiny: with the vocabulary a learned tokenizer of tokenizer_vocab_size
    gets; full: read from `model_path`, else `config.model`)."""
    chosen = choose_model(config)
    family, head = chosen.family, chosen.head

    def build(overrides: dict):
        return family.config_for(
            model=config.replace(model_config=overrides).model,
            head=head,
            max_length=config.data.max_length,
            tokenizer_size=config.model.tokenizer_vocab_size,
            model_path=model_path,
        )

    defaults = build({})
    name = type(defaults).__name__
    for key, value in config.model.model_config.items():
        expected = _expected(value, getattr(defaults, key, None))
        if expected:
            raise UserError(
                f"model_config.{key}={value!r} is not valid; {name}.{key} is {expected} "
                f"(default {getattr(defaults, key)!r})"
            )
    try:
        hf_config = build(config.model.model_config)  # an unknown attribute is its own one-line error
    except UserError:
        raise
    except Exception as exc:  # transformers' typed configs refuse a value of another type
        raise UserError(
            f"model_config {config.model.model_config}: {name} refuses it "
            f"({(str(exc).strip().splitlines() or [''])[-1].strip()})"
        ) from None
    try:
        sizes = {**family.tp_dimensions(hf_config), "num_hidden_layers": hf_config.num_hidden_layers}
    except TypeError as exc:
        raise UserError(f"model_config {config.model.model_config}: not a model {name} can build ({exc})") from None
    for key, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UserError(f"model_config: {family.name} {key}={size!r} must be a positive integer")
    positions = getattr(hf_config, "max_position_embeddings", None)
    if isinstance(positions, int) and config.data.max_length > positions:  # a position table indexed past its end
        raise UserError(
            f"max_length={config.data.max_length} is more than the {positions} positions of this {family.name} model "
            f"(max_position_embeddings); use max_length <= {positions}"
        )
    return hf_config


def check_heads(hf_config) -> None:
    """Attention splits the width into equal heads (checked after the layout, whose message names the degrees)."""
    if hf_config.hidden_size % hf_config.num_attention_heads:
        raise UserError(
            f"model_config: hidden size {hf_config.hidden_size} is not divisible by "
            f"{hf_config.num_attention_heads} attention heads"
        )


def check_pretrained_tokenizer(config: Config, family, pairs: bool) -> None:
    """A local pretrained tokenizer has the tokens the data code will insert (EOS, padding), as data.prepare checks
    after the launch; a Hub name's files are checked by the run, once downloaded."""
    if config.model.size != "full" and not config.model.tokenizer:
        return  # a tokenizer learned from the training rows has them all
    chosen = choose_model(config)
    where = config.model.tokenizer or chosen.model_name
    if not Path(resolve_model_path(where)).is_dir():
        return
    tokenizer = load_tokenizer(
        where, "full", chosen.model_name, TinyTokenizer(family.tiny_tokenizer, 0), [], None, Path()
    )
    check_inserted_tokens(tokenizer, where, chosen.head is HeadKind.CAUSAL_LM, pairs and not family.pair_token_types)


CHECKED_ROWS = 256  # of each split --check renders, as the run will: enough to meet a bad row of a small file


def check_chat_rows(config: Config, family, raw, task: Task, source) -> None:
    """task=sft: what the run's data stage refuses, before the launch. The run's tokenizer (learned for a tiny
    model; a local one at full size: a Hub name's is checked by the run, once downloaded) with its chat template
    set and checked, and the first CHECKED_ROWS rows of each split rendered and masked; generate_every needs
    conversations in the validation split."""
    if not task.kind.chat:
        return
    if config.training.generate_every and "messages" not in raw["validation"].column_names:
        raise UserError(NO_PROMPTS)
    local = config.model.size == "tiny" and not config.model.tokenizer
    model_name = choose_model(config).model_name  # None at size=tiny
    where = config.model.tokenizer or model_name
    if not local and not (where and Path(resolve_model_path(where)).is_dir()):
        return
    tokenizer = run_tokenizer(
        data=config.data, model=config.model, family=family, model_name=model_name, raw=raw, task=task, source=source
    )
    for split, rows in raw.items():
        if split == "test":
            continue
        rows = rows.select(range(min(len(rows), CHECKED_ROWS)))
        if task.kind.reward_model:
            tokenize_reward_pairs(rows, tokenizer, config.data.max_length, split)
        elif task.kind.prompts:  # grpo: each prompt rendered with the generation prompt, within the budget
            tokenize_prompts(rows, tokenizer, config.data.max_length, split)
        elif task.kind.pairs:
            tokenize_pairs(rows, tokenizer, config.data.max_length, split)
        elif task.kind.unpaired:
            tokenize_kto(rows, tokenizer, config.data.max_length, split)
        else:
            tokenize_sft(
                rows, tokenizer, config.data.max_length, config.data.train_on, split, config.data.chat_template
            )


def check_rewards(config: Config, task: Task | None, where: str) -> None:
    """task=grpo: its reward functions made as the run makes them (a user's file loaded and its function found, a
    reward model's folder checked: its config.json, not its weights), and the columns they read in the local rows
    (`task`: None for rows from the Hub; `where`: the rows' description)."""
    if not kind_of(config.model.task).step_source:
        return
    from .rl.rewards import Rewards, RewardSettings

    rewards = Rewards(RewardSettings.of(config.grpo), placement=None)
    if task is not None:
        rewards.check_columns(task.columns[1:], f"the training rows ({where})")


def describe_sharding(config: Config, dims, precision: str) -> str:
    """The sharding part of --check's line; engine=deepspeed's config is generated (and its problems, fp16 on a
    CPU, MiCS, a JSON contradicting the recipe, said in one line) here."""
    sharding = f" | sharding {dims.sharding}" if dims.sharded else ""
    if Engine(config.parallel.engine) is Engine.DEEPSPEED:
        from .parallel import deepspeed_engine

        generated = deepspeed_engine.preflight(
            training=config.training,
            parallel=config.parallel,
            dp=dims.dp,
            device_type=resolve_device(config.parallel.device),
            precision=precision,
        )
        sharding += f" | deepspeed ZeRO-{generated['zero_optimization']['stage']}"
    if dims.hybrid:
        sharding += f" ({dims.dp_replicate} groups of {dims.dp_shard})"
    return sharding


def preflight(config: Config, nproc: int, nnodes: int = 1) -> str:
    """Raise UserError on the first problem; return a one-line description of what will run (`nproc` processes in
    all, spread evenly over `nnodes` nodes)."""
    for flag, count, what in (("--nproc", nproc, "processes"), ("--nnodes", nnodes, "nodes")):
        if count < 1:
            raise UserError(f"{flag} {count} is not a number of {what}; give 1 or more")
    if nproc % nnodes:
        raise UserError(f"--nproc {nproc} processes do not spread evenly over --nnodes {nnodes} nodes")
    family = get_family(config.model.family)
    resolve_device(config.parallel.device)
    task = None  # known before the launch for local rows only
    # the shipped chat or preference sample (its kind's), or files
    sample = kind_of(config.model.task).sample is not None and not config.data.dataset
    local_dataset = config.data.dataset and Path(config.data.dataset).expanduser().is_dir()
    if sample or config.data.data_dir or config.data.train_file or local_dataset:
        # local rows: columns, labels and splits checked now, not after the launch
        raw, task, source = load_raw(
            data=config.data, model=config.model, seed=config.training.seed, predict=config.output.predict
        )
        data = source.description
        check_chat_rows(config, family, raw, task, source)
        if task.head is HeadKind.CLASSIFICATION and len(raw["train"]) < config.training.batch_size:
            raise UserError(
                f"batch_size={config.training.batch_size} is larger than the training split ({len(raw['train'])} rows)"
            )
    else:  # rows from the Hub: whether the run can have them (nothing is downloaded here)
        data = check_hub_data(data=config.data)
    check_rewards(config, task, data)
    check_writable(Path(config.data.cache_dir).expanduser(), "cache_dir")
    continuing = continuing_run(checkpoint=config.checkpoint, output=config.output)
    output_dir = choose_output_dir(config.output.output_dir, config.recipe, config.output.overwrite, continuing)
    check_writable(output_dir, "output_dir")
    root = checkpoint_root(config.checkpoint.checkpoint_dir, output_dir)
    check_free(run_folders(output_dir, root))
    check_run_folders(output_dir, root, config.output.overwrite)
    check_resume(  # the checkpoint it would continue: intact, and of compatible settings
        root,
        settings=config.to_dict(),
        checkpoint=config.checkpoint,
        output=config.output,
        data=config.data,
        seed=config.training.seed,
    )
    chosen = choose_model(config)
    if config.model.size == "full":
        check_model_source(chosen.model_name)
    if config.model.tokenizer:
        refuse_custom_code(resolve_model_path(config.model.tokenizer))
    check_pretrained_tokenizer(config, family, pairs=task.pair if task else False)
    hf_config = check_model_config(config)
    dims, pipeline = check_layout(config, hf_config, nproc, nproc // nnodes)
    device = torch.device(resolve_device(config.parallel.device))
    resolved = resolve(config, device, dims)  # as the ranks will resolve it
    check_heads(hf_config)
    if config.data.packing:  # as the run checks once it has the model's config
        family.check_packing(hf_config, config.data.max_length)
    pretrained = resolve_model_path(resolved.model_name) if config.model.size == "full" else None
    lora.preflight(  # targets and heads that match nothing, a rank wider than a layer, a new weight left frozen
        resolved.lora,
        family=family,
        head=resolved.head,
        hf_config=hf_config,
        pretrained_folder=pretrained,
        tp=dims.tp,
        fsdp=dims.dp_shard if dims.fsdp else 1,
    )
    if config.model.size == "full" and Path(folder := resolve_model_path(resolved.model_name)).is_dir():
        from .model.weights import check_fit  # a Hub name's files are checked by the run, once downloaded

        check_fit(family, resolved.head, hf_config, folder)
    sharding = describe_sharding(config, dims, resolved.precision)
    nodes = f" on {nnodes} nodes" if nnodes > 1 else ""
    return (
        f"ok: {config.recipe} | {config.model.size} {family.name} | task {config.model.task} | "
        f"{nproc} processes{nodes} = "
        f"{pipeline}{dims.dp} data-parallel x {dims.tp} tensor-parallel{sharding} | "
        f"data {data}{describe_packing(config)}"
    )


def describe_packing(config: Config) -> str:
    """The packing part of --check's line: task=dpo packs a pair's two rows (each up to max_length) into one
    sequence, so its sequences hold twice max_length (loop/builder.py's PackedShape)."""
    if not config.data.packing:
        return ""
    if kind_of(config.model.task).pairs:
        return (
            f" | packed into sequences of {2 * config.data.max_length} tokens (2 x max_length: both rows of a pair, "
            f"each up to {config.data.max_length})"
        )
    return f" | packed into sequences of {config.data.max_length} tokens"
