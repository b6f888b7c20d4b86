"""Checks of the keys themselves, no model family, tracker or engine needed: ranges and combinations (check_keys),
and the limits resolve and preflight share (compile, timeouts)."""

from __future__ import annotations

import math
import re
import typing

from ..errors import UserError
from .sections import USER_KEYS, DataSection, GRPOSection, PreferenceSection
from .whole import Config

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


def check_keys(config: Config, where: str = "config") -> None:
    """Checks of the keys themselves, no model family, tracker or engine needed: ranges and combinations."""

    def bad(key: str, why: str) -> UserError:
        return UserError(f"{where}: {key}={config.value(key)!r} {why}")

    _check_training(config, bad)
    _check_generation(config, bad)
    _check_sft_keys(config, bad)
    _check_preference(config, bad)
    _check_peft(config, bad)
    _check_grpo(config, bad)
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
SFT_KEYS = ("chat_template", "train_on", "messages_column", "prompt_column", "completion_column", "tools_column")
DPO_DATA_KEYS = ("chat_template", "prompt_column", "chosen_column", "rejected_column")
KTO_DATA_KEYS = (*DPO_DATA_KEYS, "completion_column")  # unpaired rows, or dpo's pairs unpaired
KTO_KEYS = ("desirable_weight", "undesirable_weight")  # the preference section's keys only task=kto reads
GRPO_DATA_KEYS = ("chat_template", "prompt_column")


def _check_sft_keys(config: Config, bad: BadKey) -> None:
    defaults = DataSection()
    keys = {"sft": SFT_KEYS, "dpo": DPO_DATA_KEYS, "reward": DPO_DATA_KEYS, "kto": KTO_DATA_KEYS}
    keys = (keys | {"grpo": GRPO_DATA_KEYS}).get(config.task, ())
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
    if config.task == "kto":  # reads dpo_beta and the weights (loop/kto.py)
        _check_kto(config, bad, defaults)
        return
    for key in KTO_KEYS:
        if getattr(config.preference, key) != getattr(defaults, key):
            raise bad(key, f"is task=kto's, and task={config.task} reads none; drop it or set task=kto")
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


def _check_kto(config: Config, bad: BadKey, defaults: PreferenceSection) -> None:
    """task=kto: beta > 0, weights > 0, the pair losses' keys refused, a global batch of 2 rows or more (its KL rows
    pair each prompt with another row's completion), no packing (its rows are padded)."""
    for key in vars(defaults):
        if key not in ("dpo_beta", *KTO_KEYS) and getattr(config.preference, key) != getattr(defaults, key):
            raise bad(key, "is task=dpo's pair loss, and task=kto reads none (its loss: docs/kto.md); drop it")
    if not config.dpo_beta > 0:
        raise bad("dpo_beta", "must be > 0 (KTO's beta, e.g. 0.1)")
    for key in KTO_KEYS:
        if not getattr(config.preference, key) > 0:
            raise bad(key, "must be > 0 (1.0: TRL's default)")
    if config.batch_size < 2:
        raise bad(
            "batch_size", "must be >= 2 under task=kto: its KL estimate pairs each prompt with another row's answer"
        )
    if config.packing:
        raise bad("packing", "task=kto pads its rows (it packs none); drop packing")


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
    from ..parallel.layout import Sharding  # here: only quantized runs pay for its torch import

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


# rl/rewards.py's BUILTINS (tests/rl/test_grpo.py keeps the two equal): config/ is a floor below rl/
GRPO_BUILTIN_REWARDS = ("accuracy", "format", "length")
# Why task=grpo refuses pipeline stages: a rollout decodes one token at a time, and through stages each token would
# cross every stage boundary twice with the other stages idle; TP and FSDP sample in every rank's own forward.
GRPO_NO_PIPELINE = (
    "task=grpo samples its completions token by token, which a pipeline would pass through every stage for each "
    "token; use tensor_parallel_degree (TP) or sharding=full (FSDP) instead, with pipeline_parallel_degree=1"
)


