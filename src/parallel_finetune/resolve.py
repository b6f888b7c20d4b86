"""What a recipe means for this run, decided once: the pretrained model's name, the precision and its dtypes, the
parallel degrees and the pipeline's micro-batches. The trainer resolves a Config once, after the process group
exists, and hands these values to the components; `--check` resolves the same way for the layout it would start.
The number of steps, the warm-up and compile wait for the data: `resolve_schedule`, the second stage.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import (
    COMPILE_AUTO_MIN_STEPS,
    COMPILE_WITH_TP,
    REFERENCE_FREE_LOSSES,
    SECTION_CLASSES,
    Config,
    MemorySection,
    ModelSection,
    PeftSection,
    check_keys,
    parse_config,
    refuse_compile_with_tp,
)
from .errors import UserError
from .families import AUTO, family_for_model_type, get_family
from .families.base import Family
from .model.hub import resolve_model_path
from .model.lora import ALL_LINEAR, LoraSettings
from .model.precision import DTYPES, resolve_precision
from .model.pretrained import load_hf_config
from .model.quantize import NF4Settings
from .outputs.loggers import TIMED_TRACKERS, TRACKER_GRACE_S, destinations
from .parallel import deepspeed_engine  # imports no deepspeed: checks of the engine=deepspeed keys
from .parallel.layout import Engine, ParallelDims, Sharding, pipeline_microbatches
from .tasks.kinds import all_kinds, check_task_keys, kind_of
from .tasks.task import HeadKind, head_of


@dataclass(frozen=True)
class ModelChoice:
    """The first stage, which needs no device or processes: which model a recipe trains, its head and adapters
    (--check, a SageMaker job's staging, an export and the run all read it from here)."""

    family: Family
    model_name: str | None  # the Hub name or folder a full-size run loads (`model`, else the family's default);
    # None at size=tiny, which builds its model from config
    head: HeadKind  # the model's last layer, from the recipe's `task:` (sft trains the causal LM)
    lora: LoraSettings | None  # peft=lora's adapters; None: no adapters


def choose_model(config: Config) -> ModelChoice:
    family = get_family(config.model.family)
    head = head_of(config.model.task)
    name = None if config.model.size == "tiny" else config.model.source or family.default_model
    return ModelChoice(family, name, head, _lora_settings(peft=config.peft, family=family, head=head))


def _lora_settings(*, peft: PeftSection, family, head: str) -> LoraSettings | None:
    """peft=lora's adapters for a model of `family` with a `head` (a HeadKind, or the recipe's `task:` naming one):
    the default targets are the family's, the modules trained in full its classification head (none for a causal
    LM); None when peft=none."""
    if peft.method != "lora":
        return None
    targets = peft.lora_target_modules
    if targets == "default":
        targets = family.lora_targets
    elif targets != ALL_LINEAR:
        targets = tuple(targets)
    save = peft.lora_modules_to_save
    if save is None:
        save = family.lora_head if HeadKind(head) is HeadKind.CLASSIFICATION else ()
    quantization = None
    if peft.lora_base_quantization == "nf4":
        quantization = NF4Settings(peft.nf4_block_size, peft.nf4_scaler_block_size)
    return LoraSettings(peft.lora_rank, float(peft.lora_alpha), peft.lora_dropout, targets, tuple(save), quantization)


@dataclass(frozen=True)
class Resolved:
    family: Family
    model_name: str | None  # ModelChoice's
    engine: Engine  # the config's `engine`, as a type
    head: HeadKind  # the model's last layer, from the recipe's `task:` (sft trains the causal LM)
    lora: LoraSettings | None  # peft=lora's adapters
    precision: str  # fp16 | bf16 | fp32: `auto` decided for the device and engine
    compute_dtype: torch.dtype  # what matmuls run in (float32 for fp32)
    autocast_dtype: torch.dtype | None  # None in fp32: no autocast, no 16-bit copies of frozen weights
    export_dtype: torch.dtype
    dims: ParallelDims
    microbatches: int  # a pipeline's, per accumulation slice (unused without one)
    # a language model's head and loss, this many target tokens at a time (loss_chunk_tokens); 0: whole logits, as
    # engine=deepspeed computes them (its ZeRO-3 gathers the head's weights in the head's own forward only)
    loss_chunk_tokens: int = 0

    def as_params(self) -> dict:
        """The decided values, for trackers beside the config as written (`auto` there, the degree here)."""
        return {
            "resolved.model": self.model_name,
            "resolved.precision": self.precision,
            "resolved.degrees": {"pp": self.dims.pp, "dp": self.dims.dp, "tp": self.dims.tp},
            "resolved.sharding": str(self.dims.sharding),
            "resolved.microbatches": self.microbatches if self.dims.pp_enabled else None,
        }


def resolve(config: Config, device: torch.device, dims: ParallelDims) -> Resolved:
    """The run's decided values; a one-line UserError where `auto` has no answer (fp16 under DeepSpeed on a CPU)."""
    engine = Engine(config.parallel.engine)
    precision = resolve_precision(config.training.precision, device, engine)
    chosen = choose_model(config)
    return Resolved(
        family=chosen.family,
        model_name=chosen.model_name,
        engine=engine,
        head=chosen.head,
        lora=chosen.lora,
        precision=precision,
        compute_dtype=DTYPES[precision],
        autocast_dtype=None if precision == "fp32" else DTYPES[precision],
        export_dtype=DTYPES[config.output.export_dtype],
        dims=dims,
        microbatches=pipeline_microbatches(config.parallel.microbatches, dims.pp),
        loss_chunk_tokens=config.memory.loss_chunk_tokens if engine is Engine.TORCH else 0,
    )


@dataclass(frozen=True)
class Schedule:
    """The second stage, once the data is known: how long the run trains, its warm-up, whether it compiles."""

    total_steps: int  # max_steps, or epochs x the global batches of an epoch
    warmup_steps: int  # warmup_steps, or warmup_ratio x total_steps
    compile: bool
    compile_why: str  # what compile=auto decided, and why (logged)


def resolve_schedule(config: Config, batches_per_epoch: int, device_type: str, tensor_parallel: int) -> Schedule:
    total = config.training.max_steps or max(1, math.ceil(config.training.epochs * batches_per_epoch))
    compiled, why = compile_decision(config, total, device_type, tensor_parallel)
    warmup = config.training.warmup_steps or math.ceil(config.training.warmup_ratio * total)
    return Schedule(total, warmup, compiled, why)


def compile_decision(config: Config, total_steps: int, device_type: str, tensor_parallel: int) -> tuple[bool, str]:
    """Whether to compile the blocks, and why (logged): `compile: auto` compiles engine=torch runs of at least
    COMPILE_AUTO_MIN_STEPS steps on GPUs, without tensor parallelism (COMPILE_WITH_TP; compile=true with it is an
    error). Not on CPUs: there the compiled MiniLM blocks ran each SST-2 step 1.16x slower than eager (median over
    200 identical steps; with lengths padded to a multiple of 8 and static shapes, 1.17x), so no run length earns
    the compile time back (docs/speed.md)."""
    refuse_compile_with_tp(config.training.compile, tensor_parallel)
    if config.training.compile != "auto":
        return bool(config.training.compile), f"compile={str(config.training.compile).lower()}"
    if tensor_parallel > 1:
        return False, f"compile=auto: off (tensor_parallel_degree={tensor_parallel}: torch.compile {COMPILE_WITH_TP})"
    if config.parallel.engine != "torch":
        return False, "compile=auto: off (engine=deepspeed)"
    if device_type == "cpu":
        return False, "compile=auto: off (CPU: compiled blocks are slower than eager here; compile=true forces it)"
    on = total_steps >= COMPILE_AUTO_MIN_STEPS
    relation = ">=" if on else "<"
    return on, f"compile=auto: {'on' if on else 'off'} ({total_steps} steps {relation} {COMPILE_AUTO_MIN_STEPS})"


# GLUE's train splits as published (rows), for timing a recipe that reads GLUE from the Hub without reading it
GLUE_TRAIN_ROWS = {
    "cola": 8_551,
    "sst2": 67_349,
    "mrpc": 3_668,
    "qqp": 363_846,
    "stsb": 5_749,
    "mnli": 392_702,
    "qnli": 104_743,
    "rte": 2_490,
    "wnli": 635,
}


def planner_samples(config: Config) -> tuple[int | None, str]:
    """The training samples a run of `config` has per epoch (rows; pairs for dpo) and where they come from, for
    the planner's time, without the network or a tokenizer: local files, folders and the shipped samples are
    read (less the held-out validation share when there is no validation split, as the run carves it); GLUE
    from the Hub is its published train size; a Hub data set is not counted (None)."""
    from .tasks.sources import SHIPPED_SAMPLES, read_sources

    data = config.data
    shipped = config.model.task in SHIPPED_SAMPLES and not (data.train_file or data.dataset)
    local_dataset = data.dataset is not None and Path(data.dataset).expanduser().is_dir()
    if not (shipped or data.train_file or local_dataset or (data.data_dir and not data.dataset)):
        if data.dataset:
            return None, f"dataset={data.dataset} from the Hub, not counted offline: max_steps=N times the run"
        return GLUE_TRAIN_ROWS[data.glue_task], f"GLUE {data.glue_task}'s train split"
    tables, source, _ = read_sources(data=data, task_key=config.model.task)
    rows = len(tables["train"])
    where = source.description
    if shipped:  # named, not by this machine's path: the sample the package ships
        where = f"the shipped {SHIPPED_SAMPLES[config.model.task][1]}; train_file= for yours"
    if "validation" not in tables:
        held = round(rows * data.validation_split_percentage / 100)
        rows -= held
        where += f", {held:,} held out"
    return rows, where


def planner_workload(config: Config, *, count_samples: bool = True):
    """What a run of `config` trains, as the planner plans it (tools/planner.py's Workload): its task and head,
    max_length, global batch and accumulation slices, packing, the LoRA settings the run applies (targets, modules
    trained in full, NF4), the loss's chunk (0 under engine=deepspeed: whole logits, as `resolve` decides), the
    compute dtype (fp32 or 16-bit) and its steps (max_steps, or epochs x the samples `planner_samples` counts).
    An instruction-tuning recipe's rows (and a preference recipe's, two a pair) are planned at SFT_TOKENS_PER_ROW
    tokens each."""
    from .tools.planner import SFT_TOKENS_PER_ROW, Rollouts, Workload

    chosen, peft, kind = choose_model(config), config.peft, kind_of(config.model.task)
    samples, data = planner_samples(config) if count_samples else (None, "not counted")
    grpo = config.grpo
    rollouts = None
    if kind.step_source == "rollouts":  # task=grpo: what each step samples (an evaluation: as much at once)
        rollouts = Rollouts(grpo.num_generations, grpo.max_completion_length, grpo.num_iterations > 1 or grpo.beta > 0)
    return Workload(
        head=chosen.head,
        seq_len=config.data.max_length,
        batch_size=config.training.batch_size,
        accumulation=config.training.gradient_accumulation_steps,
        lora_rank=peft.lora_rank if chosen.lora else 0,
        base_quantization=peft.lora_base_quantization if chosen.lora else "none",
        lora=chosen.lora,
        packing=config.data.packing,
        tokens_per_row=SFT_TOKENS_PER_ROW if kind.chat else None,
        loss_chunk_tokens=config.memory.loss_chunk_tokens if Engine(config.parallel.engine) is Engine.TORCH else 0,
        pairs=kind.pairs,
        reference_pass=kind.reference and config.preference.dpo_loss not in REFERENCE_FREE_LOSSES,
        compute_bytes=4 if config.training.precision == "fp32" else 2,  # auto: bf16 or fp16 on GPUs
        task=config.model.task,
        samples=samples,
        epochs=config.training.epochs,
        max_steps=config.training.max_steps,
        data=data,
        rollouts=rollouts,
    )


def _resolve_auto_family(config: Config, where: str) -> None:
    """family: auto -> the family of the checkpoint's config.json `model_type` (a registered one, or one made from
    the model type's parallel plans), decided once, here: config.yaml and every rank then name it."""
    if config.model.family != AUTO:
        return
    if config.model.size == "tiny" or not config.model.source:
        raise UserError(
            f"{where}: family=auto reads model_type from a checkpoint's config.json: name it with model=FOLDER or "
            f"a Hub name (size=full), or name the family of a tiny model (e.g. family=llama)"
        )
    try:
        hf_config = load_hf_config(resolve_model_path(config.model.source))
    except UserError:
        raise
    except Exception as exc:  # transformers and the Hub client raise many types; all mean "cannot read it"
        raise UserError(
            f"{where}: family=auto cannot read the config.json of model={config.model.source!r} ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0][:160]}); pass a local folder or name the family"
        ) from None
    config.model.family = family_for_model_type(hf_config.model_type, f"model={config.model.source!r} (config.json)")


def load_config(recipe: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read a recipe (or none: defaults only) and apply overrides (config.parse_config), resolve family=auto, and
    check the keys, alone and against the family, trackers and engine; every error names the file or key."""
    config, where = parse_config(recipe, overrides)
    _resolve_auto_family(config, where)
    family = config.model.family or "unknown"
    config.recipe = f"{family}-{config.recipe}" if config.recipe else family
    validate(config, where)
    return config


def _check_unread_keys(config: Config, bad) -> None:
    """Keys another head or engine reads, set (to other than their default) where they would change nothing:
    refused, as another task kind's keys are (tasks.kinds.check_task_keys)."""
    head = head_of(config.model.task)
    if config.memory.loss_chunk_tokens != MemorySection.loss_chunk_tokens:
        if head is not HeadKind.CAUSAL_LM:
            raise bad(
                "loss_chunk_tokens", f"chunks a language model's head, and task={config.model.task} has none; drop it"
            )
        if Engine(config.parallel.engine) is Engine.DEEPSPEED:
            why = "is engine=torch's (under engine=deepspeed the model computes its whole logits); drop it"
            raise bad("loss_chunk_tokens", f"{why} or use engine=torch")
    if head is HeadKind.CAUSAL_LM:
        for key in ("num_labels", "problem_type"):
            if getattr(config.model, key) != getattr(ModelSection, key):
                why = "shapes a classification head"
                raise bad(key, f"{why}, and task={config.model.task} trains the language-model head; drop it")


def validate(config: Config, where: str = "config") -> None:
    """Checks that need no model, data or processes: ranges and combinations of keys (config.check_keys), the
    keys task kinds own (tasks.kinds.check_task_keys: each kind's checks of its keys, and another kind's keys
    refused), and those that need the family, the trackers or the engine. load_config, --check (preflight) and a
    SageMaker job's check all come through here."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{where}: {key}={config.value(key)!r} {why}")

    try:
        family = get_family(config.model.family)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    check_keys(config, where)
    check_task_keys(config.model.task, {name: getattr(config, name) for name in SECTION_CLASSES}, bad)
    _check_unread_keys(config, bad)
    _check_parallel(config, bad)
    if config.data.packing and Engine(config.parallel.engine) is Engine.DEEPSPEED:
        raise bad(
            "packing",
            "is engine=torch's (one process, tensor, pipeline and sharded data parallelism); use "
            "engine=torch or packing=false",
        )
    try:
        trackers = destinations(config.logging.report_to)
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    # mlflow and wandb are not in the core setup (requirements.txt): a run that reports to one says so here, in one
    # line, not as an ImportError on every rank once the model is loaded
    missing = [name for name in trackers if name in ("mlflow", "wandb") and importlib.util.find_spec(name) is None]
    if missing:
        raise bad("report_to", f"needs {' and '.join(missing)}: make setup-all, or pip install -r requirements-all.txt")
    waiting = set(trackers) & set(TIMED_TRACKERS)
    if waiting and config.logging.tracker_timeout_s + TRACKER_GRACE_S >= config.parallel.collective_timeout_s:
        raise bad(
            "tracker_timeout_s",
            f"must be more than {TRACKER_GRACE_S:g} s below "
            f"collective_timeout_s={config.parallel.collective_timeout_s:g}: "
            f"the other ranks wait that long in a collective while rank 0 starts {' and '.join(sorted(waiting))}",
        )
    if head_of(config.model.task) not in family.tasks:
        # the heads it has, then the other kinds that train one of them (sft and dpo: the causal LM's)
        valid = (*family.tasks, *(k.key for k in all_kinds() if k.key not in family.tasks and k.head in family.tasks))
        raise bad("task", f"is not supported by family {config.model.family}; valid: {', '.join(valid)}")
    if config.model.size == "full" and config.model.source is None and not family.default_model:
        raise bad("model", "must name a Hub model or a local folder")
    deepspeed_engine.validate(parallel=config.parallel, training=config.training, where=where)


def _check_parallel(config: Config, bad) -> None:
    """Degrees, sharding, micro-batches, partitions, and what does not combine with a pipeline."""
    tp = config.parallel.tensor_parallel_degree
    if tp != "auto" and tp < 1:
        raise bad("tensor_parallel_degree", "must be a positive integer or 'auto'")
    if config.parallel.shard_group_size is not None and config.parallel.shard_group_size < 1:
        raise bad("shard_group_size", "must be a positive integer (or null: the data-parallel ranks of one node)")
    if config.parallel.shard_group_size is not None and not Sharding(config.parallel.sharding).hybrid:
        raise bad("shard_group_size", f"only applies to sharding=hybrid, not sharding={config.parallel.sharding}")
    if config.training.peak_tflops is not None and config.training.peak_tflops <= 0:
        raise bad("peak_tflops", "must be a positive number of TFLOP/s per device (or null: known GPU or measured)")
    if config.training.compile is True and tp != "auto" and tp > 1:
        raise bad("compile", f"with tensor_parallel_degree={tp} {COMPILE_WITH_TP}")
    if config.training.compile is True and Engine(config.parallel.engine) is Engine.DEEPSPEED:
        raise bad(
            "compile", "is engine=torch's (regional compilation of each block); use engine=torch or compile=false"
        )
    if config.parallel.gradient_bucket_mib <= 0:
        raise bad("gradient_bucket_mib", "must be a positive number of MiB")
    if config.parallel.pipeline_parallel_degree < 1:
        raise bad("pipeline_parallel_degree", "must be a positive integer")
    if config.parallel.microbatches is not None and config.parallel.microbatches < 1:
        raise bad("microbatches", "must be a positive integer (or null: 2 x the number of stages)")
    if config.parallel.virtual_stages < 1:
        raise bad("virtual_stages", "must be a positive integer")
    if config.parallel.partition != "auto" and not (
        config.parallel.partition
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in config.parallel.partition)
    ):
        raise bad("partition", "must be 'auto' or a list of block counts >= 1, one per stage, e.g. [3, 2]")
    if config.parallel.pipeline_parallel_degree > 1:
        if Engine(config.parallel.engine) is Engine.DEEPSPEED:
            raise bad(
                "pipeline_parallel_degree",
                "does not combine with engine=deepspeed (its pipeline engine needs a PipelineModule); use engine=torch",
            )
        if Sharding(config.parallel.sharding).fsdp:
            raise bad(
                "pipeline_parallel_degree",
                f"does not combine with sharding={config.parallel.sharding} yet; use "
                "sharding=optimizer (ZeRO-1) or none with pipeline parallelism",
            )
        if config.memory.offload_activations:
            raise bad(
                "pipeline_parallel_degree",
                "does not combine with offload_activations=true (activations "
                "cross stages); use activation_checkpointing instead",
            )
