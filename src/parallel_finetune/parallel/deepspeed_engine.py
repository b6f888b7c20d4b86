"""engine=deepspeed: the same recipes, with DeepSpeed's ZeRO (stage 1, 2 or 3) in place of our data-parallel optimizer.

What stays ours: data, model, the loss (a sum divided by the global count), the lr schedule, logging, evaluation
and export. What DeepSpeed does: the backward with fp16 loss scaling, gradient reduction and partitioning,
clipping, and the AdamW update on its fp32 master partitions.

Gradients: DeepSpeed *averages* them over the data-parallel ranks; our loss is already divided by the global
count, so each rank's loss is multiplied by the data-parallel degree before the backward, and the average of
those is exactly the single-process gradient (the sum). Accumulation scaling is switched off for the same reason.

The DeepSpeed config is generated from the recipe (`deepspeed_config`, a pure function) and written to the run
folder. A user JSON (`deepspeed_config=path.json`) is the base: recipe values fill what it lacks (or sets to
"auto"), a key it sets to the recipe's value is fine, a key it sets to another value is an error naming both.
Nothing from either side is dropped silently.

`deepspeed` is imported only here, only for engine=deepspeed runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ParallelSection, TrainingSection
from ..errors import UserError
from ..interfaces import SkipRule, StepOutcome
from ..model.precision import FP16_ON_CPU
from .layout import Engine, Sharding

log = logging.getLogger(__name__)

DEFAULT_ZERO_STAGE = 2  # zero_stage=null and no stage in the user's JSON: optimizer state and gradients sharded
MICS_REMOVED_IN = (0, 19, 7)  # DeepSpeed 0.19.7 removed MiCS: its config rejects zero_optimization.mics_shard_size


# ----------------------------------------------------------------------------------------------- checks
def validate(*, parallel: ParallelSection, training: TrainingSection, where: str = "config") -> None:
    """Key combinations of the `parallel:` section (and training's initial_loss_scale), no processes needed
    (resolve.validate calls this)."""
    deepspeed_only = ("zero_stage", "mics_shard_size", "deepspeed_config")
    if Engine(parallel.engine) is not Engine.DEEPSPEED:
        for key in deepspeed_only:
            if getattr(parallel, key) is not None:
                raise UserError(
                    f"{where}: {key}={getattr(parallel, key)!r} only applies to engine=deepspeed, "
                    f"not engine={parallel.engine}"
                )
        return
    tp = parallel.tensor_parallel_degree
    if tp != "auto" and tp > 1:
        raise UserError(
            f"{where}: engine=deepspeed with tensor_parallel_degree={tp} is not supported (DeepSpeed "
            f"runs data parallel only here); use tensor_parallel_degree=1, or engine=torch for tensor "
            f"parallelism"
        )
    if Sharding(parallel.sharding).sharded:
        raise UserError(
            f"{where}: engine=deepspeed with sharding={parallel.sharding} is not supported; DeepSpeed "
            f"shards by zero_stage=1|2|3 (sharding=optimizer ~ zero_stage=1, sharding=full ~ "
            f"zero_stage=3); use sharding=none"
        )
    if parallel.mics_shard_size is not None and parallel.mics_shard_size < 1:
        raise UserError(f"{where}: mics_shard_size={parallel.mics_shard_size} must be a positive integer (or null)")
    user = load_user_config(parallel.deepspeed_config) if parallel.deepspeed_config else {}
    stage = zero_stage(user, parallel=parallel)
    if parallel.mics_shard_size is not None and stage != 3:
        raise UserError(
            f"{where}: mics_shard_size={parallel.mics_shard_size} requires zero_stage=3, not zero_stage={stage}"
        )
    power = math.log2(training.initial_loss_scale)
    if not power.is_integer():
        raise UserError(
            f"{where}: engine=deepspeed: initial_loss_scale={training.initial_loss_scale:g} must be a "
            f"power of two (DeepSpeed takes initial_scale_power), e.g. {2 ** round(power):g}"
        )


def zero_stage(user: dict, *, parallel: ParallelSection) -> int:
    """The recipe's zero_stage, else the user JSON's, else DEFAULT_ZERO_STAGE."""
    if parallel.zero_stage is not None:
        return parallel.zero_stage
    stage = user.get("zero_optimization", {}).get("stage", "auto")
    return DEFAULT_ZERO_STAGE if stage == "auto" else stage


def load_user_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"deepspeed_config={path!r}: no such file (a DeepSpeed JSON config)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"deepspeed_config={path!r}: not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"deepspeed_config={path!r}: must be a JSON object of DeepSpeed settings")
    return data


def deepspeed_version() -> tuple[int, ...] | None:
    try:
        text = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def preflight(
    *, training: TrainingSection, parallel: ParallelSection, dp: int, device_type: str, precision: str
) -> dict:
    """What needs the process count and the device: the generated config, or a one-line error before DeepSpeed
    starts (and prints its own traceback on every rank). `precision` is the resolved one (auto -> fp16/bf16/fp32)."""
    if precision == "fp16" and device_type == "cpu" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        raise UserError(FP16_ON_CPU)  # the very test DeepSpeed's CPU accelerator makes, asked before it does
    version = deepspeed_version()
    if version is None:
        raise UserError(
            "engine=deepspeed: the deepspeed package is not installed (the core setup leaves it out); make setup-all, "
            "or pip install -r requirements-all.txt"
        )
    generated = deepspeed_config(training=training, parallel=parallel, dp=dp, precision=precision)
    mics = generated["zero_optimization"].get("mics_shard_size")
    if mics is not None:
        if version >= MICS_REMOVED_IN:
            raise UserError(
                f"mics_shard_size={mics}: DeepSpeed {'.'.join(map(str, version))} has no MiCS (removed "
                f"in 0.19.7; it rejects zero_optimization.mics_shard_size); for the same scheme use "
                f"engine=torch sharding=hybrid shard_group_size={mics}"
            )
        if dp % mics:
            raise UserError(
                f"mics_shard_size={mics} does not divide the {dp} data-parallel processes; valid: "
                f"{', '.join(str(d) for d in range(1, dp + 1) if dp % d == 0)}"
            )
    return generated


# ----------------------------------------------------------------------------------------------- config
def _precision_origin(precision: str, *, training: TrainingSection) -> str:
    return f"precision={training.precision}" + (f" ({precision} here)" if training.precision == "auto" else "")


def _recipe_values(
    *, training: TrainingSection, parallel: ParallelSection, dp: int, precision: str
) -> list[tuple[str, Any, str]]:
    """(dotted DeepSpeed key, value, the recipe setting it comes from): what a user JSON may not contradict."""
    gas = training.gradient_accumulation_steps
    values = [
        ("train_batch_size", training.batch_size, f"batch_size={training.batch_size}"),
        (
            "train_micro_batch_size_per_gpu",
            training.batch_size // (dp * gas),
            f"batch_size={training.batch_size} over {dp} processes x gradient_accumulation_steps={gas}",
        ),
        ("gradient_accumulation_steps", gas, f"gradient_accumulation_steps={gas}"),
        ("gradient_clipping", float(training.max_grad_norm or 0.0), f"max_grad_norm={training.max_grad_norm}"),
        ("fp16.enabled", precision == "fp16", _precision_origin(precision, training=training)),
        ("bf16.enabled", precision == "bf16", _precision_origin(precision, training=training)),
        ("optimizer.type", "AdamW", "the trainer's optimizer (AdamW, no decay on biases and norm weights)"),
        ("optimizer.params.lr", training.lr, f"lr={training.lr}"),
        ("optimizer.params.betas", [float(b) for b in training.adam_betas], f"adam_betas={training.adam_betas}"),
        ("optimizer.params.eps", training.adam_eps, f"adam_eps={training.adam_eps}"),
        ("optimizer.params.weight_decay", training.weight_decay, f"weight_decay={training.weight_decay}"),
    ]
    if precision == "fp16":
        values += [
            (
                "fp16.initial_scale_power",
                int(math.log2(training.initial_loss_scale)),
                f"initial_loss_scale={training.initial_loss_scale:g}",
            ),
            (
                "fp16.loss_scale_window",
                training.loss_scale_growth_interval,
                f"loss_scale_growth_interval={training.loss_scale_growth_interval}",
            ),
        ]
    if parallel.zero_stage is not None:
        values.append(("zero_optimization.stage", parallel.zero_stage, f"zero_stage={parallel.zero_stage}"))
    if parallel.mics_shard_size is not None:
        values.append(
            (
                "zero_optimization.mics_shard_size",
                parallel.mics_shard_size,
                f"mics_shard_size={parallel.mics_shard_size}",
            )
        )
    return values


def _engine_defaults(precision: str) -> list[tuple[str, Any]]:
    """Settings no recipe key covers: a user JSON may change them."""
    defaults = [
        ("zero_optimization.stage", DEFAULT_ZERO_STAGE),
        # torch.optim.AdamW: DeepSpeed's FusedAdam would be JIT-compiled at start (a C++/CUDA toolchain and minutes).
        ("optimizer.params.torch_adam", True),
        ("steps_per_print", 10**9),  # the trainer logs
        ("wall_clock_breakdown", False),
    ]
    if precision == "fp16":
        # Dynamic scaling as our own scaler does it: halve on every overflow (hysteresis 1), double after
        # loss_scale_window clean steps.
        defaults += [("fp16.loss_scale", 0), ("fp16.hysteresis", 1), ("fp16.min_loss_scale", 1)]
    return defaults


def _get(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or (isinstance(a, bool) and isinstance(b, bool) and a == b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def deepspeed_config(*, training: TrainingSection, parallel: ParallelSection, dp: int, precision: str) -> dict:
    """The DeepSpeed config for the recipe's `training` and `parallel` sections on `dp` data-parallel processes at
    the resolved `precision` (fp16, bf16 or fp32), on top of the user's JSON when `parallel.deepspeed_config` names
    one. Pure: no processes, no deepspeed.

    Raises UserError when the JSON contradicts a recipe value, or sets what the trainer owns (`scheduler`)."""
    user = load_user_config(parallel.deepspeed_config) if parallel.deepspeed_config else {}
    where = f"deepspeed_config={parallel.deepspeed_config!r}"
    if "scheduler" in user:
        raise UserError(
            f"{where}: has a 'scheduler' section, but the recipe's lr_scheduler={training.lr_scheduler!r} "
            f"(warmup_steps, warmup_ratio) drives the learning rate; remove 'scheduler' from the JSON"
        )
    result = json.loads(json.dumps(user))  # a deep copy
    for dotted, value, origin in _recipe_values(training=training, parallel=parallel, dp=dp, precision=precision):
        theirs = _get(user, dotted)
        if theirs is None or theirs == "auto":
            _set(result, dotted, value)
        elif not _same(theirs, value):
            raise UserError(
                f"{where}: {dotted}={json.dumps(theirs)} conflicts with {origin} (which means "
                f"{dotted}={json.dumps(value)}); make them agree, or drop the key from the JSON"
            )
    for dotted, value in _engine_defaults(precision):
        if _get(result, dotted) in (None, "auto"):
            _set(result, dotted, value)
    return result


# ----------------------------------------------------------------------------------------------- the engine
def import_deepspeed(device_type: str):
    """Import deepspeed for this device, without the start-up cost a CPU run needs none of."""
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # skips probing for every other accelerator
    import deepspeed
    import deepspeed.ops

    # On the CPU accelerator, DeepSpeed JIT-compiles a shared-memory all-reduce op when its communication backend
    # starts (~2.5 min on 2 cores; it serves inference all-reduces, not ZeRO training). Marking it incompatible
    # skips the build; filling the dict directly also skips probing every other op with a compiler.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed


def zero3_init(ds_config: dict, device_type: str) -> contextlib.ExitStack:
    """ZeRO-3: every module built inside is partitioned over the data-parallel ranks as it is constructed
    (DeepSpeed's zero.Init, entered as transformers' from_pretrained does it), so no rank holds the whole model;
    weights are not initialised there, the loader fills each rank's partition (`zero3_box`, `zero3_write`)."""
    deepspeed = import_deepspeed(device_type)
    from transformers import initialization
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    deepspeed.init_distributed()  # adopts the process group: zero.Init reads the world size from it
    stack = contextlib.ExitStack()
    stack.enter_context(initialization.no_init_weights())
    stack.enter_context(prevent_arange_dtype_change())  # rotary tables keep their own dtype
    stack.enter_context(deepspeed.zero.Init(config_dict_or_path=ds_config))
    return stack


def _partition(param) -> tuple[int, int]:
    """[start, end) of the flattened parameter that this rank's ZeRO-3 partition holds."""
    import deepspeed.comm as ds_dist

    size = param.ds_tensor.ds_numel
    start = min(size * ds_dist.get_rank(group=param.ds_process_group), param.ds_numel)
    return start, min(start + size, param.ds_numel)


def _row_width(param) -> int:
    shape = tuple(param.ds_shape)
    return param.ds_numel // shape[0] if len(shape) > 1 else 1


def zero3_box(param) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rows of the parameter that cover this rank's flat partition: what the loader reads for it."""
    shape = tuple(param.ds_shape)
    start, end = _partition(param)
    width = _row_width(param)
    first, last = start // width, -(-end // width)
    return (first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]


def zero3_write(param, block: torch.Tensor) -> None:
    """Store this rank's part of `block` (the rows `zero3_box` asked for) in the ZeRO-3 partition."""
    start, end = _partition(param)
    first = zero3_box(param)[0][0] if param.ds_shape else 0
    flat = block.reshape(-1)
    offset = start - first * _row_width(param)
    param.ds_tensor[: end - start].copy_(flat[offset : offset + end - start])


def _one_line(exc: BaseException) -> str:
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


class DeepSpeedUpdates:
    """`interfaces.Updates` over a DeepSpeed engine: ZeRO reduces, unscales, clips and updates (or skips).
    Forwards go through `engine` (ZeRO-3 gathers parameters there)."""

    checkpointable = False  # no CheckpointableUpdates: config.check_keys refuses checkpoint keys with engine=deepspeed

    def __init__(
        self, model: nn.Module, layout, *, training: TrainingSection, parallel: ParallelSection, precision: str
    ):
        self.deepspeed_config = preflight(
            training=training, parallel=parallel, dp=layout.dp, device_type=layout.device.type, precision=precision
        )
        self.layout = layout
        self.dp = layout.dp
        self.precision = precision
        self.zero_stage = self.deepspeed_config["zero_optimization"]["stage"]
        deepspeed = import_deepspeed(layout.device.type)
        from deepspeed.runtime.config import DeepSpeedConfigError
        from pydantic import ValidationError

        from .adamw import optimizer_groups

        try:
            self.engine, _, _, _ = deepspeed.initialize(
                model=model,
                model_parameters=optimizer_groups(model, training.weight_decay),
                config=self.deepspeed_config,
            )
        except (DeepSpeedConfigError, ValidationError) as exc:
            raise UserError(f"engine=deepspeed: DeepSpeed rejected the config: {_one_line(exc)}") from None
        self.module = self.engine.module
        self.measured: dict[str, int] | None = None
        log.info(
            "deepspeed %s: ZeRO stage %d, %s, %d data-parallel processes (deepspeed_config.json in the run folder)",
            metadata.version("deepspeed"),
            self.zero_stage,
            precision,
            self.dp,
        )
        # The torch AdamW DeepSpeed steps on this rank's fp32 partitions: the lr schedule sets its lr.
        self.optimizer = self.engine.basic_optimizer

    @property
    def loss_scale(self) -> float:
        if self.precision != "fp16":
            return 1.0
        return float(self.engine.optimizer.loss_scale)

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """One micro-batch. DeepSpeed averages gradients over ranks: scaling by dp makes that average our sum."""
        self.engine.backward(loss * self.dp, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # counts the micro-step only; the update waits for the boundary

    def step(self, local_loss: torch.Tensor, stop_requested: bool, skip_rule: SkipRule) -> StepOutcome:
        """The update at the accumulation boundary, then the step's one reduction of the loss and stop flag.
        DeepSpeed has applied (or skipped) the update already: `skip_rule` can only stop a diverged run here."""
        from .gradients import reduce_norm_and_loss

        scale = self.loss_scale
        self.engine.step()
        skipped = not self.engine.was_step_applied()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else math.nan
        _, loss, stop = reduce_norm_and_loss([], local_loss, self.layout.tp, self.layout.world_size, stop_requested)
        skip_rule(loss, norm, scale if skipped else None)
        if self.measured is None:
            self.measured = self._state_bytes()
        return StepOutcome(loss, None if skipped or not math.isfinite(norm) else norm, skipped, stop, scale)

    def state_bytes(self) -> dict[str, int] | None:
        return self.measured

    def _state_bytes(self) -> dict[str, int]:
        """This rank's bytes of model parameters (the ZeRO-3 partition), fp32 master partition and AdamW state
        (DeepSpeed's gradient buffers are internal to it: not counted)."""
        params = sum(
            (p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() * p.element_size() for p in self.module.parameters()
        )
        zero = self.engine.optimizer  # ZeRO-3 keeps the fp32 partitions apart from the optimizer's param groups
        master = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        state = [
            value
            for per_param in self.optimizer.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor) and value.numel() > 1
        ]
        return {
            "params": params,
            "master_params": sum(p.numel() * p.element_size() for p in master),
            "optimizer": sum(t.numel() * t.element_size() for t in state),
        }

    def full_state_dict(self, dtype: torch.dtype, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """The trained weights (only `names`, if given) from the fp32 master copies (not the bf16/fp16 working
        copies), assembled from every rank's partition (a collective: all ranks call it); rank 0 gets CPU
        tensors, the others nothing."""
        keep = self.layout.is_main
        from deepspeed.utils import safe_get_full_fp32_param

        full: dict[int, torch.Tensor] = {}
        state: dict[str, torch.Tensor] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if names is not None and name not in names:  # the same names on every rank: the gathers still pair up
                continue
            if isinstance(tensor, nn.Parameter):
                if id(tensor) not in full:  # tied weights: gathered once
                    master = safe_get_full_fp32_param(tensor)
                    full[id(tensor)] = master if master is not None else tensor.detach()
                tensor = full[id(tensor)]
            if keep:
                tensor = tensor.detach().to("cpu")
                state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        return state
