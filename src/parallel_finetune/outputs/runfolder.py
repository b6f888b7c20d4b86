"""A run's folders, one home for what a run writes there: choose, claim, lock, record, stage.

Choose: the output folder (`choose_output_dir`: the one named, SageMaker's, or a new runs/<recipe>-<time>) and the
checkpoint folder (`checkpoint_root`), by rank 0. Claim: `claim_run_folders` chooses, locks and checks them before
any input is read; `open_run_folder` writes the run's first files once every input is accepted, so a failed start
leaves nothing.

Lock: `flock` on `.run.lock` in the output folder (and in the checkpoint folder when that lies elsewhere),
held by rank 0 for the whole run. The kernel drops it when the process ends in any way, SIGKILL included, so a
dead run never blocks the next one or a torchrun restart. The file records pid, host and start time for the
refusal message. Where the file system has no flock (some network mounts), the recorded pid decides instead: a
holder on this host that no longer runs is stale and taken over; one on another host is refused, naming the file
to delete once that run is over.

Record: every folder a run writes into keeps a record of ours, `.parallel-finetune-outputs`: the names (plain
children, one a line under a fixed first line) that runs wrote there, each added just before it is written
(`record_written`) and only if it is, so even a killed run leaves its names on record and a name no run wrote is
never on it. overwrite=true deletes those names and nothing else: a folder without our record loses nothing, and
one holding a name a run writes that no run recorded (someone's tensorboard/, an older run's) is refused rather
than written over. SageMaker's folders ($SM_MODEL_DIR, $SM_OUTPUT_DATA_DIR) are used only inside a SageMaker
training job, and never where the user named a folder.

Stage: `write_folder` writes an export into a staging folder of ours and moves it into place in one rename; one
that a killed export left behind goes at the next export to the same folder. Neither goes inside a checkpoint.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from ..config import CheckpointSection, OutputSection
from ..errors import UserError, one_line
from ..parallel.layout import rank0_decides
from ..tasks import DPO, LABEL_FILE, REWARD, SFT, write_label_file
from .run_files import CHECKPOINT_NAME, LOCK, RECORD, RECORD_HEADER, RUN_OUTPUTS
from .run_files import EXPORT_STAGING as STAGING
from .run_files import EXPORT_STAGING_MARKER as STAGING_MARKER

if TYPE_CHECKING:
    from ..tasks.task import Task

log = logging.getLogger(__name__)

RESTART_WAIT_S = 60  # a torchrun restart may start while the previous attempt's rank 0 is still exiting


def restarted() -> bool:
    """Whether this process is a torchrun restart (--max-restarts) of a run that already started in its folder."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"


def holder_of_this_process() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _describe(holder: dict) -> str:
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"


def read_holder(path: Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def process_alive(pid) -> bool:
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
                    f"{folder} is in use by another run ({_describe(read_holder(path))}); wait for it "
                    "to end, or choose another output_dir"
                ) from None
            self._check_recorded_holder(folder, path, handle)
        if os.fstat(handle.fileno()).st_ino != os.stat(path).st_ino:  # released and deleted meanwhile: retry
            handle.close()
            return self._lock(folder)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(holder_of_this_process()))
        handle.flush()
        self.handles.append((path, handle))

    def _check_recorded_holder(self, folder: Path, path: Path, handle) -> None:
        """No flock on this file system: judge the pid the file records."""
        holder = read_holder(path)
        if not holder or holder.get("pid") == os.getpid():
            return
        if holder.get("host") == socket.gethostname() and not process_alive(holder.get("pid")):
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
                    f"{folder} is in use by another run ({_describe(read_holder(path))}); wait for "
                    "it to end, or choose another output_dir"
                ) from None
            except OSError:
                pass  # no flock here: the run itself judges the recorded pid


def sagemaker_folder(variable: str) -> Path | None:
    """The folder SageMaker names in `variable` (SM_MODEL_DIR, SM_OUTPUT_DATA_DIR), only inside a SageMaker
    training job (whose container sets SM_TRAINING_ENV): the variable left over in a shell redirects nothing."""
    if "SM_TRAINING_ENV" not in os.environ or not os.environ.get(variable):
        return None
    return Path(os.environ[variable])


