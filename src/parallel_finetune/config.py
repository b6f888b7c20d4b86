"""The run configuration, read from a recipe YAML plus `key=value` overrides.

Each recipe section (`model:`, `data:`, `training:`, `parallel:`, `memory:`, `peft:`, `checkpoint:`, `output:`,
`logging:`) is a typed dataclass below, the one place its keys, types, defaults and meanings are written (the
comments become docs/configuration.md; `Continues[...]` marks what may change when a run continues); `Config` holds
every section's keys, flat. A recipe may nest its keys under their section or write them flat; both mean the same.
A `tiny:` section holds overrides applied only when `size=tiny` (a from-scratch tiny model wants other
hyperparameters than a pretrained 6B one).
`extends: tp.yaml` starts from another recipe (a path relative to this one) and changes only what it lists.
Overrides on the command line win over everything and use the flat key (`lr=1e-4`) or the dotted one
(`training.lr=1e-4`); dictionary keys take a dotted suffix (`model_config.n_layer=4`). An override of a string key
(a path, a name: TEXT_KEYS) is taken as written, not read as YAML; an empty one (`data_dir=`) is null.
A recipe is data: YAML anchors and aliases (`&name`, `*name`), which can expand a few hundred bytes without bound,
are refused, as are keys given twice.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml

from .errors import UserError

T = TypeVar("T")


# What may differ when a run continues from a checkpoint: its length, cadences, where outputs go, and the layout
# (checkpoints reshard on load). A field so marked is `Continues[its type]`; any other (model, data, optimizer,
# schedule, seed, precision) would mix two runs' settings in one trajectory, so continuing with another value is
# refused (checkpoint.check_continuation). The mark is invisible to type checks and coercion.
CONTINUES = "may change when a run continues"
Continues = Annotated[T, CONTINUES]


@dataclass
class ModelSection:
    """`model:` What is fine-tuned: the family, the checkpoint (or a tiny model built from config), the task."""

    family: str = ""  # gptj|gpt2|gptneo|bert|llama|qwen3|mistral, a model type with plans (olmo2), or auto
    model: str | None = None  # Hub name or local folder (size=full only); None = the family's full-size default
    revision: str | None = None  # Hub branch, tag or commit of `model`, e.g. float16 (GPT-J's fp16 weights)
    size: Literal["full", "tiny"] = "full"  # tiny = a small model from config, for CPUs and tests
    # classification = a sequence-classification head (any number of classes, or one regression output), scored on
    # the labels; causal_lm = next-token prediction on the text column; sft = instruction tuning: conversations
    # (messages, prompt/completion, ShareGPT or plain text rows) rendered by a chat template, the language-model
    # head trained on the answers' tokens (train_on); dpo = preference tuning: pairs of a prompt, a chosen and a
    # rejected answer, the language-model head trained to prefer the chosen one (the `preference:` section);
    # reward = reward modelling on dpo's pairs (an optional `margin` column): a one-output sequence-classification
    # head trained to score the chosen answer above the rejected one (TRL's RewardTrainer, docs/reward.md)
    task: Literal["classification", "causal_lm", "sft", "dpo", "reward"] = "classification"
    # task=classification's head width; None = the number of distinct training labels (1: regression)
    num_labels: int | None = None
    # task=classification's (like num_labels, refused with another task); transformers' name; auto = regression
    # when the training labels are numbers with fractions, else classification
    problem_type: Literal["auto", "single_label_classification", "regression"] = "auto"

    @property
    def source(self) -> str | None:
        """The `model:` key under a name that does not repeat its section's (code reads config.model.source)."""
        return self.model

    model_config: dict = field(default_factory=dict)  # overrides of the transformers config (e.g. n_layer)
    tokenizer: str | None = None  # None = the model's own (full) or a BPE trained on the train split (tiny)
    tokenizer_vocab_size: int = 8192  # of the BPE trained for tiny models


@dataclass
class DataSection:
    """`data:` Where the rows come from and how they become batches."""

    # a GLUE task by name: its files read from data_dir in GLUE's own layout, else from the Hub (nyu-mll/glue); its
    # official metric(s). Used when neither train_file nor dataset is given.
    glue_task: Literal["cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"] = "sst2"
    data_dir: str | None = None  # the glue_task's folder of GLUE files; None = the Hub (sst2: else the sample)
    # your own rows (transformers' run_glue.py names): .csv, .tsv, .jsonl/.json or .parquet files with a header
    train_file: str | None = None
    validation_file: str | None = None  # None = validation_split_percentage of train held out
    test_file: str | None = None  # what predict=true predicts (labels, if any, are not needed)
    dataset: str | None = None  # a save_to_disk folder or a Hub data set name (splits train, validation, test)
    dataset_config: str | None = None  # the Hub data set's configuration name, if it has several
    text_column: str | None = None  # the text; None = sentence, text or sentence1, the first the data has
    text_pair_column: str | None = None  # the second text of a pair task; None = sentence2 beside sentence1, else none
    label_column: str = "label"  # class names or ids (any values: sorted, they become ids), or regression targets
    # task=sft: the column of each row's conversation (a list of {role, content}); None = messages, or ShareGPT's
    # conversations ({from, value}), the first the data has
    messages_column: str | None = None
    # task=sft: a prompt/completion row's prompt; task=dpo: a pair's prompt (text or messages); None = prompt
    prompt_column: str | None = None
    completion_column: str | None = None  # task=sft: its completion (text or messages); None = completion
    chosen_column: str | None = None  # task=dpo: the preferred answer (text or messages); None = chosen
    rejected_column: str | None = None  # task=dpo: the other answer (text or messages); None = rejected
    # task=sft and dpo: the chat template rendering conversations: a built-in name (chatml) or a Jinja file; None =
    # the tokenizer's own (a tiny model's: chatml)
    chat_template: str | None = None
    train_on: Literal["answers", "all"] = "answers"  # task=sft: the loss on the assistant turns only, or every token
    validation_split_percentage: float = 10.0  # with no validation split: this share of train held out (seeded by seed)
    cache_dir: Continues[str] = "data/cache"  # tokenized datasets, reused by every run with the same tokenizer and data
    # truncation length (classification, sft; dpo: each answer's row, prompt + answer, the prompt never cut) or block
    # size (causal_lm)
    max_length: int = 128
    group_by_length: bool = True  # fill each global batch with sentences of similar length (less padding)
    # training batches packed: each rank's rows of a step laid end to end in sequences of at most max_length tokens
    # (dpo: a pair's two rows together, in sequences of 2 x max_length); attention and targets never cross rows; the
    # same rows and loss as unpacked, fewer padding slots
    packing: bool = False
    eval_batch_size: Continues[int] = 64  # rows per evaluation forward, per data-parallel rank


