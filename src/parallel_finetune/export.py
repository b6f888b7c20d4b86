"""Export a (tensor-parallel) model as a plain Hugging Face folder: safetensors + config + tokenizer."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import UserError, one_line
from .integrity import nonfinite
from .runfolder import LOCK, RECORD, _alive, _holder, _read_holder, checkpoint_holding

log = logging.getLogger(__name__)


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


STAGING = ".export-in-progress-"  # + pid: a staging folder of ours, holding STAGING_MARKER
STAGING_MARKER = ".parallel-finetune-export"


def check_export_target(out: Path) -> None:
    """An export never goes into a checkpoint: resume would skip that checkpoint (files its manifest does not
    list) and delete it, the export with it."""
    inside = checkpoint_holding(out)
    if inside is not None:
        raise UserError(f"not exporting to {out}: it lies inside the checkpoint {inside}; choose a folder outside it")


def check_new_export_folder(out: Path) -> None:
    """OUT of export_hf.py: a new or empty folder outside any checkpoint, never a run's folder or a file."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a folder; choose a new or empty folder for the export")
    check_export_target(out)
    if not out.is_dir():
        return
    run_files = [name for name in (RECORD, LOCK, "metrics.jsonl") if (out / name).exists()]
    if run_files:
        raise UserError(
            f"{out} is a run folder (it holds {', '.join(run_files)}); export into a new or empty folder, "
            f"e.g. {out / 'exported'}"
        )
    if any(out.iterdir()):
        raise UserError(f"{out} already holds files; choose an empty or new folder")


def _remove_stale_staging(out: Path) -> None:
    """Staging folders of ours that a killed export left for `out`: exact name, our marker, and a writer that no
    longer runs on this host. Anything else is left alone."""
    places = [(out.parent, f".{out.name}{STAGING}")] + ([(out, STAGING)] if not out.is_symlink() else [])
    for folder in [
        p for place, prefix in places if place.is_dir() for p in place.iterdir() if p.name.startswith(prefix)
    ]:
        writer = _read_holder(folder / STAGING_MARKER)
        pid = folder.name.rsplit(STAGING, 1)[1]
        if folder.is_symlink() or not folder.is_dir() or str(writer.get("pid")) != pid:
            continue
        if writer.get("host") == socket.gethostname() and not _alive(pid):
            log.info("removing %s, left by an export that was killed", folder)
            shutil.rmtree(folder, ignore_errors=True)


def write_folder(out: Path, write: Callable[[Path], object]) -> None:
    """`write` into a staging folder, then move the result into `out`: a new `out` appears whole in one rename;
    an existing one (a mount point such as SageMaker's model folder, or an earlier export) keeps its old contents
    until the new ones are complete. On failure or interruption the staging folder goes and one line says why; one
    left by a killed export to the same `out` goes at the next."""
    check_export_target(out)
    _remove_stale_staging(out)
    existing = out.is_dir()
    staging = out / f"{STAGING}{os.getpid()}" if existing else out.with_name(f".{out.name}{STAGING}{os.getpid()}")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        (staging / STAGING_MARKER).write_text(json.dumps(_holder()))
        write(staging)
        (staging / STAGING_MARKER).unlink()
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
    except BaseException:  # Ctrl-C, SystemExit: no model-sized staging folder stays behind either
        shutil.rmtree(staging, ignore_errors=True)
        raise