def _check_grpo(config: Config, bad: BadKey) -> None:
    """The `grpo:` section: read by task=grpo only; its values in range and its combinations with the run."""
    defaults, section = GRPOSection(), config.grpo
    if config.task != "grpo":
        for key in vars(defaults):
            if getattr(section, key) != getattr(defaults, key):
                raise bad(key, f"is task=grpo's (online RL, docs/grpo.md), and task={config.task} reads none; drop it")
        return
    if config.pipeline_parallel_degree > 1:
        raise bad("pipeline_parallel_degree", GRPO_NO_PIPELINE)
    if config.engine == "deepspeed":
        raise bad("engine", "task=grpo runs on engine=torch (its rollouts and loss use the chunked head); use torch")
    if config.packing:
        raise bad("packing", "task=grpo pads its completions (it packs none); drop packing")
    if section.num_generations < 2:
        raise bad("num_generations", "must be at least 2 (advantages compare a prompt's completions), e.g. 8")
    if config.batch_size % section.num_generations:
        raise bad(
            "batch_size",
            f"counts completions, and num_generations={section.num_generations} does not divide it (each prompt's "
            "group of completions is in one step); make batch_size a multiple of num_generations",
        )
    for key in ("max_completion_length", "num_iterations"):
        if getattr(section, key) < 1:
            raise bad(key, "must be at least 1")
    if section.temperature < 0 or not 0 < section.top_p <= 1 or section.top_k < 0:
        key = "temperature" if section.temperature < 0 else "top_p" if not 0 < section.top_p <= 1 else "top_k"
        raise bad(key, "is out of range: temperature >= 0 (0: greedy), 0 < top_p <= 1, top_k >= 0 (0: all)")
    if not section.epsilon > 0 or (section.epsilon_high is not None and section.epsilon_high < section.epsilon):
        key = "epsilon" if not section.epsilon > 0 else "epsilon_high"
        raise bad(key, "must be epsilon > 0 and epsilon_high >= epsilon (or null: epsilon), e.g. 0.2 and 0.28")
    if section.beta < 0:
        raise bad("beta", "must be >= 0 (0: no KL term, TRL's default)")
    if section.beta > 0 and config.peft.method != "lora":
        raise bad(
            "beta",
            "> 0 needs a reference model: with peft=lora it is the base with its adapters disabled (no second "
            "copy); full fine-tuning keeps no frozen copy yet, so use peft=lora or beta=0",
        )
    _check_rewards(config, bad, section)


def _check_rewards(config: Config, bad: BadKey, section: GRPOSection) -> None:
    functions = section.reward_functions
    if not functions or not all(isinstance(f, str) and f for f in functions):
        raise bad(
            "reward_functions",
            f"must list reward functions: {', '.join(GRPO_BUILTIN_REWARDS)}, path.py:name or model:path/to/folder",
        )
    for name in functions:
        if ":" not in name and name not in GRPO_BUILTIN_REWARDS:
            raise bad(
                "reward_functions",
                f"names {name!r}, no built-in reward ({', '.join(GRPO_BUILTIN_REWARDS)}); your own function is "
                "path/to/file.py:function, a reward model model:path/to/folder",
            )
        if name == "model:":
            raise bad("reward_functions", "names a reward model with no folder; write model:path/to/folder")
    weights = section.reward_weights
    if weights is not None and (
        len(weights) != len(functions) or not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights)
    ):
        raise bad("reward_weights", f"must be {len(functions)} finite number(s), one per reward function (or null)")
    if "format" in functions:
        if not section.format_pattern:
            raise bad("format_pattern", "is what reward format matches each completion against; give a regex")
        try:
            re.compile(section.format_pattern)
        except re.error as exc:
            raise bad("format_pattern", f"is no regular expression ({exc})") from None
    if "length" in functions and (section.length_limit is None or section.length_limit < 1):
        raise bad("length_limit", "is where reward length's penalty starts: give a number of tokens >= 1")
    if section.length_ramp is not None and section.length_ramp < 1:
        raise bad("length_ramp", "must be at least 1 (or null: length_limit)")