def _plain_name(name: str) -> bool:
    return name not in ("", ".", "..", RECORD, LOCK) and "/" not in name and "\0" not in name


def recorded(folder: Path) -> list[str]:
    """The names runs of ours recorded writing in `folder` (none where it holds no record of ours)."""
    path = folder / RECORD
    try:
        if path.is_symlink() or not path.is_file():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    if not lines or lines[0] != RECORD_HEADER:
        return []
    return list(dict.fromkeys(name for name in lines[1:] if _plain_name(name)))


def _write_record(folder: Path, names: list[str]) -> None:
    staged = folder / f"{RECORD}.{os.getpid()}"
    staged.write_text("\n".join([RECORD_HEADER, *names]) + "\n", encoding="utf-8")
    os.replace(staged, folder / RECORD)  # replaces a link of that name, never writes through it


def record_written(folder: Path, *names: str) -> None:
    """Add `names`, children of `folder` that this run is about to write, to the folder's record (rank 0)."""
    known = recorded(folder)
    new = [name for name in dict.fromkeys(names) if name not in known]
    if new:
        assert all(_plain_name(name) for name in new), new
        _write_record(folder, known + new)


def checkpoint_holding(path: Path) -> Path | None:
    """The checkpoint that `path` is or lies inside (a step-… or .tmp-step-… folder, or one holding DCP's
    .metadata), or None."""
    path = path.expanduser().resolve()
    for folder in (path, *path.parents):
        if CHECKPOINT_NAME.match(folder.name.removeprefix(".tmp-")) or (folder / ".metadata").is_file():
            return folder
    return None


def _unrecorded(output_dir: Path, checkpoint_root: Path) -> list[Path]:
    """What overwrite=true would have to write over without any run having recorded writing it."""
    found = []
    for folder, belongs in ((output_dir, RUN_OUTPUTS.__contains__), (checkpoint_root, CHECKPOINT_NAME.match)):
        if folder.is_dir():
            ours = set(recorded(folder))
            found += sorted(p for p in folder.iterdir() if belongs(p.name) and p.name not in ours)
    return list(dict.fromkeys(found))


def check_run_folders(output_dir: Path, checkpoint_root: Path, overwrite: bool) -> None:
    """What setup and --check refuse about the folders before anything is written: a folder inside a checkpoint
    (it would break that checkpoint, and resume would skip it and delete the run's files with it), and under
    overwrite=true, outputs of a run's names that no run recorded writing."""
    for key, folder in (("output_dir", output_dir), ("checkpoint_dir", checkpoint_root)):
        inside = checkpoint_holding(folder)
        if inside is not None:
            raise UserError(
                f"{key}={str(folder)!r} lies inside the checkpoint {inside}; a run writing there would break it "
                "(resume skips a checkpoint with files it does not list, then deletes it): choose a folder outside it"
            )
    if overwrite:
        foreign = _unrecorded(output_dir, checkpoint_root)
        if foreign:
            raise UserError(
                f"overwrite=true: {', '.join(map(str, foreign))} {'was' if len(foreign) == 1 else 'were'} not "
                "written by a run of ours (not in the folder's record), so the run will not delete or write over "
                "them: move them, or choose another output_dir"
            )


def replace_previous_run(output_dir: Path, checkpoint_root: Path) -> None:
    """overwrite=true: delete what previous runs recorded writing in `output_dir` and in the checkpoint folder,
    and say so. Nothing else is touched (check_run_folders has refused names a run writes that are not ours)."""
    check_run_folders(output_dir, checkpoint_root, overwrite=True)
    removed, steps = [], 0
    folders = [output_dir] + ([checkpoint_root] if checkpoint_root.resolve() != output_dir.resolve() else [])
    for folder in folders:
        kept = []
        for name in recorded(folder):
            target = folder / name
            if target.is_symlink():  # a run writes no links: someone put it there
                log.warning("overwrite=true: %s is a symbolic link, which no run writes; left alone", target)
                kept.append(name)
                continue
            if not target.exists():
                continue
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            if CHECKPOINT_NAME.match(name):
                steps += 1
            else:
                removed.append(name)
        if (folder / RECORD).is_file():
            _write_record(folder, kept)
    if steps:
        removed.append(f"{steps} checkpoint(s) in {checkpoint_root}")
    if removed:
        log.info("overwrite=true: deleted the previous run's %s from %s", ", ".join(removed), output_dir)


