"""Activation memory savers: per-block activation checkpointing and offloading saved activations to the CPU.

Checkpointing replaces a block's `forward` on the instance (no wrapper module), so parameter names, state
dicts and exported checkpoints stay those of the unmodified model. The non-reentrant implementation saves the
RNG state, so dropout draws the same masks when the block is recomputed: the loss does not change.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)


def checkpointed_blocks(numbers: list[int], every: bool | int) -> list[int]:
    """Which blocks (by number in the unsplit model) to checkpoint: all (true), every N-th (N), none (false or 0)."""
    if every is False or every == 0:
        return []
    step = 1 if every is True else int(every)
    return [number for number in numbers if number % step == 0]


def apply_activation_checkpointing(
    blocks: list[nn.Module], every: bool | int, numbers: list[int] | None = None
) -> list[int]:
    """`numbers`: the blocks' numbers in the unsplit model (a pipeline stage holds some), so every N-th block
    means the same blocks in every layout."""
    numbers = list(range(len(blocks))) if numbers is None else numbers
    chosen = checkpointed_blocks(numbers, every)
    for block, number in zip(blocks, numbers):
        if number in chosen:
            block.forward = _checkpointed(block.forward)
    return chosen


def _checkpointed(forward):
    """`forward` under activation checkpointing, as a function of this module. compile=true compiles a block from
    the first frame below its `__call__` that is not torch's own; a bare `torch.utils.checkpoint` there (a
    functools.partial) is torch's own, and dynamo skipped it with everything it called: the block ran eager. From
    this frame dynamo traces the checkpoint into the block's graph."""

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def offload_context(enabled: bool, device: torch.device):
    """Saved activations go to (pinned) CPU memory during the forward and come back for the backward."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()


def nf4_bytes(weights: list[torch.Tensor]) -> int:
    """Bytes of QLoRA's NF4 weights (quantize.py) as held: 4-bit codes, int8 scalers, their factors and means."""
    inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
    return sum(getattr(w, key).numel() * getattr(w, key).element_size() for w in weights for key in inner)


def measure_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters (QLoRA's NF4 base counted at its quantized size), gradients and optimizer
    state (tensor accounting, not process RSS).
    Flat-buffer views (optimizer sharding) are counted once, as the model's parameters and gradients."""
    params = list(model.parameters())
    state = [
        value
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1
    ]  # not the scalar `step` counters
    # QLoRA's frozen base (quantize.py): NF4 buffers, or FSDP's NF4 parameters (DTensors of NF4 shards)
    nf4 = [t for t in [*model.buffers(), *(_local(p) for p in params)] if type(t).__name__ == "NF4Tensor"]
    return {
        "params": sum(_local_bytes(p) for p in params if type(_local(p)).__name__ != "NF4Tensor") + nf4_bytes(nf4),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local_bytes(t) for t in state),
    }


def peak_activation_bytes(model: nn.Module, forward_backward) -> int:
    """Peak bytes of activations (saved for the backward, or recomputed) plus backward temporaries while
    `forward_backward()` runs: tensor accounting by PyTorch's MemTracker, so it works on a CPU too."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")  # its module tracker, about freed modules
        with tracker:
            forward_backward()
    peak = tracker.get_tracker_snapshot("peak")
    kinds = {"Activation", "Temp"}
    return sum(
        size
        for per_device in peak.values()
        for kind, size in per_device.items()
        if getattr(kind, "value", kind) in kinds
    )
