"""Sharded checkpoints with exact resume, readable under any layout.

A checkpoint is a folder `step-00000010/` in the checkpoint folder:
- the model's state dict and AdamW's moments, written by `torch.distributed.checkpoint` (DCP) from every rank's
  shards. Keys are the unsplit model's parameter names and the moments are shaped like their parameters, so a
  checkpoint written under one layout (TP=2, FSDP, ZeRO-1, ...) loads under another: DCP reshards on load;
- `config.yaml` and `tokenizer/` (rank 0), so `scripts/export_hf.py` needs nothing else;
- `trainer_state.json` (rank 0): step, AdamW's step count, LR scheduler, loss scaler, and the model's parameter
  shapes, which identify the model it belongs to;
- `rng/rank<N>.pt` (every rank): the torch RNG states that dropout draws from. The data order needs none: batches
  are a function of the seed and the step.

It is written to `.tmp-step-…/` and renamed when every rank has finished, so a folder named `step-…` is
complete; the newest `keep_checkpoints` are kept. Nothing here unpickles objects: DCP, JSON, and
`torch.load(weights_only=True)` for the RNG tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import yaml
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .errors import UserError

log = logging.getLogger("parallel_finetune")

STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
NAME = re.compile(r"^step-(\d{8})$")
SAGEMAKER_CHECKPOINTS = Path("/opt/ml/checkpoints")  # synced to S3 through the job's checkpoint URI


def checkpoint_root(checkpoint_dir: str | None, output_dir: Path) -> Path:
    if checkpoint_dir:
        return Path(checkpoint_dir).expanduser()
    if "SM_TRAINING_ENV" in os.environ:  # a SageMaker training job
        return SAGEMAKER_CHECKPOINTS
    return output_dir / "checkpoints"


def continuing_run(config) -> bool:
    """Whether this run continues one in its output folder (so the folder may already hold files)."""
    if config.resume == "none" or not config.output_dir:
        return False
    return newest_checkpoint(checkpoint_root(config.checkpoint_dir, Path(config.output_dir).expanduser())) is not None


def _complete(folder: Path) -> str | None:
    """Why `folder` is not a usable checkpoint, or None when it is."""
    if not (folder / ".metadata").is_file():
        return "no DCP .metadata"
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} unreadable ({type(exc).__name__})"
    if not isinstance(state, dict) or "step" not in state:
        return f"{STATE_FILE} has no step"
    return None


def newest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`; incomplete or corrupt ones are skipped with a warning."""
    if not root.is_dir():
        return None
    for folder in sorted((p for p in root.iterdir() if NAME.match(p.name)), reverse=True):
        problem = _complete(folder)
        if problem is None:
            return folder
        log.warning("skipping checkpoint %s: %s; trying the one before", folder, problem)
    return None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """`resume` as a checkpoint folder: auto = the newest complete one (or none), none, or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        return newest_checkpoint(root)
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise UserError(f"resume={resume!r}: no such checkpoint folder (valid: auto, none, or a step-… folder)")
    if NAME.match(path.name) is None and newest_checkpoint(path) is not None:
        return newest_checkpoint(path)  # a checkpoint folder's parent: its newest checkpoint
    problem = _complete(path)
    if problem is not None:
        raise UserError(f"resume={resume!r} is not a complete checkpoint: {problem}")
    return path


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Global (unsplit) shapes by name: what identifies a model whatever the layout."""
    return {name: list(param.shape) for name, param in model.named_parameters()}


def save(trainer, root: Path) -> Path | None:
    """Write a checkpoint of `trainer` at its current step; every rank calls this. A failure (full disk, a
    read-only folder) is a warning: the previous checkpoints stay as they were, and training goes on."""
    layout = trainer.layout
    final = root / f"step-{trainer.step:08d}"
    partial = root / f".tmp-step-{trainer.step:08d}"
    error: list[str] = []

    def stage(action, everywhere: bool = True) -> bool:
        """Run `action` (on every rank, or rank 0 only) unless a stage failed; all ranks agree on the outcome,
        so none enters the next collective alone."""
        if not error and (everywhere or layout.is_main):
            try:
                action()
            # OSError, or DCP's CheckpointException (a BaseException, raised on every rank) wrapping one
            except (Exception, CheckpointException) as exc:
                if isinstance(exc, CheckpointException) and exc.failures:  # the rank's own error says what
                    exc = next(iter(exc.failures.values()))
                error.append(f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
        flag = torch.tensor([1.0 if error else 0.0], device=layout.device)
        dist.all_reduce(flag)
        if flag.item() and not error:
            error.append("another rank failed")
        return not error

    def make_folder():
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "rng").mkdir(parents=True)

    def write_rng():
        cuda = torch.cuda.get_rng_state() if layout.device.type == "cuda" else torch.zeros(0, dtype=torch.uint8)
        torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, partial / "rng" / f"rank{layout.rank}.pt")

    def write_shards():
        dcp.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.moments(trainer.model)},
                 checkpoint_id=partial)

    def finish():
        state = {"step": trainer.step, "adam_step": trainer.adam_step,
                 "scheduler": trainer.scheduler.state_dict(),
                 "loss_scaler": {"scale": trainer.scaler.scale, "clean_steps": trainer.scaler.clean_steps},
                 "family": trainer.family.name, "task": trainer.config.task, "layout": layout.describe(),
                 "parameter_shapes": trainer.parameter_shapes}
        # What an export needs without the data: the run's configuration and tokenizer.
        (partial / CONFIG_FILE).write_text(yaml.safe_dump(trainer.config.to_dict(), sort_keys=False))
        trainer.data.tokenizer.save_pretrained(partial / "tokenizer")
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
        os.replace(partial, final)  # atomic: a folder named step-… is complete
        for old in sorted((p for p in root.iterdir() if NAME.match(p.name)), reverse=True)[
                trainer.config.keep_checkpoints:]:
            shutil.rmtree(old, ignore_errors=True)

    done = (stage(make_folder, everywhere=False) and stage(write_rng) and stage(write_shards)
            and stage(finish, everywhere=False))
    if not done:
        if layout.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        log.warning("checkpoint at step %d not written (%s); the previous ones are untouched", trainer.step,
                    error[0])
        return None
    log.info("checkpoint %s", final)
    return final