# --- choose: the output folder and the checkpoint folder
RUNS_DIR = Path("runs")


def choose_output_dir(requested: str | None, recipe: str, overwrite: bool, continuing: bool = False) -> Path:
    """The run folder: the requested one (refused if it already holds files, unless overwrite or `continuing` a
    run from its checkpoint) or a new one."""
    if requested is None and sagemaker_folder("SM_OUTPUT_DATA_DIR"):  # a SageMaker job: output.tar.gz in S3
        return sagemaker_folder("SM_OUTPUT_DATA_DIR")
    if requested is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = RUNS_DIR / f"{recipe}-{stamp}"
        suffix = 1
        while path.exists():
            path = RUNS_DIR / f"{recipe}-{stamp}-{suffix}"
            suffix += 1
        return path
    path = Path(requested).expanduser()
    if path.exists() and not path.is_dir():
        raise UserError(f"output_dir={requested!r} is a file, not a folder")
    if path.is_dir() and any(p.name != LOCK for p in path.iterdir()) and not (overwrite or continuing):
        raise UserError(
            f"output_dir={requested!r} already holds files (a previous run?); choose another folder "
            "or pass overwrite=true to write into it"
        )
    return path


def check_writable(path: Path, key: str) -> None:
    """`path`, a folder that may not exist yet, can be created and written; else a one-line error naming `key`.
    A probe file in the nearest existing folder finds read-only mounts too (root ignores permission bits)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{key}={str(path)!r}: {existing} is a file, not a folder")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as exc:
        raise UserError(f"{key}={str(path)!r} cannot be written ({exc.strerror}: {existing})") from None


SAGEMAKER_CHECKPOINTS = Path("/opt/ml/checkpoints")  # synced to S3 through the job's checkpoint URI


def checkpoint_root(checkpoint_dir: str | None, output_dir: Path) -> Path:
    """The checkpoint folder: `checkpoint_dir`, else in a SageMaker job its checkpoint folder, else checkpoints/
    in the output folder."""
    if checkpoint_dir:
        return Path(checkpoint_dir).expanduser()
    if "SM_TRAINING_ENV" in os.environ:  # a SageMaker training job
        return SAGEMAKER_CHECKPOINTS
    return output_dir / "checkpoints"


def effective_resume(*, checkpoint: CheckpointSection, output: OutputSection) -> str:
    """overwrite=true replaces the run in output_dir, so `auto` has nothing to continue, except in a torchrun
    restart: the first attempt did the replacing, and the restart continues the new run."""
    if checkpoint.resume == "auto" and output.overwrite and not restarted():
        return "none"
    return checkpoint.resume


def continuing_run(*, checkpoint: CheckpointSection, output: OutputSection) -> bool:
    """Whether this run continues one in its output folder (so the folder may already hold files)."""
    if effective_resume(checkpoint=checkpoint, output=output) == "none" or not output.output_dir:
        return False
    return bool(checkpoint_folders(checkpoint_root(checkpoint.checkpoint_dir, Path(output.output_dir).expanduser())))


def checkpoint_folders(root: Path) -> list[Path]:
    """The `step-…` folders under `root`, newest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if CHECKPOINT_NAME.match(p.name)), reverse=True)