@dataclass
class TrainingSection:
    """`training:` The optimizer, its schedule, precision, length and cadences of the run."""

    epochs: Continues[float] = 1.0  # passes over the train split (fractions allowed)
    max_steps: Continues[int | None] = None  # when set, wins over epochs
    batch_size: int = 32  # global: summed over data-parallel ranks and accumulation steps
    gradient_accumulation_steps: Continues[int] = 1  # accumulation slices per step; the global batch stays batch_size
    lr: float = 5e-5  # peak learning rate of AdamW
    weight_decay: float = 0.01  # AdamW, on weight matrices only (not biases and norms)
    adam_betas: list = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    adam_eps: float = 1e-8  # AdamW epsilon
    # the transformers.get_scheduler schedules that need nothing but the warm-up and total steps
    lr_scheduler: Literal[
        "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt"
    ] = "linear"
    warmup_steps: int = 0  # linear warm-up from 0 to lr
    warmup_ratio: float = 0.0  # used when warmup_steps is 0
    max_grad_norm: float | None = 1.0  # None or 0 = no clipping
    # compute dtype under autocast (master weights stay fp32; fp16 adds dynamic loss scaling); auto = bf16 on a GPU
    # of compute capability 8.0 or above (A100, A10G, L4, H100), fp16 on older ones (V100, T4); on a CPU bf16 where
    # it has bf16 units, else fp32
    precision: Literal["auto", "fp16", "bf16", "fp32"] = "auto"
    initial_loss_scale: float = 65536.0  # fp16: the first loss scale
    loss_scale_growth_interval: int = 2000  # fp16: clean steps before the scale doubles
    # model initialisation, data order, dropout masks: the same seed repeats a run in its layout and a resume
    # continues it exactly; other layouts train alike with dropout off (each rank draws its own dropout masks)
    seed: int = 42
    eval_every: Continues[int | None] = None  # steps between dev evaluations; the end of training always evaluates
    log_every: Continues[int] = 10  # steps between log lines and metrics.jsonl records
    # task=sft only: every N steps and at the end, greedy answers to the prompts of the first generate_prompts
    # validation conversations, written to generations.jsonl, the log and the trackers; 0 = off
    generate_every: Continues[int] = 0
    generate_prompts: Continues[int] = 4  # how many validation prompts generate_every answers
    # the most new tokens of one answer; it stops earlier at the template's end-of-turn token or EOS, or where
    # prompt and answer reach max_length
    generate_max_new_tokens: Continues[int] = 64
    # linear = when batch_size differs from the recipe's, lr = recipe lr / recipe batch_size x batch_size
    lr_scaling: Literal["none", "linear"] = "none"
    # torch.compile each transformer block (regional: one small graph, compiled once); auto = on for GPU runs of at
    # least 1,000 steps (COMPILE_AUTO_MIN_STEPS: what a real-size model needs to earn the ~1 min compile back; a
    # small one needs thousands, docs/speed.md), off for shorter ones, on CPUs (a compiled MiniLM step measured
    # 1.16x slower than eager there) and under tensor parallelism (where torch 2.13 fails to compile the sharded
    # blocks; compile=true with it is an error)
    compile: Continues[bool | Literal["auto"]] = "auto"
    # per device, for MFU; None = known GPU's 16-bit peak, CPU's theoretical
    peak_tflops: Continues[float | None] = None
    # A step whose loss or gradient norm is NaN/inf is skipped, never applied; this many in a row stop the run with
    # an error (a diverged run only wastes compute). fp16 overflows count only once the loss scale is down to 1,
    # where halving it again cannot help (DeepSpeed's min_loss_scale rule).
    max_nonfinite_steps: Continues[int] = 3


@dataclass
class ParallelSection:
    """`parallel:` How the processes split the model and the batch: tensor, pipeline and data parallelism, sharding."""

    tensor_parallel_degree: Continues[int | Literal["auto"]] = "auto"  # auto = every process of one node
    # auto = cuda (nccl) when GPUs are visible, else cpu (gloo)
    device: Continues[Literal["auto", "cpu", "cuda"]] = "auto"
    # How long a rank waits in a collective for the others (a stopped, hung or dead peer) before it gives up with
    # an error naming this key. Long enough for rank 0 to tokenize SST-2 or write a checkpoint while others wait.
    # From 1 s to a week (604800).
    collective_timeout_s: Continues[float] = 600.0
    # How the data-parallel ranks hold the training state: none = every rank a full copy; optimizer = AdamW
    # state sharded (ZeRO-1); full = parameters, gradients and optimizer state sharded (FSDP2); hybrid = sharded
    # inside groups of `shard_group_size` ranks, replicated across groups (MiCS / HSDP).
    sharding: Continues[Literal["none", "optimizer", "full", "hybrid"]] = "none"
    shard_group_size: Continues[int | None] = None  # hybrid only; None = the data-parallel ranks of one node
    # sharding=none: sum data-parallel gradients in buckets of gradient_bucket_mib while the backward runs
    overlap_gradients: Continues[bool] = True
    gradient_bucket_mib: Continues[float] = 25.0  # size of those buckets: fewer collectives vs an earlier start
    # Who runs the data-parallel optimizer: torch = this repo's (tensor parallel, `sharding`); deepspeed = DeepSpeed's
    # ZeRO, data parallel only (tensor_parallel_degree=auto means 1 there, sharding must be none).
    engine: Literal["torch", "deepspeed"] = "torch"
    # deepspeed: what ZeRO shards, 1 = optimizer state, 2 = + gradients, 3 = + parameters; None = the stage in
    # deepspeed_config, else 2
    zero_stage: Literal[1, 2, 3] | None = None
    mics_shard_size: int | None = None  # deepspeed, zero_stage=3: shard inside groups of N ranks (MiCS)
    # a DeepSpeed JSON to start from: the recipe fills what it lacks ("auto" counts as lacking) and a value
    # contradicting the recipe is an error, never silently overridden
    deepspeed_config: str | None = None
    # Pipeline parallelism: the blocks cut into consecutive stages, one (or, interleaved, several) per rank.
    pipeline_parallel_degree: Continues[int] = 1
    microbatches: Continues[int | None] = None  # per pipeline step (each accumulation step); None = 2 x stages
    # torch.distributed.pipelining schedule
    pipeline_schedule: Continues[Literal["gpipe", "1f1b", "interleaved"]] = "1f1b"
    virtual_stages: Continues[int] = 2  # interleaved only: stages per rank
    partition: Continues[Literal["auto"] | list] = "auto"  # auto = balanced by compute; [a, b, ...] = blocks per stage


