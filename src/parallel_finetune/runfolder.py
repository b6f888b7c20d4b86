"""One run per run folder: a lock held while a run uses its folders, and overwrite=true as a real replacement.

The lock is `flock` on `.run.lock` in the output folder (and in the checkpoint folder when that lies elsewhere),
held by rank 0 for the whole run. The kernel drops it when the process ends in any way, SIGKILL included, so a
dead run never blocks the next one or a torchrun restart. The file records pid, host and start time for the
refusal message. Where the file system has no flock (some network mounts), the recorded pid decides instead: a
holder on this host that no longer runs is stale and taken over; one on another host is refused, naming the file
to delete once that run is over.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from .errors import UserError

log = logging.getLogger(__name__)

LOCK = ".run.lock"
# What a run writes into its output folder: what overwrite=true removes (anything else there is left alone).
RUN_OUTPUTS = (
    "metrics.jsonl",
    "eval.jsonl",
    "summary.json",
    "config.yaml",
    "deepspeed_config.json",
    "tensorboard",
    "hf",
)
RESTART_WAIT_S = 60  # a torchrun restart may start while the previous attempt's rank 0 is still exiting


def restarted() -> bool:
    """Whether this process is a torchrun restart (--max-restarts) of a run that already started in its folder."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def _holder() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def _read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def run_folders(output_dir: Path, checkpoint_root: Path) -> list[Path]:
    """The folders a run writes: the output folder, and the checkpoint folder where it lies elsewhere."""
    inside = checkpoint_root.resolve().is_relative_to(output_dir.resolve())
    return [output_dir] if inside else [output_dir, checkpoint_root]


class RunLock:
    """Rank 0 takes it in setup and gives it back at the end (or the process ending does)."""

    def __init__(self, folders: list[Path]):
        self.folders = folders
        self.handles: list = []
        self.created: list[Path] = []  # folders this run created, removed again if it fails to start

    def acquire(self) -> None:
        deadline = time.monotonic() + (RESTART_WAIT_S if restarted() else 0)
        for folder in self.folders:
            while True:
                try:
                    self._lock(folder)
                    break
                except UserError:
                    if time.monotonic() >= deadline:
                        self.release()
                        raise
                    time.sleep(1)

    def _lock(self, folder: Path) -> None:
        try:
            if not folder.exists():
                folder.mkdir(parents=True)
                self.created.append(folder)
            path = folder / LOCK
            handle = open(path, "a+", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{folder} cannot be written ({exc.strerror}); choose a writable output_dir") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                handle.close()
                raise UserError(
                    f"{folder} is in use by another run ({_describe(_read_holder(path))}); wait for it "
                    "to end, or choose another output_dir"
                ) from None
            self._check_recorded_holder(folder, path, handle)
        if os.fstat(handle.fileno()).st_ino != os.stat(path).st_ino:  # released and deleted meanwhile: retry
            handle.close()
            return self._lock(folder)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()))
        handle.flush()
        self.handles.append((path, handle))

    def _check_recorded_holder(self, folder: Path, path: Path, handle) -> None:
        """No flock on this file system: judge the pid the file records."""
        holder = _read_holder(path)
        if not holder or holder.get("pid") == os.getpid():
            return
        if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
            log.warning("taking over the stale lock %s (%s no longer runs)", path, _describe(holder))
            return
        handle.close()
        raise UserError(
            f"{folder} is in use by another run ({_describe(holder)}; this file system has no flock, "
            f"so if that run is over, delete {path})"
        )

    def release(self) -> None:
        """Give the folders back, and remove those this run created if it left nothing in them (a failed start
        leaves no run folder behind)."""
        for path, handle in self.handles:
            path.unlink(missing_ok=True)
            handle.close()
        self.handles = []
        for folder in reversed(self.created):
            if folder.is_dir() and not any(p.name != LOCK for p in folder.iterdir()):
                shutil.rmtree(folder, ignore_errors=True)
        self.created = []


def check_free(folders: list[Path]) -> None:
    """For --check: refuse folders another run holds, without creating or taking anything."""
    for folder in folders:
        path = folder / LOCK
        if not path.is_file():
            continue
        with open(path, encoding="utf-8") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(
                    f"{folder} is in use by another run ({_describe(_read_holder(path))}); wait for "
                    "it to end, or choose another output_dir"
                ) from None
            except OSError:
                pass  # no flock here: the run itself judges the recorded pid


def replace_previous_run(output_dir: Path, checkpoint_root: Path) -> None:
    """overwrite=true: delete what a previous run left in `output_dir` (its RUN_OUTPUTS) and its checkpoints, and
    say so; other files in the folder are left alone."""
    removed = [name for name in RUN_OUTPUTS if (output_dir / name).exists()]
    steps = sorted(p for p in checkpoint_root.glob("*step-*") if p.is_dir()) if checkpoint_root.is_dir() else []
    for name in removed:
        target = output_dir / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    for folder in steps:
        shutil.rmtree(folder)
    if steps:
        removed.append(f"{len(steps)} checkpoint(s) in {checkpoint_root}")
    if removed:
        log.info("overwrite=true: deleted the previous run's %s from %s", ", ".join(removed), output_dir)
