"""The whole model's weights from its shards: the collective behind an export (export.py) and the updates'
`full_state_dict` (updates.py), for every layout: tensor-parallel and FSDP shards (DTensors) gathered one tensor
at a time, pipeline stages handed to rank 0, QLoRA's NF4 base dequantized."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..model import quantize


def gather_full_state_dict(
    model: nn.Module, dtype: torch.dtype, layout, names: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's weights (or those in `names`) on rank 0 (an empty dict elsewhere), by the unsplit
    model's names, in `dtype`.
    A collective: every rank gathers its stage's shards (one tensor at a time, to bound memory); with pipeline
    stages, each stage's first rank then hands its part to rank 0."""
    keep = layout.dp_rank == 0 and layout.tp_rank == 0  # one rank per pipeline stage keeps its stage's tensors
    state: dict[str, torch.Tensor] = {}
    # QLoRA's NF4 weights (buffers outside the state dict) dequantized, their shards gathered, after the rest
    for name, tensor in itertools.chain(model.state_dict().items(), _dequantized(model, names)):
        if (names is not None and name not in names) or quantize.local_nf4(tensor) is not None:
            continue  # FSDP holds NF4 weights as parameters: they come dequantized from _dequantized
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            full = full.detach().to("cpu")
            state[name] = full.to(dtype) if full.is_floating_point() else full
    if layout.pp == 1:
        return state if layout.is_main else {}
    parts: list | None = [None] * layout.pp if layout.pp_rank == 0 else None
    dist.gather_object(state if keep else {}, parts, group=layout.pp_group, group_dst=0)
    return {name: tensor for part in parts or [] for name, tensor in part.items()} if layout.is_main else {}


def _dequantized(model: nn.Module, names: set[str] | None):
    """QLoRA's base weights, whole and dequantized, unless only `names` (the trained ones) are gathered."""
    return quantize.dequantized_weights(model) if names is None else iter(())