@dataclass
class MemorySection:
    """`memory:` Activation memory: recomputation and offloading."""

    activation_checkpointing: Continues[bool | int] = False  # true = every block; N = every N-th block
    offload_activations: Continues[bool] = False  # keep saved activations in CPU memory until the backward needs them
    # a language model's head and loss are computed together, this many target tokens at a time, never holding every
    # token's logits over the whole vocabulary (under tensor parallelism each rank only its vocabulary shard's);
    # 0 = the whole logits at once (every position over the whole vocabulary, as transformers computes them).
    # engine=torch's language-model tasks only: set under task=classification or engine=deepspeed it is refused
    loss_chunk_tokens: Continues[int] = 1024


@dataclass
class PeftSection:
    """`peft:` Parameter-efficient fine-tuning (LoRA)."""

    # lora = the pretrained weights frozen (held in the compute dtype when training in 16-bit), a rank-`lora_rank`
    # update B·A scaled by lora_alpha / lora_rank trained on `lora_target_modules`, plus `lora_modules_to_save`
    peft: Literal["none", "lora"] = "none"

    @property
    def method(self) -> str:
        """The `peft:` key under a name that does not repeat its section's (code reads config.peft.method)."""
        return self.peft

    lora_rank: int = 8  # r: the inner width of each adapter (A is r x in, B is out x r)
    lora_alpha: float = 16.0  # the update is scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapter's input (the base layer sees the undropped input)
    # default = the family's (attention q and v; GPT-2: c_attn), all-linear = every Linear of every block, or a
    # list of module names (a name or dotted tail of a path inside a block: q_proj, attention.output.dense)
    lora_target_modules: Literal["default", "all-linear"] | list = "default"
    lora_modules_to_save: list | None = None  # trained in full; None = the classification head (none for causal_lm)
    # also export hf/: the base with B·A merged in (the adapter goes to adapter/)
    lora_export_merged: Continues[bool] = False
    # nf4 = QLoRA: the frozen base's Linear weights inside the blocks held in 4-bit NormalFloat with double
    # quantization (torchao's NF4), dequantized to the compute dtype in each matmul; embeddings, norms, biases and
    # heads, the adapters and the optimizer stay in full precision. Needs peft=lora and engine=torch
    lora_base_quantization: Literal["none", "nf4"] = "none"
    nf4_block_size: int = 64  # elements per absmax scaler (QLoRA's 64); each shard must hold whole scaler groups
    nf4_scaler_block_size: int = 256  # scalers per int8 group of the double quantization (QLoRA's 256)


# the pair losses that compare the policy with nothing but itself: no reference pass runs for them
REFERENCE_FREE_LOSSES = ("simpo", "orpo")


@dataclass
class PreferenceSection:
    """`preference:` task=dpo's loss: how the policy's preference for the chosen answer over the rejected one,
    measured against the reference model (the model before training; with LoRA the same model with its adapters
    disabled) or, for simpo and orpo, on its own, is turned into a loss (docs/preference.md)."""

    # sigmoid = DPO (Rafailov et al.); ipo = IPO's squared loss on length-normalised log-probabilities (Azar et
    # al.); hinge = SLiC's; robust = robust DPO (Chowdhury et al.), unbiased under dpo_label_smoothing's label
    # noise. Reference-free (no reference pass): simpo = SimPO (Meng et al., TRL's CPOTrainer loss_type=simpo);
    # orpo = ORPO's odds ratio plus the chosen rows' NLL (Hong et al., TRL's ORPOTrainer)
    dpo_loss: Literal["sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"] = "sigmoid"
    # beta: DPO's reference pull (rewards are beta x (policy - reference) log-probabilities); simpo's reward scale;
    # orpo's weight of the odds-ratio term (its lambda)
    dpo_beta: float = 0.1
    # simpo's target reward margin gamma: the loss asks beta x (average chosen - average rejected) to exceed it
    simpo_gamma: float = 0.5
    # the share of pairs assumed to be labelled the wrong way round (cDPO with sigmoid, robust DPO); 0 = none
    dpo_label_smoothing: float = 0.0
    # RPO: + rpo_alpha x the chosen answer's negative log-likelihood per token, for each pair; 0 = off
    rpo_alpha: float = 0.0
    # log-probabilities averaged over each answer's tokens instead of summed (ipo always averages)
    dpo_length_normalized: bool = False
    # task=reward's reward centring (TRL's): + this x the mean of (r_chosen + r_rejected)^2, which pulls the scores
    # towards 0 (e.g. 0.01); None = off
    center_rewards_coefficient: float | None = None


@dataclass
class CheckpointSection:
    """`checkpoint:` Sharded checkpoints: cadence, rotation, resume."""

    # steps between sharded checkpoints; one is always written at the end
    checkpoint_every: Continues[int | None] = None
    keep_checkpoints: Continues[int] = 2  # the newest N complete checkpoints are kept
    # auto = continue from the newest complete checkpoint in the checkpoint folder, if any (so torchrun restarts
    # and SageMaker spot restarts just work); none = start fresh; a path = that checkpoint
    resume: Continues[str] = "auto"
    checkpoint_dir: Continues[str | None] = None  # None = output_dir/checkpoints (on SageMaker /opt/ml/checkpoints)


