"""How data-parallel ranks hold the training state, and the optimizer that goes with each choice.

- `none`: every rank holds everything; after the backward, gradients are summed over the data-parallel group.
- `optimizer` (ZeRO-1): parameters and gradients live in flat buffers (the model's tensors are views into
  them); each data-parallel rank receives the sum of its own 1/dp slice of the gradients (reduce-scatter),
  runs AdamW on that slice only, so it keeps 1/dp of the optimizer state, and the updated slices are
  all-gathered.
- `full` / `hybrid`: FSDP2 (`fully_shard`) per transformer block and at the root; it reduce-scatters the
  gradients itself during the backward.

Gradients are always *summed* over data-parallel ranks: each micro-batch loss is already divided by the global
count, so a sum gives exactly the single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from ..layout import Layout
from .gradients import GradPiece, all_reduce_flat, local, replicas, scale_gradients
from .overlap import OverlappedGradientSum


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No decay on biases and norm weights (every 1-D parameter). DTensor and plain parameters go into
    separate groups, so the fused/foreach kernels never see a mix (they reject one). A ZeRO-3 partitioned
    parameter is a flat piece: its `ds_shape` is the real one."""
    groups: dict[tuple[bool, bool], list] = {}
    for param in model.parameters():
        if param.requires_grad:
            matrix = len(getattr(param, "ds_shape", param.shape)) >= 2
            groups.setdefault((matrix, isinstance(param, DTensor)), []).append(param)
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0}
        for (decay, _), params in sorted(groups.items())
    ]


@dataclass(frozen=True)
class AdamWSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float

    @classmethod
    def of(cls, config) -> AdamWSettings:
        return cls(config.lr, config.weight_decay, tuple(config.adam_betas), config.adam_eps)


def make_adamw(groups: list[dict], settings: AdamWSettings) -> torch.optim.AdamW:
    # The fused kernel (one launch per group; what the HF Trainer also uses) is ~10% of a CPU step faster.
    return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps, fused=True)


def fused_step(optimizer: torch.optim.Optimizer, divisor: float) -> None:
    """AdamW's step with the gradients divided by `divisor` inside the fused kernel, as it reads them (what
    GradScaler uses): unscaling and clipping cost no pass of their own over the gradients."""
    optimizer.grad_scale = None if divisor == 1.0 else torch.tensor(divisor, dtype=torch.float32)
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None


def _named(model: nn.Module, shared: dict[str, str]) -> dict[nn.Parameter, str]:
    """Parameter -> layout-neutral name (a weight shared by two pipeline stages goes by its first name)."""
    return {param: shared.get(name, name) for name, param in model.named_parameters()}


class _Replicas:
    """How many ranks hold the same numbers as this rank's piece of a parameter (see gradients.replicas):
    counted within a pipeline stage, doubled for a weight that the first and last stage both hold."""

    def __init__(self, model: nn.Module, layout: Layout, shared: dict[str, str]):
        self.world = layout.stage_world_size
        self.doubled = {id(param) for name, param in model.named_parameters() if name in shared}

    def __call__(self, param: torch.Tensor, tensor: torch.Tensor) -> int:
        return replicas(tensor, self.world) * (2 if id(param) in self.doubled else 1)


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


class DataParallelAdamW:
    """AdamW on every parameter (`none`), or on FSDP's sharded parameters (`full`, `hybrid`).
    `shared`: names of weights this pipeline stage shares with another -> their layout-neutral names."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        settings: AdamWSettings,
        shared: dict[str, str] | None = None,
        overlap_bucket_mib: float | None = None,
    ):
        self.layout = layout
        self.shared = shared or {}
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replicas = _Replicas(model, layout, self.shared)
        self.fsdp = isinstance(model, FSDPModule)  # FSDP reduce-scatters during the backward itself
        self.optimizer = make_adamw(optimizer_groups(model, settings.weight_decay), settings)
        self.embedding_grads = {} if self.fsdp else sparse_embedding_gradients(model)
        # DDP-style buckets all-reduced during the step's last backward (overlap.py); None: summed after it
        self.overlap = (
            OverlappedGradientSum(self.params, layout.dp_group, overlap_bucket_mib)
            if overlap_bucket_mib and layout.dp > 1 and not self.fsdp
            else None
        )

    def arm(self) -> None:
        """The coming backward is the step's last (WholeModel calls this through TorchUpdates.backward)."""
        if self.overlap is not None:
            self.overlap.arm()

    def sync_gradients(self) -> None:
        if self.overlap is not None and self.overlap.armed:
            self.overlap.finish()
        elif not self.fsdp:  # (and a pipeline's backwards, which are not armed)
            all_reduce_flat([local(p.grad) for p in self.params if p.grad is not None], self.layout.dp_group)

    def gradient_pieces(self) -> list[GradPiece]:
        return [(local(p.grad), self.replicas(p, p.grad)) for p in self.params if p.grad is not None]

    def step(self, divisor: float = 1.0) -> None:
        """The update with every gradient divided by `divisor` (loss scale / clipping coefficient)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if any(isinstance(g, DTensor) for g in grads):  # the fused kernel takes no plain grad_scale beside DTensors
            scale_gradients([local(g) for g in grads], 1.0 / divisor)
            divisor = 1.0
        fused_step(self.optimizer, divisor)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for param, grad in self.embedding_grads.items():
            grad.zero_()
            param.grad = grad

    def moments(self, model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's moments by parameter name, each shaped and placed like its parameter: a form every layout
        can write and read (checkpoints reshard through it)."""
        result = {}
        for param, name in _named(model, self.shared).items():
            if not param.requires_grad:  # frozen (LoRA's base): no optimizer state
                continue
            state = self.optimizer.state.get(param, {})
            result[name] = {key: state[key] if key in state else torch.zeros_like(param) for key in MOMENTS}
        return result

    def load_moments(self, model: nn.Module, moments: dict[str, dict[str, torch.Tensor]], adam_step: int) -> None:
        for param, name in _named(model, self.shared).items():
            if not param.requires_grad:
                continue
            self.optimizer.state[param] = {"step": _step_tensor(adam_step, param), **moments[name]}


MOMENTS = ("exp_avg", "exp_avg_sq")


def _step_tensor(adam_step: int, param: torch.Tensor) -> torch.Tensor:
    # The fused AdamW keeps its step count as a float32 tensor beside the parameter.
    return torch.tensor(float(adam_step), dtype=torch.float32, device=local(param).device)


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
        count = _Replicas(model, layout, self.shared)
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
        names = _named(model, self.shared)
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
        names = _named(model, self.shared)
        for bucket, _ in self.buckets:
            state = {"step": _step_tensor(adam_step, bucket.owned)}
            for key in MOMENTS:
                whole = torch.zeros_like(bucket.data)
                for param, offset in zip(bucket.params, bucket.offsets):
                    whole[offset : offset + local(param).numel()].copy_(local(moments[names[param]][key]).reshape(-1))
                state[key] = whole[bucket.slice].clone()
            self.optimizer.state[bucket.owned] = state


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList, layout: Layout, compute_dtype: torch.dtype | None) -> None:
    """FSDP2 per block, then the root (embeddings, head, norms). Gradients are reduced in fp32 and summed."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for module in [*blocks, model]:
        fully_shard(module, mesh=layout.fsdp_mesh, mp_policy=policy)
        # A plain sum (no averaging), done with SUM collectives: gloo has no pre-multiplied sum.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
