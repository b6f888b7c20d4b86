"""A run's start around its data and model: the run folders (chosen by rank 0, locked for the run, checked; written
only once every input is accepted) and the pretrained model's local folder (downloaded once per node)."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch.distributed as dist

from .checkpoint import checkpoint_root, continuing_run
from .errors import UserError
from .families.base import download_model
from .layout import rank0_decides
from .reporting import choose_output_dir, write_json, write_yaml
from .runfolder import (
    RunLock,
    check_run_folders,
    record_written,
    replace_previous_run,
    restarted,
    run_folders,
)
from .tasks import LABEL_FILE, write_label_file

DOWNLOAD_WAIT_S = 6 * 3600  # a checkpoint of tens of GB over a slow link


def claim_run_folders(config, layout) -> tuple[Path, Path, RunLock]:
    """The output folder and checkpoint folder, chosen by rank 0 and locked by it for the run (a second run into
    them stops here), then checked (not inside a checkpoint; overwrite=true replaces only what runs recorded).
    Nothing is written yet. A refusal gives the folders back before it is raised."""
    output_dir = Path(
        rank0_decides(
            layout,
            lambda: str(choose_output_dir(config.output_dir, config.recipe, config.overwrite, continuing_run(config))),
        )
    )
    root = checkpoint_root(config.checkpoint_dir, output_dir)
    lock = RunLock(run_folders(output_dir, root))
    try:
        rank0_decides(layout, lock.acquire)
        replacing = config.overwrite and not restarted()
        rank0_decides(layout, lambda: check_run_folders(output_dir, root, replacing))
    except BaseException:
        lock.release()
        raise
    return output_dir, root, lock


def open_run_folder(output_dir: Path, root: Path, config, deepspeed_config: dict | None, task) -> None:
    """Rank 0, once every input is accepted (a failed start leaves nothing): overwrite=true's replacement of the
    previous run, then config.yaml, labels.json (what the head's ids mean, beside the outputs) and
    deepspeed_config.json, each put on the folder's record just before it is written (a killed run's are on record;
    what this run does not write stays off it)."""
    if config.overwrite and not restarted():
        replace_previous_run(output_dir, root)
    output_dir.mkdir(parents=True, exist_ok=True)
    record_written(output_dir, "config.yaml", LABEL_FILE)
    write_yaml(output_dir / "config.yaml", config.to_dict())
    write_label_file(output_dir, task)
    if deepspeed_config is not None:
        record_written(output_dir, "deepspeed_config.json")
        write_json(output_dir / "deepspeed_config.json", deepspeed_config)


def fetch_model(name: str, revision: str | None, layout, collective_timeout_s: float) -> str:
    """The pretrained model's local folder. A Hub name is downloaded once per node, by its first process,
    while the others wait; then all read the same cache. A local folder or SageMaker channel is used as is."""
    # Waiting for a download is no hung collective: this wait has its own limit, not collective_timeout_s.
    waiting = dist.new_group(
        backend="gloo", timeout=datetime.timedelta(seconds=max(collective_timeout_s, DOWNLOAD_WAIT_S))
    )
    problem = ""
    if layout.local_rank == 0:
        try:
            download_model(name, revision)
        except UserError as exc:
            problem = str(exc)
    problems: list = [None] * layout.world_size
    dist.all_gather_object(problems, problem, group=waiting)  # no rank reads a half-downloaded cache
    dist.destroy_process_group(waiting)
    if any(problems):
        raise UserError(next(p for p in problems if p))
    return download_model(name, revision, local_only=True)