def check_same_model(folder: Path, state: dict, family: str, task: str, shapes: dict[str, list[int]]) -> None:
    if (state.get("family"), state.get("task")) != (family, task):
        raise UserError(f"checkpoint {folder} is a {state.get('family')} {state.get('task')} model, this run a "
                        f"{family} {task} one; resume=none starts fresh")
    theirs = state.get("parameter_shapes", {})
    differences = sorted(set(theirs) ^ set(shapes)) or [n for n in shapes if theirs[n] != shapes[n]]
    if differences:
        name = differences[0]
        raise UserError(f"checkpoint {folder} holds another model: parameter {name!r} is "
                        f"{theirs.get(name, 'absent')} there, {shapes.get(name, 'absent')} here "
                        f"({len(differences)} differences); resume=none starts fresh")


def load(trainer, folder: Path) -> None:
    """Restore `trainer` from `folder`, whatever layout wrote it."""
    state = json.loads((folder / STATE_FILE).read_text())
    check_same_model(folder, state, trainer.family.name, trainer.config.task, trainer.parameter_shapes)
    moments = trainer.optimizer.moments(trainer.model)  # placeholders with this layout's shapes and placements
    target = {"model": trainer.model.state_dict(), "optimizer": moments}
    dcp.load(target, checkpoint_id=folder)  # in place, resharding from the writer's layout
    trainer.optimizer.load_moments(trainer.model, target["optimizer"], state["adam_step"])
    trainer.adam_step = state["adam_step"]
    # Layouts group parameters differently (DTensor and plain tensors apart, ZeRO buckets), but every group
    # follows the same schedule: restore its position, not the writer's per-group lists.
    saved, scheduler_state = state["scheduler"], trainer.scheduler.state_dict()
    groups = len(scheduler_state["base_lrs"])
    scheduler_state.update(last_epoch=saved["last_epoch"], _step_count=saved["_step_count"],
                           _last_lr=[saved["_last_lr"][0]] * groups)
    trainer.scheduler.load_state_dict(scheduler_state)
    for group, lr in zip(trainer.scheduler.optimizer.param_groups, trainer.scheduler.get_last_lr()):
        group["lr"] = lr
    trainer.scaler.scale = state["loss_scaler"]["scale"]
    trainer.scaler.clean_steps = state["loss_scaler"]["clean_steps"]
    trainer.step = state["step"]
    rng_file = folder / "rng" / f"rank{trainer.layout.rank}.pt"
    if rng_file.is_file():  # a different world size has other ranks: their dropout masks differ anyway
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if trainer.layout.device.type == "cuda" and rng["cuda"].numel():
            torch.cuda.set_rng_state(rng["cuda"])
    log.info("resumed from %s (step %d, written by %s)", folder, trainer.step,
             ", ".join(f"{k}={v}" for k, v in state["layout"].items() if k in ("world_size", "data_parallel",
                                                                                "tensor_parallel", "sharding")))


def export_checkpoint(folder: Path, out: Path, dtype: str = "float32") -> Path:
    """A Hugging Face model folder from any layout's checkpoint, in one process (no process group)."""
    from transformers import AutoTokenizer

    from .config import Config
    from .export import DTYPES, save_hf
    from .families import get_family
    from .families.base import download_model
    from .weights import materialize

    folder = Path(folder)
    problem = _complete(folder) if folder.is_dir() else "no such folder"
    if problem is not None:
        raise UserError(f"checkpoint {str(folder)!r} is not a complete checkpoint: {problem}")
    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r} is not valid; expected one of {'|'.join(DTYPES)}")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} already holds files; choose an empty or new folder")
    config = Config(**yaml.safe_load((folder / CONFIG_FILE).read_text()))
    family = get_family(config.family)
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    model_path = None
    if config.size == "full":  # its config.json gives the architecture
        model_path = download_model(config.model or family.default_model, config.revision, local_only=True)
    hf_config = family.config_for(config, len(tokenizer), tokenizer.pad_token_id, model_path)
    model = family.build(config.task, hf_config)  # shapes only: the checkpoint supplies every value
    materialize(model, torch.device("cpu"))
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=folder)
    state = {name: tensor.to(DTYPES[dtype]) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    save_hf(model, family.to_hf_state_dict(state, hf_config), tokenizer, out)
    return out
