"""TorchUpdates: the `interfaces.Updates` (and `CheckpointableUpdates`) of engine=torch. Our AdamW over this rank's
parameters (`parallel/adamw.py`: every parameter or FSDP's shards; `parallel/zero.py`: ZeRO-1 flat slices), fp16
loss scaling agreed by every rank, clipping by the global norm, one step-wide reduction of the norm and the loss.
engine=deepspeed's counterpart is `parallel/deepspeed_engine.py`'s DeepSpeedUpdates.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ParallelSection, TrainingSection
from ..interfaces import SkipRule, StepOutcome
from ..model.precision import DynamicLossScaler
from ..parallel import Parallelized
from ..parallel.adamw import AdamWSettings, DataParallelAdamW, held_names
from ..parallel.gather import gather_full_state_dict
from ..parallel.gradients import reduce_norm_and_loss
from ..parallel.layout import Layout
from ..parallel.memory import measure_state_bytes
from ..parallel.pipeline import sync_tied_gradients
from ..parallel.zero import ZeroAdamW


class TorchUpdates:
    checkpointable = True

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        parallelized: Parallelized,
        *,
        training: TrainingSection,
        parallel: ParallelSection,
        precision: str,
        adamw: ZeroAdamW | None = None,
    ):
        """`training`: AdamW's settings, clipping and fp16's loss scaling; `parallel`: the gradient buckets of
        sharding=none; `precision`: the resolved one; `adamw`: ZeRO-1's, made with the model (load_model)."""
        self.model, self.layout, self.parallelized = model, layout, parallelized
        self.max_grad_norm = training.max_grad_norm
        self.adamw = adamw or DataParallelAdamW(
            model,
            layout,
            AdamWSettings.of(training),
            held_names(parallelized.tied, model),
            parallel.gradient_bucket_mib if parallel.overlap_gradients else None,
        )
        self.scaler = DynamicLossScaler(
            precision == "fp16", training.initial_loss_scale, training.loss_scale_growth_interval
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
        sync_tied_gradients(self.model, self.parallelized.tied, self.parallelized.tied_shapes, layout)
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
