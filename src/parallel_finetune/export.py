"""Export a (tensor-parallel) model as a plain Hugging Face folder: safetensors + config + tokenizer."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import UserError, one_line
from .integrity import nonfinite


def gather_full_state_dict(
    model: nn.Module, dtype: torch.dtype, layout, names: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's weights (or those in `names`) on rank 0 (an empty dict elsewhere), by the unsplit
    model's names, in `dtype`.
    A collective: every rank gathers its stage's shards (one tensor at a time, to bound memory); with pipeline
    stages, each stage's first rank then hands its part to rank 0."""
    keep = layout.dp_rank == 0 and layout.tp_rank == 0  # one rank per pipeline stage keeps its stage's tensors
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if names is not None and name not in names:
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            full = full.detach().to("cpu")
            state[name] = full.to(dtype) if full.is_floating_point() else full
    if layout.pp == 1:
        return state if layout.is_main else {}
    parts: list | None = [None] * layout.pp if layout.pp_rank == 0 else None
    dist.gather_object(state if keep else {}, parts, group=layout.pp_group, group_dst=0)
    return {name: tensor for part in parts or [] for name, tensor in part.items()} if layout.is_main else {}


def save_hf(model: nn.Module, state: dict[str, torch.Tensor], tokenizer, out: Path) -> None:
    """Write a folder that `from_pretrained` loads, built from a fresh, unsharded copy of the model. Weights
    holding NaN/inf are refused; a failed write (a full disk) leaves `out` as it was."""
    bad = nonfinite(state)
    if bad:
        raise UserError(f"not exporting to {out}: {bad} holds NaN or inf (the run diverged; lower lr)")
    with torch.device("meta"):
        clean = type(model)(model.config)
    clean.load_state_dict(state, assign=True, strict=True)
    clean.tie_weights()  # assign=True replaced tied parameters one by one; tie them again (GPT-2, GPT-Neo)
    clean.config.dtype = next(iter(state.values())).dtype
    write_folder(out, lambda folder: (clean.save_pretrained(folder), tokenizer.save_pretrained(folder)))


def write_folder(out: Path, write: Callable[[Path], object]) -> None:
    """`write` into a staging folder, then move the result into `out`: a new `out` appears whole in one rename;
    an existing one (a mount point such as SageMaker's model folder, or an earlier export) keeps its old contents
    until the new ones are complete. On failure the staging folder goes and one line says why."""
    existing = out.is_dir()
    staging = out / f".export-{os.getpid()}" if existing else out.with_name(f".{out.name}.export-{os.getpid()}")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write(staging)
        if not existing:
            os.replace(staging, out)
            return
        for old in out.iterdir():
            if old != staging:
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        for new in staging.iterdir():
            os.replace(new, out / new.name)
        staging.rmdir()
    except Exception as exc:  # OSError, or safetensors' own error wrapping one
        reason = one_line(exc, staging if staging.exists() else out.parent)
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"export to {out} failed ({reason}); nothing was written there") from None
