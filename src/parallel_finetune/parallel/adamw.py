"""AdamW as the trainer runs it, whatever holds the parameters: decay groups, the fused step that unscales and clips
as it reads the gradients, AdamW's moments by layout-neutral name (what checkpoints hold), and `DataParallelAdamW`,
the optimizer of sharding=none (every parameter, gradients summed over the data-parallel ranks) and of FSDP
(`fsdp.py`: sharding=full|hybrid, the shards FSDP reduce-scatters itself). ZeRO-1's optimizer is `zero.py`'s.

Gradients are always *summed* over data-parallel ranks: each micro-batch loss is already divided by the global
count, so a sum gives exactly the single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..config import TrainingSection
from .gradients import GradPiece, all_reduce_flat, local, replicas, scale_gradients, sparse_embedding_gradients
from .layout import Layout
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
    def of(cls, training: TrainingSection) -> AdamWSettings:
        return cls(training.lr, training.weight_decay, tuple(training.adam_betas), training.adam_eps)


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


def layout_neutral_names(model: nn.Module, shared: dict[str, str]) -> dict[nn.Parameter, str]:
    """Parameter -> layout-neutral name (a weight shared by two pipeline stages goes by its first name)."""
    return {param: shared.get(name, name) for name, param in model.named_parameters()}


def held_names(tied: list[tuple[str, ...]], model: nn.Module) -> dict[str, str]:
    """For each weight shared across pipeline stages: the name this stage holds it by -> its first name (the
    `shared` mapping the optimizers take)."""
    held = dict(model.named_parameters())
    return {name: names[0] for names in tied for name in names if name in held}


class Replicas:
    """How many ranks hold the same numbers as this rank's piece of a parameter (see gradients.replicas):
    counted within a pipeline stage, doubled for a weight that the first and last stage both hold."""

    def __init__(self, model: nn.Module, layout: Layout, shared: dict[str, str]):
        self.world = layout.stage_world_size
        self.doubled = {id(param) for name, param in model.named_parameters() if name in shared}

    def __call__(self, param: torch.Tensor, tensor: torch.Tensor) -> int:
        return replicas(tensor, self.world) * (2 if id(param) in self.doubled else 1)


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
        self.replicas = Replicas(model, layout, self.shared)
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
        for param, name in layout_neutral_names(model, self.shared).items():
            if not param.requires_grad:  # frozen (LoRA's base): no optimizer state
                continue
            state = self.optimizer.state.get(param, {})
            result[name] = {key: state[key] if key in state else torch.zeros_like(param) for key in MOMENTS}
        return result

    def load_moments(self, model: nn.Module, moments: dict[str, dict[str, torch.Tensor]], adam_step: int) -> None:
        for param, name in layout_neutral_names(model, self.shared).items():
            if not param.requires_grad:
                continue
            self.optimizer.state[param] = {"step": step_tensor(adam_step, param), **moments[name]}


MOMENTS = ("exp_avg", "exp_avg_sq")


def step_tensor(adam_step: int, param: torch.Tensor) -> torch.Tensor:
    # The fused AdamW keeps its step count as a float32 tensor beside the parameter.
    return torch.tensor(float(adam_step), dtype=torch.float32, device=local(param).device)
