"""The recipe's sections: one typed dataclass per section (`model:`, `data:`, ...), the one place each key's type,
default and meaning are written (the comments become docs/configuration.md through scripts/config_reference.py;
`Continues[...]` marks what may change when a run continues), and the tables read off them (SECTIONS, USER_KEYS,
FIELDS, CONTINUATION_MAY_CHANGE)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeVar

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
    # head trained to score the chosen answer above the rejected one (TRL's RewardTrainer, docs/reward.md); kto = KTO
    # on unpaired rows (prompt, completion, a boolean label; or dpo's pairs, unpaired) as TRL's KTOTrainer (docs/kto.md)
    # grpo = online RL with verifiable rewards: prompts (text, or messages rendered with the generation prompt), the
    # language-model head trained on its own sampled completions (the `grpo:` section, docs/grpo.md)
    task: Literal["classification", "causal_lm", "sft", "dpo", "reward", "kto", "grpo"] = "classification"
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
    # task=sft: each row's tool schemas (TRL's: a list of function schemas, or JSON text of it) handed to the chat
    # template; None = tools, if the data has it
    tools_column: str | None = None
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
    # each batch's sequence length (padded or packed) rounded up to a multiple of it (1: its longest row). 8 suits
    # tensor cores and gives tensor parallelism fewer distinct shapes, each of which costs every rank DTensor's
    # sharding propagation once; pipeline parallelism pads to a multiple of 8 anyway (its buffers have fixed shapes)
    pad_to_multiple_of: int = 1


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
    # task=kto (TRL's KTOTrainer names; its beta is dpo_beta): the weight of a desirable row's loss and of an
    # undesirable row's (KTO's lambda_D and lambda_U), e.g. raised for the side with fewer rows
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0  # task=kto: the weight of an undesirable row's loss (TRL's name)


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


@dataclass
class GRPOSection:
    """`grpo:` task=grpo's rollouts, rewards and loss, with TRL's GRPOConfig names and meanings (docs/grpo.md):
    each step samples num_generations completions of each prompt, scores them, and trains on their group-relative
    advantages with the clipped importance ratio."""

    num_generations: int = 8  # completions sampled per prompt (a group); batch_size counts completions
    max_completion_length: int = 256  # the most tokens of one completion (its stop token included)
    temperature: float = 1.0  # sampling temperature (0: greedy)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this probability
    top_k: int = 0  # only the k likeliest tokens (0: all)
    # built-ins (accuracy, format, length), your own `path/to/file.py:function` (TRL's signature), or a reward model
    # `model:path/to/folder` (a one-output sequence classifier, e.g. a task=reward run's hf/: its score of each
    # prompt and completion; metric rewards/<folder name>/mean)
    reward_functions: list = field(default_factory=lambda: ["accuracy"])
    reward_weights: list | None = None  # one weight per reward function; None = 1.0 each
    format_pattern: str | None = None  # reward format: the regular expression a whole completion must match
    length_limit: int | None = None  # reward length: completion tokens before the penalty starts
    length_ramp: int | None = None  # reward length: tokens over which it falls to -1; None = length_limit
    answer_column: str = "answer"  # reward accuracy: the column holding each prompt's answer
    # how advantages are scaled: by the group's reward standard deviation, the whole global batch's, or not at all
    scale_rewards: Literal["group", "batch", "none"] = "group"
    # how the per-token losses are averaged: grpo = over each completion's tokens, then over completions; bnpo and
    # dapo = over the global batch's completion tokens; dr_grpo = over completions x max_completion_length
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    epsilon: float = 0.2  # the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None = epsilon (DAPO's clip-higher: e.g. 0.28)
    # the importance ratio per token, or per completion (GSPO: the geometric mean of its tokens' ratios)
    importance_sampling_level: Literal["token", "sequence"] = "token"
    num_iterations: int = 1  # updates on each rollout (> 1: the old policy's log-probabilities kept from it)
    beta: float = 0.0  # the KL term's weight against the reference (LoRA: the base with its adapters disabled)
    # the KL term times the importance ratio (TRL's default; its gradient is then the unbiased reverse-KL one, even
    # on-policy where the ratio's value is 1); false: the k3 estimate alone
    use_bias_correction_kl: bool = True
    mask_truncated_completions: bool = False  # completions that reached max_completion_length train on nothing


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
    "grpo": GRPOSection,
    "checkpoint": CheckpointSection,
    "output": OutputSection,
    "logging": LoggingSection,
}


SECTIONS: dict[str, tuple[str, ...]] = {
    name: tuple(f.name for f in dataclasses.fields(section)) for name, section in SECTION_CLASSES.items()
}
SECTION_OF = {key: name for name, keys in SECTIONS.items() for key in keys}
USER_KEYS = tuple(k for keys in SECTIONS.values() for k in keys)
FIELDS = {f.name: f for section in SECTION_CLASSES.values() for f in dataclasses.fields(section)}  # flat
TYPE_HINTS = {key: hint for section in SECTION_CLASSES.values() for key, hint in typing.get_type_hints(section).items()}
# Continues[...] marks what may differ when a run continues from a checkpoint (see its definition).
CONTINUATION_MAY_CHANGE = tuple(
    key
    for section in SECTION_CLASSES.values()
    for key, hint in typing.get_type_hints(section, include_extras=True).items()
    if CONTINUES in getattr(hint, "__metadata__", ())
)
