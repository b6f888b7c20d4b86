"""What a recipe means for this run, decided once: the pretrained model's name, the precision and its dtypes, the
parallel degrees and the pipeline's micro-batches. The trainer resolves a Config once, after the process group
exists, and hands these values to the components; `--check` resolves the same way for the layout it would start.
Only the number of steps waits for the data (RunBuilder._prepare_data, builder.py, computes it once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Config
from .families import get_family
from .families.base import Family
from .layout import ParallelDims
from .precision import DTYPES, resolve_precision


def pretrained_name(config: Config) -> str | None:
    """The Hub name or folder a full-size run loads (`model`, else the family's default); None at size=tiny, which
    builds its model from config."""
    if config.size == "tiny":
        return None
    return config.model or get_family(config.family).default_model


def pipeline_microbatches(config: Config, pp: int) -> int:
    """Micro-batches per accumulation slice: `microbatches`, else 2 per stage (the bubble under a fifth with 1F1B)."""
    return config.microbatches or 2 * pp


@dataclass(frozen=True)
class Resolved:
    family: Family
    model_name: str | None  # pretrained_name
    precision: str  # fp16 | bf16 | fp32: `auto` decided for the device and engine
    compute_dtype: torch.dtype  # what matmuls run in (float32 for fp32)
    autocast_dtype: torch.dtype | None  # None in fp32: no autocast, no 16-bit copies of frozen weights
    export_dtype: torch.dtype
    dims: ParallelDims
    microbatches: int  # a pipeline's, per accumulation slice (unused without one)

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
    precision = resolve_precision(config.precision, device, config.engine)
    return Resolved(
        family=get_family(config.family),
        model_name=pretrained_name(config),
        precision=precision,
        compute_dtype=DTYPES[precision],
        autocast_dtype=None if precision == "fp32" else DTYPES[precision],
        export_dtype=DTYPES[config.export_dtype],
        dims=dims,
        microbatches=pipeline_microbatches(config, dims.pp),
    )