@dataclass
class OutputSection:
    """`output:` Where the run writes and what it exports."""

    output_dir: Continues[str | None] = None  # None = a new folder runs/<recipe>-<time>
    overwrite: Continues[bool] = False  # allow writing into an output_dir that already holds files
    export: Continues[bool] = True  # write the fine-tuned model as a Hugging Face folder (hf/) at the end
    export_dtype: Continues[Literal["float32", "bfloat16", "float16"]] = "float32"  # dtype of the exported weights
    # after training, predict the test split: predictions.tsv in GLUE's submission format (index, prediction)
    predict: Continues[bool] = False


@dataclass
class LoggingSection:
    """`logging:` Where metrics go besides metrics.jsonl and the progress bar."""

    # trackers besides metrics.jsonl and the progress bar: tensorboard, mlflow, wandb (offline unless WANDB_MODE
    # says otherwise), a list of them, all or none; MLflow and W&B read their own environment variables
    # (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME, WANDB_MODE, WANDB_PROJECT, WANDB_DIR)
    report_to: Continues[Literal["tensorboard", "mlflow", "wandb", "all", "none"] | list] = "tensorboard"
    run_name: Continues[str | None] = None  # the run's name in MLflow / W&B; None = the run folder's name
    # How long MLflow and W&B may take to start their run (an unreachable server, a store that hangs) before the run
    # stops with an error naming the tracker; the other ranks wait for rank 0 that long. From 1 s to 10 minutes,
    # and below collective_timeout_s.
    tracker_timeout_s: Continues[float] = 30.0


# The recipe's sections, in the order a recipe and docs/configuration.md list them; `Config` has every key of each.
SECTION_CLASSES: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "training": TrainingSection,
    "parallel": ParallelSection,
    "memory": MemorySection,
    "peft": PeftSection,
    "preference": PreferenceSection,
    "checkpoint": CheckpointSection,
    "output": OutputSection,
    "logging": LoggingSection,
}


# Bookkeeping the loader sets, not users: the recipe's name, and what lr_scaling did (for the log).
BOOKKEEPING_DEFAULTS = {"recipe": "", "lr_note": ""}


@dataclass
class Config:
    """A whole run's configuration: one field per recipe section (`config.training`, `config.parallel`, ...), each
    its section's dataclass, as one typed value. Components receive the sections they use, never this; only the
    entry points, `resolve` and `preflight` read the whole of it. For them a key also reads (and the loader
    writes) flat, `config.lr` being `config.training.lr`, except where a key has its section's name: `model`
    (`config.model.source`) and `peft` (`config.peft.method`)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    peft: PeftSection = field(default_factory=PeftSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    output: OutputSection = field(default_factory=OutputSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    recipe: str = ""
    lr_note: str = ""

    def __getattr__(self, key: str):  # only asked when `key` is no field: a flat key
        section = _SECTION_OF.get(key)
        if section is None or key.startswith("__"):
            raise AttributeError(f"Config has no key {key!r}")
        return getattr(self.__dict__[section], key)

    def __setattr__(self, key: str, value) -> None:
        section = _SECTION_OF.get(key)
        if section is None or key in SECTION_CLASSES:
            object.__setattr__(self, key, value)
        else:
            setattr(self.__dict__[section], key, value)

    @classmethod
    def from_flat(cls, values: dict) -> Config:
        """A Config from flat keys (a recipe's typed values, a checkpoint's config.yaml); unknown keys: TypeError."""
        unknown = set(values) - set(_SECTION_OF) - set(BOOKKEEPING_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown config keys: {', '.join(sorted(unknown))}")
        sections = {
            name: section(**{key: values[key] for key in SECTIONS[name] if key in values})
            for name, section in SECTION_CLASSES.items()
        }
        return cls(**sections, **{key: values[key] for key in BOOKKEEPING_DEFAULTS if key in values})

    def to_dict(self) -> dict:
        """Every key, flat, in the sections' order (config.yaml, checkpoints), then the bookkeeping."""
        flat = {}
        for name in SECTION_CLASSES:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return {**flat, "recipe": self.recipe, "lr_note": self.lr_note}

    def value(self, key: str):
        """A key's value by its flat name (`model` is the model section's `model` key here, not the section)."""
        return getattr(self.__dict__[_SECTION_OF[key]], key)

    def replace(self, **changes) -> Config:
        """A copy with flat keys changed (dataclasses.replace for the flat view)."""
        return Config.from_flat({**self.to_dict(), **changes})


SECTIONS: dict[str, tuple[str, ...]] = {
    name: tuple(f.name for f in dataclasses.fields(section)) for name, section in SECTION_CLASSES.items()
}
_SECTION_OF = {key: name for name, keys in SECTIONS.items() for key in keys}
USER_KEYS = tuple(k for keys in SECTIONS.values() for k in keys)
FIELDS = {f.name: f for section in SECTION_CLASSES.values() for f in dataclasses.fields(section)}  # flat
_HINTS = {key: hint for section in SECTION_CLASSES.values() for key, hint in typing.get_type_hints(section).items()}
# Continues[...] marks what may differ when a run continues from a checkpoint (see its definition).
CONTINUATION_MAY_CHANGE = tuple(
    key
    for section in SECTION_CLASSES.values()
    for key, hint in typing.get_type_hints(section, include_extras=True).items()
    if CONTINUES in getattr(hint, "__metadata__", ())
)


def _options(key: str) -> tuple:
    """The types a field accepts: `int | None` -> (int, NoneType)."""
    hint = _HINTS[key]
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


# Keys whose value is a string (paths, names, revisions): YAML parsing of `key=value` would cut a path at ` #`, fold
# a newline into a space and read `~` as null, so their override text is kept as written.
TEXT_KEYS = tuple(k for k in USER_KEYS if str in _options(k) and set(_options(k)) <= {str, type(None)})