# --- claim: choose, lock and check at the start; the first files once every input is accepted
def claim_run_folders(
    layout, *, recipe: str, checkpoint: CheckpointSection, output: OutputSection
) -> tuple[Path, Path, RunLock]:
    """The output folder and checkpoint folder, chosen by rank 0 and locked by it for the run (a second run into
    them stops here), then checked (not inside a checkpoint; overwrite=true replaces only what runs recorded).
    `recipe` names a new folder (runs/<recipe>-<time>). Nothing is written yet. A refusal gives the folders back
    before it is raised."""

    def choose() -> str:
        continuing = continuing_run(checkpoint=checkpoint, output=output)
        return str(choose_output_dir(output.output_dir, recipe, output.overwrite, continuing))

    output_dir = Path(rank0_decides(layout, choose))
    root = checkpoint_root(checkpoint.checkpoint_dir, output_dir)
    lock = RunLock(run_folders(output_dir, root))
    try:
        rank0_decides(layout, lock.acquire)
        replacing = output.overwrite and not restarted()
        rank0_decides(layout, lambda: check_run_folders(output_dir, root, replacing))
    except BaseException:
        lock.release()
        raise
    return output_dir, root, lock


def open_run_folder(
    output_dir: Path, root: Path, *, settings: dict, overwrite: bool, deepspeed_config: dict | None, task: Task
) -> None:
    """Rank 0, once every input is accepted (a failed start leaves nothing): overwrite=true's replacement of the
    previous run, then config.yaml (`settings`: the run's keys, flat, as Config.to_dict gives them, less those
    its task never reads: `written_settings`), labels.json (what the head's ids mean, beside the outputs; not for
    sft and dpo, which have no labels) and deepspeed_config.json, each put on the folder's record just before it
    is written (a killed run's are on record; what this run does not write stays off it)."""
    if overwrite and not restarted():
        replace_previous_run(output_dir, root)
    output_dir.mkdir(parents=True, exist_ok=True)
    record_written(output_dir, "config.yaml")
    write_yaml(output_dir / "config.yaml", written_settings(settings))
    if task.has_labels:
        record_written(output_dir, LABEL_FILE)
        write_label_file(output_dir, task)
    if deepspeed_config is not None:
        record_written(output_dir, "deepspeed_config.json")
        write_json(output_dir / "deepspeed_config.json", deepspeed_config)


# Keys a task never reads, left out of what its run writes as its settings (config.yaml in the run folder and in
# each checkpoint, the trackers' parameters), so that they say what the run did: sft and dpo read no GLUE task,
# whatever glue_task's default. A continued run compares only the keys its checkpoint holds.
UNREAD_KEYS = {SFT: ("glue_task",), DPO: ("glue_task",), REWARD: ("glue_task",)}


def written_settings(settings: dict) -> dict:
    """The run's settings (flat keys) as its files write them: without the keys its task never reads."""
    unread = UNREAD_KEYS.get(settings.get("task"), ())
    return {key: value for key, value in settings.items() if key not in unread}


def write_yaml(path: Path, data: dict) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# --- stage: an export written beside its place, then moved in whole
def check_export_target(out: Path) -> None:
    """An export never goes into a checkpoint: resume would skip that checkpoint (files its manifest does not
    list) and delete it, the export with it."""
    inside = checkpoint_holding(out)
    if inside is not None:
        raise UserError(f"not exporting to {out}: it lies inside the checkpoint {inside}; choose a folder outside it")


def _remove_stale_staging(out: Path) -> None:
    """Staging folders of ours that a killed export left for `out`: exact name, our marker, and a writer that no
    longer runs on this host. Anything else is left alone."""
    places = [(out.parent, f".{out.name}{STAGING}")] + ([(out, STAGING)] if not out.is_symlink() else [])
    for folder in [
        p for place, prefix in places if place.is_dir() for p in place.iterdir() if p.name.startswith(prefix)
    ]:
        writer = read_holder(folder / STAGING_MARKER)
        pid = folder.name.rsplit(STAGING, 1)[1]
        if folder.is_symlink() or not folder.is_dir() or str(writer.get("pid")) != pid:
            continue
        if writer.get("host") == socket.gethostname() and not process_alive(pid):
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
        (staging / STAGING_MARKER).write_text(json.dumps(holder_of_this_process()))
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
