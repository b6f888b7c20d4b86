"""What turns a step's gradients into an update: one interface, two implementations, so the loop has no engine
branches.

    backward(loss, last)    one micro-batch's loss (already divided by the global count); last: the step's last
    step(local_loss, ...)   the step's one reduction (global norm and loss, the stop flag), then the update or a
                            skip: -> StepOutcome
    loss_scale, optimizer   the fp16 scale in use; the optimizer whose lr the schedule sets
    state_bytes()           this rank's bytes of parameters, gradients and optimizer state (after the first update)
    full_state_dict()       the whole model's weights for export (a collective)
    moment_tensors(), counters(), restore()   what a checkpoint holds (engine=torch only: `checkpointable`)

`TorchUpdates` (here): our AdamW over this rank's parameters (`parallel/sharding.py`: every parameter, FSDP shards,
or ZeRO-1 flat slices), fp16 loss scaling agreed by every rank, clipping by the global norm.
`DeepSpeedUpdates` (`parallel/deepspeed_engine.py`): DeepSpeed's ZeRO does the same inside its engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .export import gather_full_state_dict
from .layout import Layout
from .parallel import Parallelized
from .parallel.gradients import reduce_norm_and_loss
from .parallel.memory import measure_state_bytes
from .parallel.pipeline import sync_tied_gradients
from .parallel.sharding import AdamWSettings, DataParallelAdamW, ZeroAdamW
from .precision import DynamicLossScaler

# (step's global loss, global gradient norm, the fp16 scale it used or None) -> whether not to apply the step
SkipRule = Callable[[float, float, "float | None"], bool]


@dataclass
class StepOutcome:
    loss: float  # the global batch's mean loss
    grad_norm: float | None  # before clipping; None when the step was skipped
    skipped: bool
    stop: bool  # some rank was asked to stop (SIGTERM): every rank checkpoints after this step
    loss_scale: float  # the scale this step's backward used


def held_names(tied: list[tuple[str, ...]], model: nn.Module) -> dict[str, str]:
    """For each weight shared across pipeline stages: the name this stage holds it by -> its first name."""
    held = dict(model.named_parameters())
    return {name: names[0] for names in tied for name in names if name in held}


def zero_adamw(model: nn.Module, layout: Layout, config, parallel: Parallelized) -> ZeroAdamW:
    """ZeRO-1's optimizer, made before the weights exist: its flat buffers are where the parameters live."""
    return ZeroAdamW(model, layout, AdamWSettings.of(config), held_names(parallel.tied, model))


class TorchUpdates:
    checkpointable = True

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        config,
        precision: str,
        parallel: Parallelized,
        adamw: ZeroAdamW | None = None,
    ):
        self.model, self.layout, self.parallel = model, layout, parallel
        self.max_grad_norm = config.max_grad_norm
        self.adamw = adamw or DataParallelAdamW(
            model,
            layout,
            AdamWSettings.of(config),
            held_names(parallel.tied, model),
            config.gradient_bucket_mib if config.overlap_gradients else None,
        )
        self.scaler = DynamicLossScaler(
            precision == "fp16", config.initial_loss_scale, config.loss_scale_growth_interval
        )
        self.adam_step = 0  # updates applied (fp16 skips some), for AdamW's bias correction on resume
        self.measured: dict[str, int] | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.adamw.optimizer

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def module(self) -> nn.Module:
        return self.model

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        """`last`: the step's last backward on this rank, whose gradients may be summed over the data-parallel
        ranks while it runs (overlap_gradients)."""
        if last:
            self.adamw.arm()
        (loss * self.scaler.scale).backward()

    def step(self, local_loss: torch.Tensor, stop_requested: bool, skip_rule: SkipRule) -> StepOutcome:
        layout, scale = self.layout, self.scaler.scale
        self.adamw.sync_gradients()
        sync_tied_gradients(self.model, self.parallel.tied, self.parallel.tied_shapes, layout)
        pieces = self.adamw.gradient_pieces()
        # One collective: global norm (inf/NaN if any rank overflowed, so all skip together) and global loss.
        grad_norm, loss, stop = reduce_norm_and_loss(pieces, local_loss, layout.tp, layout.world_size, stop_requested)
        grad_norm /= scale
        skipped = self.scaler.update(not math.isfinite(grad_norm))
        skipped = skip_rule(loss, grad_norm, scale if self.scaler.enabled else None) or skipped
        if not skipped:
            clip = self.max_grad_norm
            coefficient = min(1.0, clip / (grad_norm + 1e-6)) if clip else 1.0
            # Unscaling and clipping happen inside the fused AdamW kernel (it divides each gradient by
            # `grad_scale` as it reads it): no extra pass over the gradients.
            self.adamw.step(scale / coefficient)
            self.adam_step += 1
            if self.measured is None:  # gradients and optimizer state all exist now: the peak of both
                self.measured = measure_state_bytes(self.model, self.adamw.optimizer)
        self.adamw.zero_grad()
        return StepOutcome(loss, None if skipped else grad_norm, skipped, stop, scale)

    def state_bytes(self) -> dict[str, int] | None:
        return self.measured

    def full_state_dict(self, dtype: torch.dtype, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        return gather_full_state_dict(self.model, dtype, self.layout, names)

    # --- checkpoints
    def moment_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return self.adamw.moments(self.model)

    def counters(self) -> dict:
        return {
            "adam_step": self.adam_step,
            "loss_scaler": {"scale": self.scaler.scale, "clean_steps": self.scaler.clean_steps},
        }

    def restore(self, moments: dict[str, dict[str, torch.Tensor]], counters: dict) -> None:
        self.adamw.load_moments(self.model, moments, counters["adam_step"])
        self.adam_step = counters["adam_step"]
        self.scaler.scale = counters["loss_scaler"]["scale"]
        self.scaler.clean_steps = counters["loss_scaler"]["clean_steps"]