def _unknown_key(key: str, where: str) -> UserError:
    close = difflib.get_close_matches(key, USER_KEYS, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return UserError(f"{where}: unknown key '{key}'; {hint}valid keys: {', '.join(USER_KEYS)}")


COMPILE_AUTO_MIN_STEPS = 1000
# collective_timeout_s: under a second is a healthy collective's jitter (or milliseconds meant); beyond a week no
# hang is worth waiting for, and 1e300 overflows the timedelta the process group is given.
COLLECTIVE_TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)
TRACKER_TIMEOUT_RANGE_S = (1.0, 600.0)


# Measured with torch 2.13 (2026-11-27): compiling a block whose Linear weights are DTensor shards fails while
# AOTAutograd traces its backward (RecursionError with dynamic shapes, AttributeError '_local_tensor' with static
# ones), in one process per rank as on any number. One process, FSDP and pipeline stages compile.
COMPILE_WITH_TP = (
    "fails on tensor-parallel blocks under torch 2.13 (tracing a sharded block's backward raises); use "
    "compile=false, or compile with FSDP (sharding=full), pipeline stages or one process"
)


def refuse_compile_with_tp(compile: bool | str, tensor_parallel: int) -> None:
    """compile=true under tensor parallelism (COMPILE_WITH_TP): at --check and on every rank, the same line."""
    if compile is True and tensor_parallel > 1:
        raise UserError(f"compile=true with tensor_parallel_degree={tensor_parallel} {COMPILE_WITH_TP}")


def _coerce(key: str, value: Any, where: str) -> Any:
    """Check `value` against the field's type; accept the spellings YAML and shells produce (e.g. '1e-5')."""
    options = _options(key)
    for option in options:
        ok, converted = _try(option, value)
        if ok:
            return converted
    wanted = " or ".join(_describe(o) for o in options)
    if key in TEXT_KEYS and not isinstance(value, (dict, list, type(None))):  # an unquoted 2024, true, 2024-01-01
        wanted += f' (YAML read the unquoted value as {type(value).__name__}; quote it: {key}: "...")'
    raise UserError(f"{where}: {key}={value!r} is not valid; expected {wanted}")


def _try(option: Any, value: Any) -> tuple[bool, Any]:
    if option is type(None):
        return (value is None or (isinstance(value, str) and value.lower() in ("null", "none"))), None
    if typing.get_origin(option) is Literal:
        return (value in typing.get_args(option)), value
    if option is bool:
        if isinstance(value, bool):
            return True, value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return True, value.lower() == "true"
        return False, None
    if option is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, None
    if option is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, None
        return False, None
    if option is str:
        return isinstance(value, str), value
    if option in (dict, list):
        return isinstance(value, option), value
    raise TypeError(f"unsupported config type {option}")


def _describe(option: Any) -> str:
    if option is type(None):
        return "null"
    if typing.get_origin(option) is Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(option))
    return {
        int: "an integer",
        float: "a number",
        bool: "true|false",
        str: "a string",
        dict: "a mapping",
        list: "a list",
    }[option]


class _Lined(dict):
    """A YAML mapping that remembers the line of each key, so errors can name it."""

    lines: dict


class _Refused(Exception):
    """YAML the recipe loader refuses although YAML allows it; the message starts with the line."""


class _RecipeLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping and anchors and aliases, and records each key's
    line. An alias is a reference, so nested ones ("billion laughs") describe an exponentially large value in a few
    hundred bytes; recipes have `extends:` for reuse and need none."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise _Refused(
                f"line {event.start_mark.line + 1}: YAML {'alias' if sign == '*' else 'anchor'} "
                f"{sign}{event.anchor} is not accepted (recipes are plain data); write the value out, "
                "or share settings with extends:"
            )
        return super().compose_node(parent, index)


def _construct_mapping(loader: _RecipeLoader, node: yaml.MappingNode) -> _Lined:
    loader.flatten_mapping(node)
    lines: dict = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in lines:
                raise _Refused(
                    f"line {line}: key '{key}' is given twice (first at line {lines[key]}); YAML would silently "
                    "keep the last one, so say it once"
                )
        except TypeError:  # an unhashable key: construct_mapping's own error names it
            continue
        lines[key] = line
    mapping = _Lined(loader.construct_mapping(node, deep=True))
    mapping.lines = lines
    return mapping


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml(text: str):
    """yaml.safe_load, refusing duplicate keys, anchors and aliases (raises yaml.YAMLError or _Refused)."""
    return yaml.load(text, Loader=_RecipeLoader)


