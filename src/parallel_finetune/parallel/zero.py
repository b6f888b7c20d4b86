"""sharding=optimizer (ZeRO-1): parameters and gradients live in flat buffers (the model's tensors are views into
them); each data-parallel rank receives the sum of its own 1/dp slice of the gradients (reduce-scatter), runs AdamW
on that slice only, so it keeps 1/dp of the optimizer state, and the updated slices are all-gathered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import TrainingSection
from .adamw import (
    MOMENTS,
    AdamWSettings,
    Replicas,
    fused_step,
    held_names,
    layout_neutral_names,
    make_adamw,
    step_tensor,
)
from .gradients import GradPiece, local
from .layout import Layout


def zero_adamw(
    model: nn.Module, layout: Layout, *, training: TrainingSection, tied: list[tuple[str, ...]]
) -> ZeroAdamW:
    """ZeRO-1's optimizer (AdamW's settings from `training`), made before the weights exist: its flat buffers are
    where the parameters live."""
    return ZeroAdamW(model, layout, AdamWSettings.of(training), held_names(tied, model))


class _FlatBucket:
    """Parameters of one optimizer group, laid end to end in one flat buffer (padded to a multiple of dp),
    with a matching flat gradient buffer; the model's parameters and gradients become views into them.
    Parameters still on `meta` are allocated right here, in the buffer (their values are loaded afterwards), so
    a rank never holds a second copy of them."""

    def __init__(self, params: list[nn.Parameter], dp: int, dp_rank: int, device: torch.device):
        self.params = params
        shapes = [local(p).shape for p in params]
        numel = sum(shape.numel() for shape in shapes)
        padded = -(-numel // dp) * dp
        self.data = torch.empty(padded, dtype=params[0].dtype, device=device)
        self.data[numel:].zero_()
        self.grad = torch.zeros_like(self.data)
        offset = 0
        self.offsets: list[int] = []
        for param, shape in zip(params, shapes):
            self.offsets.append(offset)
            n = shape.numel()
            view = self.data[offset : offset + n].view(shape)
            if not param.is_meta:
                view.copy_(local(param).detach())
            # The parameter now lives in the buffer (for a DTensor, its local shard does); same Parameter object.
            torch.utils.swap_tensors(param, nn.Parameter(_like(param, view), param.requires_grad))
            param.grad = _like(param, self.grad[offset : offset + n].view(shape))
            offset += n
        shard = padded // dp
        self.slice = slice(dp_rank * shard, (dp_rank + 1) * shard)
        # The optimizer's parameter: this rank's slice, a view, so an update lands in the model directly.
        self.owned = nn.Parameter(self.data[self.slice], requires_grad=True)
        self.owned.grad = self.grad[self.slice]


def _like(param: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` as this rank's piece of `param`: a DTensor placed like it, or the tensor itself."""
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local_tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local_tensor


class ZeroAdamW:
    """Optimizer-state sharding (ZeRO-1) over the data-parallel group."""

    def __init__(self, model: nn.Module, layout: Layout, settings: AdamWSettings, shared: dict[str, str] | None = None):
        self.layout = layout
        self.shared = shared or {}
        count = Replicas(model, layout, self.shared)
        # Buckets must be homogeneous in decay and in how many tensor-parallel ranks hold the same numbers.
        by_kind: dict[tuple[bool, int], list[nn.Parameter]] = {}
        for param in model.parameters():
            if param.requires_grad:
                by_kind.setdefault((param.ndim >= 2, count(param, param)), []).append(param)
        self.buckets = [
            (_FlatBucket(params, layout.dp, layout.dp_rank, layout.device), copies // layout.dp)
            for (_, copies), params in sorted(by_kind.items())
        ]
        decays = [settings.weight_decay if decay else 0.0 for decay, _ in sorted(by_kind)]
        groups = [{"params": [bucket.owned], "weight_decay": decay} for (bucket, _), decay in zip(self.buckets, decays)]
        self.optimizer = make_adamw(groups, settings)

    def arm(self) -> None:
        pass  # the reduce-scatter follows the backward

    def sync_gradients(self) -> None:
        # Only the owned slice needs the sum: a reduce-scatter moves half the bytes of an all-reduce.
        for bucket, _ in self.buckets:
            if self.layout.dp > 1:
                summed = torch.empty_like(bucket.owned.grad)
                dist.reduce_scatter_tensor(summed, bucket.grad, group=self.layout.dp_group)
                bucket.owned.grad.copy_(summed)

    def gradient_pieces(self) -> list[GradPiece]:
        # Each rank's slice is its own (no data-parallel replicas); tensor-parallel replicas as in the bucket.
        return [(bucket.owned.grad, copies) for bucket, copies in self.buckets]

    def step(self, divisor: float = 1.0) -> None:
        fused_step(self.optimizer, divisor)  # the owned slices are plain tensors
        for bucket, _ in self.buckets:
            if self.layout.dp > 1:
                dist.all_gather_into_tensor(bucket.data, bucket.owned.detach().clone(), group=self.layout.dp_group)

    def zero_grad(self) -> None:
        for bucket, _ in self.buckets:
            bucket.grad.zero_()

    def moments(self, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """Per-parameter moments (see DataParallelAdamW.moments): each rank's slices are all-gathered into
        whole buffers, then cut back into parameter-shaped views."""
        names = layout_neutral_names(model, self.shared)
        result: dict[str, dict[str, torch.Tensor]] = {}
        for bucket, _ in self.buckets:
            state = self.optimizer.state.get(bucket.owned, {})
            for key in MOMENTS:
                owned = state[key] if key in state else torch.zeros_like(bucket.owned)
                whole = torch.empty_like(bucket.data)
                if self.layout.dp > 1:
                    dist.all_gather_into_tensor(whole, owned.detach().contiguous(), group=self.layout.dp_group)
                else:
                    whole.copy_(owned)
                for param, offset in zip(bucket.params, bucket.offsets):
                    piece = whole[offset : offset + local(param).numel()].view(local(param).shape)
                    if isinstance(param, DTensor):
                        piece = DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False)
                    result.setdefault(names[param], {})[key] = piece
        return result

    def load_moments(self, model: nn.Module, moments: dict[str, dict[str, torch.Tensor]], adam_step: int) -> None:
        names = layout_neutral_names(model, self.shared)
        for bucket, _ in self.buckets:
            state = {"step": step_tensor(adam_step, bucket.owned)}
            for key in MOMENTS:
                whole = torch.zeros_like(bucket.data)
                for param, offset in zip(bucket.params, bucket.offsets):
                    whole[offset : offset + local(param).numel()].copy_(local(moments[names[param]][key]).reshape(-1))
                state[key] = whole[bucket.slice].clone()
            self.optimizer.state[bucket.owned] = state
