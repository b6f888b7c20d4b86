"""Mixed precision: autocast over fp32 master weights, and a loss scaler that every rank agrees on."""

from __future__ import annotations

import contextlib
import logging

import torch

from ..errors import UserError
from ..parallel.layout import Engine

log = logging.getLogger(__name__)

# The one dtype table: by the `precision` key's names and by torch's (export_dtype, checkpoint files).
DTYPES = {
    name: dtype
    for names, dtype in (
        (("fp32", "float32"), torch.float32),
        (("bf16", "bfloat16"), torch.bfloat16),
        (("fp16", "float16"), torch.float16),
    )
    for name in names
}
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


def cpu_has_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX). Without it bf16 is emulated: measured 60x slower than fp32
    on an AVX2-only CPU, where a CPU with bf16 units runs it ~4x faster than fp32."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


FP16_ON_CPU = (
    "engine=deepspeed: DeepSpeed refuses fp16 on this CPU (no fp16 arithmetic units); "
    "use precision=bf16 or precision=fp32, or run on a GPU"
)


# bf16 tensor cores arrived with Ampere (A100, A10G, compute capability 8.0); below it bf16 is emulated or absent
BF16_GPU_CAPABILITY = (8, 0)


def gpu_has_bf16(device: torch.device) -> bool:
    """Native bf16 matmuls: compute capability 8.0 or above (A100, A10G, L4, H100), not a V100 or T4."""
    return tuple(torch.cuda.get_device_capability(device)) >= BF16_GPU_CAPABILITY


def resolve_precision(precision: str, device: torch.device, engine: Engine | str = Engine.TORCH) -> str:
    """auto = on CUDA bf16 where the GPU has bf16 tensor cores (no loss scale to tune, fp32's range), else fp16
    with loss scaling; on a CPU bf16 where it has bf16 units, else fp32 (no CPU here has fp16 units). fp16 on
    such a CPU: emulated with engine=torch, refused by DeepSpeed."""
    if precision == "auto":
        if device.type == "cuda":
            return "bf16" if gpu_has_bf16(device) else "fp16"
        return "bf16" if cpu_has_bf16() else "fp32"
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError("precision=bf16: this GPU has no bf16 support; use precision=fp16")
    native = {"fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported, "bf16": cpu_has_bf16}
    if Engine(engine) is Engine.DEEPSPEED and precision == "fp16" and device.type == "cpu" and not native["fp16"]():
        raise UserError(FP16_ON_CPU)  # the very test DeepSpeed's CPU accelerator makes, before its traceback
    if device.type == "cpu" and precision in native and not native[precision]():
        log.warning(
            "precision=%s on a CPU without %s units: emulated, tens of times slower than fp32 "
            "(precision=auto picks the fastest)",
            precision,
            precision,
        )
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

    def __init__(
        self, enabled: bool, initial_scale: float, growth_interval: int, backoff: float = 0.5, growth: float = 2.0
    ):
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
