"""Tensor parallelism with DTensor: the family's plan applied to its model on the `tp` mesh dimension."""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from ..families.base import Family


def apply_tp(model: nn.Module, family: Family, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard the model in place; parameter names stay those of the unsplit model."""
    if tp_mesh.size() == 1:
        return model
    if tp_mesh.device_type == "cpu":
        # On a CPU mesh DTensor has no offset-based RNG tracker: a dropout on a DTensor draws from each rank's own
        # generator, seeded alike on every rank (model.py), which is all the warning (once per rank) is about.
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support on cpu device mesh")
    parallelize_module(model, tp_mesh, family.tp_plan(model))
    family.localize_attention(model, tp_mesh.size())
    return model


def keep_gradients_sharded(model: nn.Module) -> None:
    """DTensor's embedding backward returns a *replicated* gradient for a vocabulary-sharded weight: each rank
    would store (and the optimizer read) the whole table. Re-placing it like its parameter is a local slice.
    Called once the parameters exist (after `weights.materialize`): hooks live on the allocated tensors."""
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            placements = param.placements
            param.register_hook(
                lambda grad, placements=placements: (
                    grad if grad.placements == placements else grad.redistribute(placements=placements)
                )
            )