def _plain(value: Any) -> Any:
    """A parsed value without line bookkeeping (plain dicts: what yaml.safe_dump writes back)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _flatten_recipe(data: dict, where: str) -> tuple[dict, dict]:
    """Split a recipe mapping into (flat keys, tiny-size overrides), accepting section nesting. A key set both
    flat and in its section (or in two places) is an error naming both lines."""
    flat: dict = {}
    tiny: dict = {}
    set_at: dict[str, str] = {}  # key -> where it was set, for the error on a second setting

    def line(mapping, key) -> str:
        number = getattr(mapping, "lines", {}).get(key)
        return f"line {number}" if number else "another place"

    def put(key: str, value, mapping, spelled: str) -> None:
        here = f"{spelled} at {line(mapping, key)}"
        if key in set_at:
            raise UserError(f"{where}: {key} is set twice ({set_at[key]}, {here}); say it once")
        set_at[key] = here
        flat[key] = _plain(value)

    for key, value in data.items():
        if key == "tiny":
            if not isinstance(value, dict):
                raise UserError(f"{where}: 'tiny' must be a mapping of overrides for size=tiny")
            tiny.update(_flatten_recipe(value, f"{where} (tiny)")[0])
        elif key in SECTIONS and isinstance(value, dict):
            for sub_key, sub_value in value.items():
                if sub_key not in SECTIONS[key]:
                    raise _unknown_key(sub_key, f"{where} section '{key}'")
                put(sub_key, sub_value, value, f"{key}.{sub_key}")
        elif key in USER_KEYS:
            put(key, value, data, key)
        else:
            raise _unknown_key(key, where)
    return flat, tiny


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` -> (flat key, YAML-parsed value). `model_config.n_layer=4` -> ('model_config', {'n_layer': 4}).
    A TEXT_KEYS value is the text as written (`output_dir=/runs/run #2` is that folder); empty means null."""
    if "=" not in text:
        raise UserError(
            f"override '{text}' must look like key=value (e.g. lr=1e-4); valid keys: {', '.join(USER_KEYS)}"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if parts[0] in SECTIONS and len(parts) > 1:
        if parts[1] not in SECTIONS[parts[0]]:
            raise _unknown_key(parts[1], f"override '{text}'")
        parts = parts[1:]
    if parts[0] not in USER_KEYS:
        raise _unknown_key(parts[0], f"override '{text}'")
    if len(parts) == 1 and parts[0] in TEXT_KEYS:
        return parts[0], raw if raw.strip() else None
    try:
        value = _plain(_yaml(raw)) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    except _Refused as exc:
        raise UserError(f"override '{text}': {exc}") from None
    if len(parts) > 1:
        if _HINTS[parts[0]] is not dict:
            raise UserError(f"override '{text}': '{parts[0]}' is not a mapping, write {parts[0]}=VALUE")
        nested: Any = value
        for part in reversed(parts[1:]):
            nested = {part: nested}
        return parts[0], nested
    return parts[0], value


def _merge(base: dict, key: str, value: Any) -> None:
    if isinstance(value, dict) and isinstance(base.get(key), dict):
        merged = dict(base[key])
        for k, v in value.items():
            _merge(merged, k, v)
        base[key] = merged
    else:
        base[key] = value


def _forget(tiny: dict, key: str, value: Any) -> None:
    """Drop what a child recipe sets itself from the size=tiny overrides it inherited (a mapping key by key), so
    the parent's tiny value of it no longer wins over the child's own."""
    if isinstance(value, dict) and isinstance(tiny.get(key), dict):
        rest = dict(tiny[key])
        for sub_key, sub_value in value.items():
            _forget(rest, sub_key, sub_value)
        tiny[key] = rest
        if not rest:
            del tiny[key]
    else:
        tiny.pop(key, None)


def _read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict, dict]:
    """(flat keys, tiny-size overrides) of a recipe file, after those of the recipe it `extends`."""
    if not path.is_file():
        where = f"recipe {chain[-1]}: extends {path}" if chain else f"recipe {path}"
        raise UserError(f"{where}: no such file (recipes live in recipes/<family>/*.yaml)")
    if path.resolve() in chain:
        raise UserError(f"recipe {path}: extends itself through {' -> '.join(str(p) for p in chain)}")
    try:
        data = _yaml(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0]
        raise UserError(f"recipe {path}: not valid YAML ({first})") from None
    except _Refused as exc:
        raise UserError(f"recipe {path} {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"recipe {path}: must be a mapping of keys to values")
    values: dict = {}
    tiny: dict = {}
    base = data.pop("extends", None)
    if base is not None:
        if not isinstance(base, str):
            raise UserError(f"recipe {path}: extends must be the path of another recipe, e.g. extends: tp.yaml")
        values, tiny = _read_recipe(path.parent / base, (*chain, path.resolve()))
    own_values, own_tiny = _flatten_recipe(data, f"recipe {path}")
    for key, value in own_values.items():
        _merge(values, key, value)
        _forget(tiny, key, value)  # inherited tiny values yield to the child's own (its own tiny: wins again)
    for key, value in own_tiny.items():
        _merge(tiny, key, value)
    return values, tiny


def _refuse_model_at_tiny_size(values: dict, parsed: list[tuple[str, Any]], where: str) -> None:
    """A `model=` override with size=tiny: a tiny model is built from the family's config and reads no checkpoint,
    so the model the user named would be passed over in silence (make on a CPU passes size=tiny). A recipe's own
    `model:` is its full-size checkpoint, which size=tiny replaces by design, so only the command line's counts."""
    named = [value for key, value in parsed if key == "model"]
    if values.get("size") != "tiny" or not named or named[-1] is None:
        return
    model = named[-1]
    raise UserError(
        f"{where}: model={model!r} with size=tiny: a tiny model is built from the family's config and would not load "
        f"{model!r}; to fine-tune it pass size=full (make: SIZE=full, on a CPU too), or drop model= for the tiny model"
    )


def parse_config(recipe: str | Path | None, overrides: list[str] = ()) -> tuple[Config, str]:
    """Read a recipe (or none: defaults only) and apply overrides (types checked); returns the Config and the name
    errors give its source (`where`). resolve.load_config calls this, then check_keys and the checks that need a
    model family, a tracker or an engine; every error names the file or key."""
    values: dict = {}
    tiny: dict = {}
    name = ""
    if recipe is not None:
        values, tiny = _read_recipe(Path(recipe))
        # named as the make target that runs it (the run folder runs/<name>-<time>, --check's line, a SageMaker
        # job's name): tp_pp.yaml -> gptj-tp-pp, sft_lora.yaml -> llama-sft-lora
        name = Path(recipe).stem.replace("_", "-")
    parsed = [parse_override(text) for text in overrides]
    for key, value in parsed:
        if key == "size":
            values["size"] = value
    if values.get("size") == "tiny":
        for key, value in tiny.items():
            _merge(values, key, value)
    recipe_batch, recipe_lr = values.get("batch_size", TrainingSection.batch_size), values.get("lr", TrainingSection.lr)
    for key, value in parsed:
        _merge(values, key, value)
    where = f"recipe {recipe}" if recipe is not None else "config"
    _refuse_model_at_tiny_size(values, parsed, where)
    typed = {key: _coerce(key, value, where) for key, value in values.items()}
    config = Config.from_flat(typed)
    config.recipe = name  # resolve.load_config prefixes the family, once family=auto is resolved
    if config.lr_scaling == "linear":
        _scale_lr(
            config,
            where,
            _coerce("batch_size", recipe_batch, where),
            _coerce("lr", recipe_lr, where),
            lr_overridden=any(key == "lr" for key, _ in parsed),
        )
    if config.engine == "deepspeed" and config.tensor_parallel_degree == "auto":
        config.tensor_parallel_degree = 1  # DeepSpeed runs data parallel only: every process is a replica
    return config, where


def _scale_lr(config: Config, where: str, recipe_batch: int, recipe_lr: float, lr_overridden: bool) -> None:
    """The linear rule: the recipe's lr was tuned for its batch_size; a k times larger batch gets k times the lr."""
    if config.batch_size == recipe_batch:
        config.lr_note = f"lr_scaling=linear: batch_size {config.batch_size} is the recipe's, lr {config.lr:g} kept"
        return
    if lr_overridden:
        raise UserError(
            f"{where}: lr_scaling=linear scales the recipe's lr (tuned for batch_size={recipe_batch}) "
            f"to batch_size={config.batch_size}; drop the lr override or set lr_scaling=none"
        )
    config.lr = recipe_lr * config.batch_size / recipe_batch
    config.lr_note = (
        f"lr_scaling=linear: lr {recipe_lr:g} x batch_size {config.batch_size} / recipe batch_size "
        f"{recipe_batch} = {config.lr:g}"
    )


def check_keys(config: Config, where: str = "config") -> None:
    """Checks of the keys themselves, no model family, tracker or engine needed: ranges and combinations."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{where}: {key}={config.value(key)!r} {why}")

    _check_training(config, bad)
    _check_generation(config, bad)
    _check_sft_keys(config, bad)
    _check_preference(config, bad)
    _check_peft(config, bad)
    if not TRACKER_TIMEOUT_RANGE_S[0] <= config.tracker_timeout_s <= TRACKER_TIMEOUT_RANGE_S[1]:
        raise bad("tracker_timeout_s", "must be in [1, 600] seconds (a second to ten minutes)")
    if not isinstance(config.activation_checkpointing, bool) and config.activation_checkpointing < 0:
        raise bad("activation_checkpointing", "must be true, false or N >= 1 (checkpoint every N-th block)")


BadKey = typing.Callable[[str, str], UserError]  # (key, why) -> the one-line error naming key and value


def _check_training(config: Config, bad: BadKey) -> None:
    """Finite numbers, then the ranges of the training, data and checkpoint keys."""
    for key in USER_KEYS:  # nan passes every range check below (all comparisons are false), inf most of them
        if isinstance(getattr(config, key), float) and not math.isfinite(getattr(config, key)):
            raise bad(key, "must be a finite number")
    if not 0 < config.validation_split_percentage < 100:
        raise bad("validation_split_percentage", "must be in (0, 100): the share of train rows held out, e.g. 10")
    if config.num_labels is not None and config.num_labels < 1:
        raise bad("num_labels", "must be 1 (regression) or more, or null to count the training labels")
    if not 0 <= config.seed < 2**32:
        raise bad("seed", "must be in [0, 4294967295] (the range numpy and torch seed from)")
    if config.adam_eps <= 0:
        raise bad("adam_eps", "must be positive (it keeps AdamW's division finite), e.g. 1e-8")
    if config.weight_decay < 0:
        raise bad("weight_decay", "must be >= 0")
    if config.max_nonfinite_steps < 1:
        raise bad("max_nonfinite_steps", "must be at least 1")
    if not COLLECTIVE_TIMEOUT_RANGE_S[0] <= config.collective_timeout_s <= COLLECTIVE_TIMEOUT_RANGE_S[1]:
        raise bad(
            "collective_timeout_s",
            f"must be in [{COLLECTIVE_TIMEOUT_RANGE_S[0]:g}, {COLLECTIVE_TIMEOUT_RANGE_S[1]:g}] seconds (a second "
            "to a week): shorter fails healthy collectives, and no hang is worth waiting longer for",
        )
    for key in (
        "batch_size",
        "gradient_accumulation_steps",
        "max_length",
        "eval_batch_size",
        "log_every",
        "tokenizer_vocab_size",
        "loss_scale_growth_interval",
        "keep_checkpoints",
    ):
        if getattr(config, key) < 1:
            raise bad(key, "must be at least 1")
    if config.max_steps is not None and config.max_steps < 1:
        raise bad("max_steps", "must be at least 1 (or null to train for `epochs`)")
    if config.engine == "deepspeed" and (config.checkpoint_every or config.resume not in ("auto", "none")):
        key = "checkpoint_every" if config.checkpoint_every else "resume"
        raise bad(
            key,
            "is not supported with engine=deepspeed yet (checkpoints are engine=torch's); "
            "use engine=torch or drop the key",
        )
    if config.checkpoint_every is not None and config.checkpoint_every < 1:
        raise bad("checkpoint_every", "must be at least 1 (or null: a checkpoint at the end only)")
    if config.eval_every is not None and config.eval_every < 1:
        raise bad("eval_every", "must be at least 1 (or null: evaluate at the end only)")
    if config.max_steps is None and config.epochs <= 0:
        raise bad("epochs", "must be positive")
    if config.lr <= 0:
        raise bad("lr", "must be positive")
    if not 0 <= config.warmup_ratio < 1:
        raise bad("warmup_ratio", "must be in [0, 1)")
    if config.warmup_steps < 0:
        raise bad("warmup_steps", "must be >= 0")
    if config.loss_chunk_tokens < 0:
        raise bad("loss_chunk_tokens", "must be >= 0 (0: the whole logits at once)")
    if config.initial_loss_scale <= 0:
        raise bad("initial_loss_scale", "must be positive")
    if config.max_grad_norm is not None and config.max_grad_norm < 0:
        raise bad("max_grad_norm", "must be >= 0 (0 or null disables clipping)")
    if len(config.adam_betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in config.adam_betas):
        raise bad("adam_betas", "must be two numbers in [0, 1), e.g. [0.9, 0.999]")


# keys that only instruction tuning (and preference tuning, which renders conversations too) reads: set with
# another task they would change nothing, so they are refused
SFT_KEYS = ("chat_template", "train_on", "messages_column", "prompt_column", "completion_column")
DPO_DATA_KEYS = ("chat_template", "prompt_column", "chosen_column", "rejected_column")


def _check_sft_keys(config: Config, bad: BadKey) -> None:
    defaults = DataSection()
    keys = {"sft": SFT_KEYS, "dpo": DPO_DATA_KEYS, "reward": DPO_DATA_KEYS}.get(config.task, ())
    for key in dict.fromkeys(SFT_KEYS + DPO_DATA_KEYS):
        if key in keys or getattr(config.data, key) == getattr(defaults, key):
            continue
        if key in SFT_KEYS:
            why = "is task=sft's (conversations rendered by a chat template)"
            raise bad(key, f"{why}, and task={config.task} reads none; drop it or set task=sft")
        raise bad(key, f"is task=dpo's (preference pairs), and task={config.task} reads none; drop it or set task=dpo")


def _check_preference(config: Config, bad: BadKey) -> None:
    """The preference section: read by task=dpo only; its values in range."""
    defaults = PreferenceSection()
    if config.task == "reward":  # reads center_rewards_coefficient alone (loop/reward_loss.py)
        _check_reward(config, bad, defaults)
        return
    if config.preference.center_rewards_coefficient is not None:
        raise bad("center_rewards_coefficient", f"is task=reward's, and task={config.task} reads none; drop it")
    if config.task != "dpo":
        for key in vars(defaults):
            if getattr(config.preference, key) != getattr(defaults, key):
                raise bad(key, f"is task=dpo's (preference pairs), and task={config.task} reads none; drop it")
        return
    loss, section = config.dpo_loss, config.preference
    if not config.dpo_beta > 0:
        raise bad("dpo_beta", "must be > 0 (DPO's beta, e.g. 0.1)")
    if not 0 <= config.dpo_label_smoothing < 0.5:
        raise bad("dpo_label_smoothing", "must be in [0, 0.5) (the share of pairs assumed flipped)")
    if config.dpo_label_smoothing and loss in ("ipo", "hinge", "orpo"):
        raise bad("dpo_label_smoothing", f"is read by dpo_loss=sigmoid (cDPO), robust and simpo, not {loss}")
    if config.rpo_alpha < 0:
        raise bad("rpo_alpha", "must be >= 0 (0: no SFT term)")
    # keys of one pair loss set with another: refused, as another task's keys are
    if section.simpo_gamma != defaults.simpo_gamma and loss != "simpo":
        raise bad("simpo_gamma", f"is dpo_loss=simpo's target margin, and dpo_loss={loss} reads none; drop it")
    if loss in ("simpo", "orpo"):
        for key, why in (("rpo_alpha", "SFT term"), ("dpo_length_normalized", "averaging")):
            if getattr(section, key) != getattr(defaults, key):
                raise bad(key, f"is the DPO family's {why}, and dpo_loss={loss} reads none (it averages); drop it")


def _check_reward(config: Config, bad: BadKey, defaults: PreferenceSection) -> None:
    """task=reward: the dpo keys refused, reward centring >= 0, no packing (a pair's rows are padded)."""
    for key in vars(defaults):
        if key != "center_rewards_coefficient" and getattr(config.preference, key) != getattr(defaults, key):
            raise bad(key, "is task=dpo's pair loss, and task=reward reads none (its loss: docs/reward.md); drop it")
    if (config.preference.center_rewards_coefficient or 0) < 0:
        raise bad("center_rewards_coefficient", "must be >= 0 (e.g. 0.01; null: off)")
    if config.packing:
        raise bad("packing", "task=reward pads each pair's two rows (it packs none); drop packing")


def _check_generation(config: Config, bad: BadKey) -> None:
    if config.generate_every < 0:
        raise bad("generate_every", "must be >= 0 (0: no generations)")
    for key in ("generate_prompts", "generate_max_new_tokens"):
        if getattr(config, key) < 1:
            raise bad(key, "must be at least 1")
    if config.generate_every and config.task != "sft":
        raise bad(
            "generate_every",
            f"answers the validation conversations' prompts, which task=sft has and task={config.task} has not; "
            "set generate_every=0 or task=sft",
        )


def _check_peft(config: Config, bad: BadKey) -> None:
    if config.lora_base_quantization == "nf4":
        _check_qlora(config, bad)
    if config.peft.method != "lora":
        return
    if config.engine == "deepspeed":
        raise bad("peft", "is engine=torch's (tensor, pipeline and sharded data parallelism); use engine=torch")
    if config.lora_rank < 1:
        raise bad("lora_rank", "must be at least 1, e.g. 8")
    if config.lora_alpha <= 0:
        raise bad("lora_alpha", "must be positive, e.g. 2 x lora_rank")
    if not 0 <= config.lora_dropout < 1:
        raise bad("lora_dropout", "must be in [0, 1)")
    for key in ("lora_target_modules", "lora_modules_to_save"):
        value = getattr(config, key)
        if isinstance(value, list) and not all(isinstance(v, str) and v for v in value):
            raise bad(key, "must be a list of module names, e.g. [q_proj, v_proj]")
    if config.lora_target_modules == []:
        raise bad("lora_target_modules", "must name at least one module (or default, all-linear)")


def _check_qlora(config: Config, bad: BadKey) -> None:
    if config.peft.method != "lora":
        raise bad("lora_base_quantization", "quantizes the frozen base of peft=lora (QLoRA); set peft=lora")
    from .parallel.layout import Sharding  # here: only quantized runs pay for its torch import

    if Sharding(config.sharding).hybrid:
        raise bad(
            "sharding",
            "with lora_base_quantization=nf4 is not supported: the NF4 shards' scaler mean is taken over one "
            "1-D sharding group, and hybrid shards over a 2-D mesh; use sharding=full|optimizer|none",
        )
    if config.nf4_block_size < 2 or config.nf4_block_size % 2:
        raise bad("nf4_block_size", "must be even and at least 2 (two 4-bit codes per byte), e.g. 64")
    if config.nf4_scaler_block_size < 1:
        raise bad("nf4_scaler_block_size", "must be at least 1, e.g. 256")
