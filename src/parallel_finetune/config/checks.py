"""Checks of the keys themselves, no model family, tracker or engine needed: ranges and combinations (check_keys),
and the limits resolve and preflight share (compile, timeouts). The keys a task kind owns (data columns, the
`preference:` and `grpo:` sections) are its own to check: tasks/kinds/, which resolve.validate asks after these."""

from __future__ import annotations

import math
import typing

from ..errors import UserError
from .sections import USER_KEYS
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
        "pad_to_multiple_of",
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


def _check_generation(config: Config, bad: BadKey) -> None:
    if config.generate_every < 0:
        raise bad("generate_every", "must be >= 0 (0: no generations)")
    for key in ("generate_prompts", "generate_max_new_tokens"):
        if getattr(config, key) < 1:
            raise bad(key, "must be at least 1")


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
