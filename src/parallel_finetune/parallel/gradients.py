"""Gradient summing over data-parallel ranks, the one step-wide reduction of the gradient norm and loss, and sparse
embedding gradients.

A rank's gradients are a mix: tensor-parallel shards (DTensor), FSDP shards (DTensor), optimizer-sharding
slices (plain tensors owned by one data-parallel rank) and replicated pieces (LayerNorms, or everything under
plain data parallelism). Each piece comes with its replica count, the number of ranks that hold the very same
numbers; summing square/replicas over the world counts every element of the full gradient exactly once. One
all-reduce of [norm², loss, stop] then gives every rank the global norm, the global loss, (the norm being inf or
NaN as soon as any rank overflowed) the fp16 skip decision they must all share, and whether any rank was asked to
stop (SIGTERM), so all of them checkpoint after the same step.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

BUCKET_ELEMENTS = 32 * 1024 * 1024  # 128 MiB of fp32 per all-reduce: few collectives, bounded extra memory

GradPiece = tuple[torch.Tensor, int]  # (local gradient, how many ranks hold the same numbers)


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def replicas(tensor: torch.Tensor, world_size: int) -> int:
    """Ranks holding identical copies of this rank's piece. A plain tensor is on every rank; a DTensor is
    copied along each mesh dimension where it is replicated (FSDP's `_StridedShard` is no `Shard`, so test for
    replication) and across every rank outside its mesh (the data-parallel replicas of a tensor-parallel mesh)."""
    if not isinstance(tensor, DTensor):
        return world_size
    mesh = tensor.device_mesh
    copies = world_size // mesh.size()
    for size, placement in zip(mesh.shape, tensor.placements):
        if placement.is_replicate():
            copies *= size
    return copies


def all_reduce_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum tensors over `group` in a few flat fp32 buckets (one collective each instead of one per tensor)."""
    if dist.get_world_size(group) == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors + [None]:
        if tensor is not None and (size + tensor.numel() <= BUCKET_ELEMENTS or not bucket):
            bucket.append(tensor)
            size += tensor.numel()
            continue
        if not bucket:
            break
        flat = torch.cat([t.reshape(-1).float() for t in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in bucket:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        bucket, size = ([tensor], tensor.numel()) if tensor is not None else ([], 0)


def reduce_norm_and_loss(
    pieces: list[GradPiece], loss: torch.Tensor, loss_replicas: int, world_size: int, stop_requested: bool = False
) -> tuple[float, float, bool]:
    """(global gradient L2 norm, global loss, whether any rank was asked to stop) from this rank's pieces, its
    share of the loss and its stop request (SIGTERM): one all-reduce for all three."""
    device = loss.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    totals[0] = squared_norm(pieces, device)
    totals[1] = loss.double() / loss_replicas
    totals[2] = float(stop_requested)
    if world_size > 1:
        dist.all_reduce(totals)
    norm_squared, total_loss, stops = totals.tolist()
    norm = math.sqrt(norm_squared) if norm_squared >= 0 else float("nan")
    return norm, total_loss, stops > 0


def squared_norm(pieces: list[GradPiece], device: torch.device) -> torch.Tensor:
    """Sum over pieces of |piece|² / replicas, in fp64, as a tensor (no host sync). One fused `_foreach_norm`
    per (replica count, dtype): a single read of each gradient, no squared temporaries (a per-tensor
    pow().sum() wrote and re-read every gradient: ~10% of a MiniLM step on a CPU)."""
    groups: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for grad, copies in pieces:
        groups.setdefault((copies, grad.dtype), []).append(grad)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (copies, dtype), grads in groups.items():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32) if dtype != torch.float32 else None
        norms = torch.stack(norms or torch._foreach_norm(grads, 2)).double()
        total += norms.square().sum() / copies
    return total


def scale_gradients(grads: list[torch.Tensor], factor: float) -> None:
    if factor == 1.0 or not grads:
        return
    torch._foreach_mul_(grads, factor)


def sparse_embedding_gradients(model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """Embedding tables that get a gradient only in the rows a batch looks up. A dense embedding backward
    allocates and zero-fills the whole table for every micro-batch and then adds it into `.grad` (a 30,522 x 384
    table: 47 MB written twice per backward, 8 times per step with 8 pipeline micro-batches or accumulation
    slices). Switched to sparse gradients, each backward adds only its rows into a dense `.grad` that stays
    allocated and is zeroed once per step (returned here, re-attached by `zero_grad`): the same sums, a single
    zero fill per step. Plain (non-DTensor) trainable tables only: a vocabulary-sharded DTensor table keeps its
    dense gradient."""
    grads = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(module) is nn.Embedding and weight.requires_grad and not isinstance(weight, DTensor):
            module.sparse = True
            weight.grad = grads[weight] = torch.zeros_like(weight)
    return grads
