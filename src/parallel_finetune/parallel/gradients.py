"""Gradient synchronisation and global norms over a mix of DTensor (sharded) and plain (replicated) parameters.

Tensor-parallel models hold both kinds (LayerNorms and small heads stay plain). torch's GradScaler and foreach
norm kernels reject such a mix, so these functions work on local shards and reduce explicitly.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

BUCKET_ELEMENTS = 32 * 1024 * 1024  # 128 MiB of fp32 per all-reduce: few collectives, bounded extra memory


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def all_reduce_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup,
                         extra: torch.Tensor | None = None) -> torch.Tensor | None:
    """Sum gradients over the data-parallel group in a few flat buckets; `extra` (e.g. the loss) rides along.

    Summing (not averaging) is right because every micro-batch loss is already divided by the global count.
    """
    grads = [local(p.grad) for p in params if p.grad is not None]
    if extra is not None:
        grads.append(extra.reshape(1))
    if dist.get_world_size(group) == 1:
        return extra
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads + [None]:
        if grad is not None and (size + grad.numel() <= BUCKET_ELEMENTS or not bucket):
            bucket.append(grad)
            size += grad.numel()
            continue
        if not bucket:
            break
        flat = torch.cat([g.reshape(-1).float() for g in bucket])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = ([grad], grad.numel()) if grad is not None else ([], 0)
    return extra


def global_grad_norm(params: list[torch.nn.Parameter], tp_group: dist.ProcessGroup) -> float:
    """L2 norm of the full gradient: squares of sharded pieces summed over the tp group, replicas counted once."""
    sharded = torch.zeros((), dtype=torch.float32, device=_device(params))
    replicated = torch.zeros((), dtype=torch.float32, device=_device(params))
    for p in params:
        if p.grad is None:
            continue
        square = local(p.grad).float().pow(2).sum()
        if is_sharded(p.grad):
            sharded += square
        else:
            replicated += square
    if dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sharded, group=tp_group)
    return math.sqrt((sharded + replicated).item())


def scale_gradients(params: list[torch.nn.Parameter], factor: float) -> None:
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            local(p.grad).mul_(factor)


def any_rank(flag: bool, device: torch.device) -> bool:
    """True when `flag` is set on any rank of the world: the one decision all ranks must share."""
    if dist.get_world_size() == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item())


def _device(params: list[torch.nn.Parameter]) -> torch.device:
    return local(params[0]).device
