"""Mixed precision: autocast over fp32 master weights, and a loss scaler that every rank agrees on."""

from __future__ import annotations

import contextlib

import torch

from .errors import UserError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto = fp16 on CUDA (what the recipes target), bf16 on CPU (CPUs here have bf16 but no fp16 units)."""
    if precision == "auto":
        return "fp16" if device.type == "cuda" else "bf16"
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("precision=bf16: this GPU has no bf16 support; use precision=fp16")
    return precision


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


class DynamicLossScaler:
    """fp16 dynamic loss scaling whose decisions are made from globally reduced facts only.

    The caller passes `found_nonfinite` already agreed over all ranks, so every rank skips the same steps and
    holds the same scale. Halve on overflow; double after `growth_interval` clean steps (torch's defaults).
    """

    def __init__(self, enabled: bool, initial_scale: float, growth_interval: int,
                 backoff: float = 0.5, growth: float = 2.0):
        self.enabled = enabled
        self.scale = initial_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.backoff = backoff
        self.growth = growth
        self.clean_steps = 0

    def update(self, found_nonfinite: bool) -> bool:
        """Record a step's outcome; returns True when the optimizer step must be skipped."""
        if not self.enabled:
            return False
        if found_nonfinite:
            self.scale *= self.backoff
            self.clean_steps = 0
            return True
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth
            self.clean_steps = 0
        return False
