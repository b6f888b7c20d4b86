"""Sharded checkpoints with exact resume, readable under any layout.

A checkpoint is a folder `step-00000010/` in the checkpoint folder:
- the model's state dict and AdamW's moments, written by `torch.distributed.checkpoint` (DCP) from every rank's
  shards. Keys are the unsplit model's parameter names and the moments are shaped like their parameters, so a
  checkpoint written under one layout (TP=2, FSDP, ZeRO-1, ...) loads under another: DCP reshards on load;
- `config.yaml` and `tokenizer/` (rank 0), so `scripts/export_hf.py` needs nothing else;
- `trainer_state.json` (rank 0): step, AdamW's step count, LR scheduler, loss scaler, the model's parameter
  shapes, which identify the model it belongs to, and the data's fingerprint (data.Source), which identifies the
  rows it was trained on;
- `rng/rank<N>.pt` (every rank): the torch RNG states that dropout draws from. The data order needs none: batches
  are a function of the seed and the step.

- `rollout.json` (rank 0, task=grpo with num_iterations > 1, a checkpoint taken between a rollout's iterations):
  the rollout the next steps train on again (its completions, advantages, old and reference log-probabilities,
  metrics: rl/steps.py `kept_state`), so the resumed run trains on it as the uninterrupted one does. At a
  rollout boundary there is none: the sampling needs no generator state (its draws are a function of the seed and
  the step).

- with peft=lora only the trainable parameters (adapters, head) and their moments; `trainer_state.json` names the
  frozen base (`lora.base`) that a resumed run loads again from its source.

- `manifest.json` (rank 0, last): the size and sha256 of every other file (see integrity.py).

It is written to `.tmp-step-…/` and renamed when every rank has finished, so a folder named `step-…` is
complete (when to write one, and keeping the newest `keep_checkpoints`: checkpointer.py). Only finite weights and
moments are written; a Ctrl-C while writing removes the partial folder and stops the run. Loading verifies the
manifest first (every rank hashing a share of the files), every field of `trainer_state.json`, and reads DCP's
`.metadata` with an unpickler that admits only DCP's metadata classes; the rest is JSON, YAML and
`torch.load(weights_only=True)` for the tensors and RNG states (a pickle asking for more is refused in one line
naming its file), so nothing in a checkpoint can run code; loaded tensors holding NaN/inf are refused too. Under
resume=auto a checkpoint failing any of this is skipped for the one before.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from ..config import CONTINUATION_MAY_CHANGE, USER_KEYS, CheckpointSection, DataSection, OutputSection
from ..errors import UserError, one_line
from ..tasks import data_fingerprint, write_label_file
from . import integrity
from .run_files import CHECKPOINT_NAME as NAME
from .run_files import CONFIG_FILE, ROLLOUT_FILE, STATE_FILE
from .runfolder import checkpoint_folders, effective_resume, record_written, written_settings

log = logging.getLogger(__name__)


def _complete(folder: Path) -> str | None:
    """Why `folder` is not a usable checkpoint by a cheap look (no hashing), or None."""
    if not (folder / ".metadata").is_file():
        return "no DCP .metadata"
    try:
        state = json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} unreadable ({type(exc).__name__})"
    return _state_problem(folder, state)


def _whole(value, low: int = 0, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _state_problem(folder: Path, state) -> str | None:
    """Why trainer_state.json's values cannot be restored, or None. They go back into the run (a negative step
    would train the wrong number of steps and name its checkpoints step--…), so each is checked for its type and
    range, the step also against the folder's name and the scheduler's position."""

    def field(path: str):
        value = state
        for key in path.split("."):
            value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
        return value

    step, named = field("step"), NAME.match(folder.name)
    if not isinstance(state, dict):
        return f"{STATE_FILE} is not a JSON object"
    if not _whole(step, 1):
        return f"{STATE_FILE}: step is {_shown(step)}, expected a whole number from 1"
    if named and int(named[1]) != step:
        return f"{STATE_FILE}: step is {step}, but the folder is {folder.name}"
    shapes, lora, lrs = field("parameter_shapes"), field("lora"), field("scheduler._last_lr")
    rules = [
        ("adam_step", _whole(field("adam_step"), 0, step), f"a whole number from 0 to the step ({step})"),
        ("loss_scaler.scale", _number(field("loss_scaler.scale")) and field("loss_scaler.scale") > 0, "above 0"),
        ("loss_scaler.clean_steps", _whole(field("loss_scaler.clean_steps")), "a whole number from 0"),
        ("scheduler.last_epoch", field("scheduler.last_epoch") == step, f"the step ({step})"),
        ("scheduler._step_count", _whole(field("scheduler._step_count"), 1), "a whole number from 1"),
        ("scheduler._last_lr", isinstance(lrs, list) and lrs and all(_number(x) and x >= 0 for x in lrs), "lrs >= 0"),
        ("family", isinstance(field("family"), str), "a family name"),
        ("task", isinstance(field("task"), str), "a task name"),
        ("layout", isinstance(field("layout"), dict), "a mapping"),
        (
            "parameter_shapes",
            isinstance(shapes, dict) and all(isinstance(s, list) and all(map(_whole, s)) for s in shapes.values()),
            "a mapping of parameter names to lists of sizes",
        ),
        ("lora", lora is _MISSING or (isinstance(lora, dict) and isinstance(lora.get("base"), str)), "a mapping"),
        ("data", field("data") in (_MISSING, None) or isinstance(field("data"), str), "a data fingerprint"),
    ]
    for path, valid, expected in rules:
        if not valid:
            return f"{STATE_FILE}: {path} is {_shown(field(path))}, expected {expected}"
    return None


_MISSING = object()


def _shown(value) -> str:
    return "missing" if value is _MISSING else json.dumps(value)[:60]


def _pick(
    resume: str,
    root: Path,
    problem_of: Callable[[Path], str | None],
    label: str = "resume",
    warn: Callable = log.warning,
) -> Path | None:
    """`resume` as a verified checkpoint folder. auto (or a folder of checkpoints): the newest one that verifies,
    saying which were skipped and why; a step-… folder: that one, or a one-line error."""
    if resume == "none":
        return None
    named = f"resume={resume!r}" if label == "resume" else f"{label} {resume!r}"
    if resume == "auto":
        folders, explicit = checkpoint_folders(root), False
    else:
        path = Path(resume).expanduser()
        if not path.is_dir():
            valid = "auto, none, or a step-… folder" if label == "resume" else "a step-… folder, or a folder of them"
            raise UserError(f"{named}: no such checkpoint folder (valid: {valid})")
        explicit = NAME.match(path.name) is not None or not checkpoint_folders(path)
        folders = [path] if explicit else checkpoint_folders(path)
    problems = []
    for folder in folders:
        problem = problem_of(folder)
        if problem is None:
            return folder
        if explicit:
            raise UserError(f"{named} is not a usable checkpoint: {problem}")
        warn("skipping checkpoint %s: %s; trying the one before", folder, problem)
        problems.append(f"{folder.name}: {problem}")
    if problems:
        raise UserError(
            f"no checkpoint in {folders[0].parent} verifies ({'; '.join(problems)}); resume=none starts fresh"
        )
    return None


def resolve_resume(resume: str, root: Path, label: str = "resume") -> Path | None:
    """`resume` as a checkpoint folder, verified in this one process (preflight, export_hf.py)."""
    return _pick(resume, root, lambda folder: _complete(folder) or integrity.verify(folder), label)


def _agreed(mine: str | None, layout) -> str | None:
    """The first rank's problem, or None: every rank gets the same answer."""
    everyone: list = [None] * layout.world_size
    dist.all_gather_object(everyone, mine)
    return next((problem for problem in everyone if problem), None)


def resume(state: TrainingState, root: Path, *, checkpoint: CheckpointSection, output: OutputSection) -> Path | None:
    """Restore `state` (its `step` too) from the checkpoint its run continues (`resume`, unless overwrite=true
    replaces the run: runfolder.effective_resume) and return that folder, or None for a fresh start; every rank
    calls this. Each candidate is verified by all ranks together (each hashes a share of
    the files), then loaded; both answers are agreed, so under resume=auto a checkpoint that fails either (a bad
    manifest or trainer_state.json, a pickle in its tensor or RNG files, NaN/inf in its tensors) is skipped for
    the one before on every rank, and a refusal (another model, other settings or data) is the same UserError
    everywhere."""
    layout = state.layout

    def problem_of(folder: Path) -> str | None:
        problem = _agreed(_complete(folder) or integrity.verify(folder, (layout.rank, layout.world_size)), layout)
        if problem is None:
            try:
                state.step = load(state, folder)
            except integrity.Refused as exc:  # agreed in load
                return str(exc)
        return problem

    resuming = effective_resume(checkpoint=checkpoint, output=output)
    return _pick(resuming, root, problem_of, warn=log.warning if layout.is_main else log.debug)


def check_resume(
    root: Path,
    *,
    settings: dict,
    checkpoint: CheckpointSection,
    output: OutputSection,
    data: DataSection,
    seed: int,
) -> None:
    """For --check: the checkpoint the run would continue from is complete, intact in structure (the sizes and
    metadata; hashing is the run's job, spread over its ranks) and of compatible settings (`settings`: the run's
    keys, flat, as Config.to_dict gives them) and data (a data_dir's files, fingerprinted from `data` and `seed`;
    the Hub's rows are fingerprinted once the run loads them)."""

    def problem_of(folder: Path) -> str | None:
        return _complete(folder) or integrity.verify(folder, contents=False)

    folder = _pick(effective_resume(checkpoint=checkpoint, output=output), root, problem_of)
    if folder is not None:
        check_continuation(folder, settings, data_fingerprint(data=data, seed=seed))


def check_continuation(folder: Path, settings: dict, data: str | None = None, tokens: str | None = None) -> None:
    """A run continues with the settings it was trained with (`settings`: the run's keys, flat, as config.yaml
    holds them), on the same data (`data`: its fingerprint, when known) made into the same token ids (`tokens`:
    the tokenizer's identity, its chat template's text included, when known); only its length, cadences, outputs
    and layout (CONTINUATION_MAY_CHANGE) may differ, or two runs' settings would mix in one trajectory."""
    try:
        before = yaml.safe_load((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        before = None
    if not isinstance(before, dict):
        raise UserError(f"checkpoint {folder}: {CONFIG_FILE} unreadable")
    changed = [
        key
        for key in USER_KEYS
        if key not in CONTINUATION_MAY_CHANGE and key in before and before[key] != settings[key]
    ]
    if changed:
        raise UserError(
            f"checkpoint {folder} was trained with other settings: "
            + ", ".join(f"{key} {before[key]!r} -> {settings[key]!r}" for key in changed)
            + "; a continued run may change only its length, cadences, outputs and layout: use the "
            "old values, or start fresh with resume=none (overwrite=true replaces the run) or "
            "another output_dir"
        )
    written = json.loads((folder / STATE_FILE).read_text())
    if tokens is not None and written.get("tokens") not in (None, tokens):  # None: written before they were kept
        template = settings.get("chat_template")
        edited = f" (chat_template={template!r}: its text changed since?)" if template else ""
        raise UserError(
            f"checkpoint {folder} was trained on other token ids: its tokenizer or chat template differs from this "
            f"run's{edited}; continue with the ones it was trained with, or start fresh with resume=none "
            "(overwrite=true replaces the run) or another output_dir"
        )
    if data is None:
        return
    recorded = written.get("data")
    if recorded is None:  # written before checkpoints recorded it
        log.warning("checkpoint %s does not record its data's fingerprint: cannot check it is this data", folder)
    elif recorded != data:
        data_dir = settings["data_dir"]
        changed = f" (data_dir={data_dir!r}: its files changed since)" if data_dir else ""
        raise UserError(
            f"checkpoint {folder} was trained on other data: its rows were {recorded}, this run's are {data}"
            f"{changed}; continue on the data it was trained on, or start fresh with resume=none (overwrite=true "
            "replaces the run) or another output_dir"
        )


@dataclass
class TrainingState:
    """What a checkpoint writes and restores, passed explicitly: the model and its updates (AdamW moments, step
    counts, loss scale: `updates.TorchUpdates`), the lr schedule; what identifies the run; the layout."""

    step: int
    model: torch.nn.Module
    updates: object
    scheduler: object
    settings: dict  # the run's keys, flat (Config.to_dict): config.yaml, and what a continuation must match
    tokenizer: object
    layout: object
    family: str
    parameter_shapes: dict[str, list[int]]  # of the unsplit model
    trainable: set[str] | None = None  # peft=lora: only these are written (the base is named, not copied)
    base: str | None = None  # peft=lora: the frozen base model the adapters belong to
    data: str | None = None  # the training data's fingerprint (data.Source): a continuation must train on the same
    task: object = None  # the data's tasks.Task: labels.json, so an export knows the head's labels
    tokens: str | None = None  # data.tokenizer_identity (tokenizer, chat template): a continuation must match it
    # task=grpo's step source (rl/steps.RolloutStage): its kept rollout goes into ROLLOUT_FILE and back
    # (kept_state(step), inside_rollout(step), kept_problem(written, step), restore_kept(written))
    step_source: object = None

    def model_state(self) -> dict:
        state = self.model.state_dict()
        if self.trainable is None:
            return state
        return {name: tensor for name, tensor in state.items() if name in self.trainable}


def save(state: TrainingState, root: Path) -> Path | None:
    """Write a checkpoint of `state`; every rank calls this. A failure (full disk, a read-only folder, non-finite
    weights) is a warning: the previous checkpoints stay as they were, and training goes on. A Ctrl-C (on any
    rank) is no failure to train past: the partial folder is removed and KeyboardInterrupt raised on every rank."""
    layout = state.layout
    final = root / f"step-{state.step:08d}"
    partial = root / f".tmp-step-{state.step:08d}"
    stages = AgreedStages(layout, partial, root)
    tensors: dict = {}
    hashed: dict[str, dict] = {}  # this rank's files -> manifest entries
    try:
        done = (
            stages.run(gather_finite_tensors, state, tensors)
            and stages.run(make_partial_folder, partial, everywhere=False)
            and stages.run(write_rng, layout, partial)
            and stages.run(write_shards, tensors, partial)
            and stages.run(hash_own_files, partial, layout.rank, hashed)
        )
        if done:
            everyone: list = [None] * layout.world_size
            dist.all_gather_object(everyone, hashed)
            done = stages.run(finish, state, tensors, everyone, partial, final, everywhere=False)
    except KeyboardInterrupt:
        if layout.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if not done:
        if layout.is_main:
            shutil.rmtree(partial, ignore_errors=True)
        log.warning("checkpoint at step %d not written (%s); the previous ones are untouched", state.step, stages.error)
        return None
    log.info("checkpoint %s", final)
    return final


class AgreedStages:
    """A checkpoint written in stages whose outcome every rank agrees on after each one, so that no rank enters the
    next collective alone: after a failure on any rank the rest are skipped everywhere, and a Ctrl-C on any rank
    is a KeyboardInterrupt on all."""

    def __init__(self, layout, partial: Path, root: Path):
        self.layout, self.partial, self.root = layout, partial, root
        self.error: str | None = None  # this rank's first failure, or "another rank failed"
        self.interrupted = False  # that failure was a Ctrl-C

    def run(self, action: Callable, *args, everywhere: bool = True) -> bool:
        """Run `action(*args)` (on every rank, or rank 0 only) unless a stage failed; True while none has."""
        if self.error is None and (everywhere or self.layout.is_main):
            try:
                action(*args)
            # OSError, or DCP's CheckpointException (a BaseException, raised on every rank) wrapping one; a Ctrl-C,
            # raised as it is or wrapped by DCP, is agreed below like a failure
            except (Exception, CheckpointException, KeyboardInterrupt) as exc:
                self.interrupted = _interrupted(exc)
                self.error = describe_failure(exc, self.partial if self.partial.exists() else self.root)
        failed = self.error is not None
        flags = torch.tensor([1.0 if failed else 0.0, 1.0 if self.interrupted else 0.0], device=self.layout.device)
        dist.all_reduce(flags)
        if flags[1].item():
            raise KeyboardInterrupt
        if flags[0].item() and not failed:
            self.error = "another rank failed"
        return self.error is None


def gather_finite_tensors(state: TrainingState, into: dict) -> None:
    """The model's and the moments' tensors (this rank's shards) into `into`, refused if any holds NaN or inf."""
    into.update(model=state.model_state(), optimizer=state.updates.moment_tensors())
    bad = integrity.nonfinite(into)
    if bad:  # a diverged run's weights are worth nothing, and resuming from them would only diverge again
        raise ValueError(f"{bad} holds NaN or inf")


def make_partial_folder(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "rng").mkdir(parents=True)


def write_rng(layout, partial: Path) -> None:
    cuda = torch.cuda.get_rng_state() if layout.device.type == "cuda" else torch.zeros(0, dtype=torch.uint8)
    torch.save({"cpu": torch.get_rng_state(), "cuda": cuda}, partial / "rng" / f"rank{layout.rank}.pt")


def write_shards(tensors: dict, partial: Path) -> None:
    dcp.save(tensors, checkpoint_id=partial)


def hash_own_files(partial: Path, rank: int, into: dict) -> None:
    """Every rank hashes what it wrote (DCP names a rank's shards __<rank>_…) into `into`: name -> manifest entry."""
    mine = [f"rng/rank{rank}.pt", *(p.name for p in partial.glob(f"__{rank}_*.distcp"))]
    into.update(integrity.describe(partial, mine))


def trainer_state(state: TrainingState, tensors: dict) -> dict:
    """trainer_state.json: what resume restores besides the tensors, and what identifies the run."""
    written = {
        "step": state.step,
        **state.updates.counters(),
        "scheduler": state.scheduler.state_dict(),
        "family": state.family,
        "task": state.settings["task"],
        "layout": state.layout.describe(),
        "parameter_shapes": state.parameter_shapes,
        "data": state.data,
        "tokens": state.tokens,
    }
    if state.trainable is not None:  # LoRA: the adapters and head only; the base is read from its source
        written["lora"] = {"base": state.base, "written": sorted(tensors["model"])}
    return written


def finish(state: TrainingState, tensors: dict, everyone: list[dict], partial: Path, final: Path) -> None:
    """Rank 0, once every rank wrote and hashed its files: what an export needs without the data (the run's
    configuration and tokenizer, labels.json), trainer_state.json, the manifest (last), then the rename."""
    (partial / CONFIG_FILE).write_text(yaml.safe_dump(written_settings(state.settings), sort_keys=False))
    state.tokenizer.save_pretrained(partial / "tokenizer")
    if state.task is not None and state.task.has_labels:
        write_label_file(partial, state.task)
    (partial / STATE_FILE).write_text(json.dumps(trainer_state(state, tensors), indent=1))
    kept = state.step_source.kept_state(state.step) if state.step_source is not None else None
    if kept is not None:  # in the manifest below, like every file: verified before it is read
        (partial / ROLLOUT_FILE).write_text(json.dumps(kept, separators=(",", ":")))
    entries = {name: entry for part in everyone for name, entry in part.items()}
    entries.update(integrity.describe(partial, [n for n in integrity.files_in(partial) if n not in entries]))
    integrity.write_manifest(partial, entries)
    record_written(final.parent, final.name)  # overwrite=true and the rotation (checkpointer.py) delete only these
    replace_folder(partial, final)  # atomic: a folder named step-… is complete


def _failures(exc: BaseException) -> list[BaseException]:
    """`exc`, or the rank's errors DCP wrapped in it as (exception, stack) in `failures`."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
    return [exc]


def _interrupted(exc: BaseException) -> bool:
    return any(isinstance(failure, KeyboardInterrupt) for failure in _failures(exc))


def describe_failure(exc: BaseException, folder: Path | None) -> str:
    """One short line."""
    return one_line(_failures(exc)[0], folder)


def read_tensors(target: dict, folder: Path) -> None:
    """dcp.load into `target` in place, resharding from the writer's layout, through integrity.SafeReader. Its
    refusals and any other failure to read are an integrity.Refused (one line, the same on every rank), not the
    wrapped traceback DCP raises; a Ctrl-C stays a KeyboardInterrupt."""
    try:
        with warnings.catch_warnings():  # export_hf.py loads in one process, as meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(target, storage_reader=integrity.SafeReader(folder))
    except CheckpointException as exc:
        if _interrupted(exc):
            raise KeyboardInterrupt from None
        failure = _failures(exc)[0]
        if isinstance(failure, integrity.Refused):
            raise integrity.Refused(str(failure)) from None
        raise integrity.Refused(f"reading its tensors failed ({describe_failure(failure, None)})") from None


def replace_folder(new: Path, final: Path) -> None:
    """Rename `new` to `final`; an existing `final` (the same step written before, e.g. after resuming from an
    older checkpoint of this folder) is replaced, not left to fail the rename with "Directory not empty"."""
    if final.exists():
        old = final.with_name(f".replaced-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(new, final)
        shutil.rmtree(old, ignore_errors=True)
        log.info("replaced the earlier %s", final)
        return
    os.replace(new, final)


def check_same_model(folder: Path, state: dict, family: str, task_key: str, shapes: dict[str, list[int]]) -> None:
    """The checkpoint's family and recipe `task:` key (trainer_state.json's "task") and parameter shapes are this
    run's."""
    if (state.get("family"), state.get("task")) != (family, task_key):
        raise UserError(
            f"checkpoint {folder} is a {state.get('family')} {state.get('task')} model, this run a "
            f"{family} {task_key} one; resume=none starts fresh"
        )
    theirs = state.get("parameter_shapes", {})
    differences = sorted(set(theirs) ^ set(shapes)) or [n for n in shapes if theirs[n] != shapes[n]]
    if differences:
        name = differences[0]
        raise UserError(
            f"checkpoint {folder} holds another model: parameter {name!r} is "
            f"{theirs.get(name, 'absent')} there, {shapes.get(name, 'absent')} here "
            f"({len(differences)} differences); resume=none starts fresh"
        )


def read_kept(source, folder: Path, step: int) -> tuple[dict | None, str | None]:
    """The rollout a checkpoint of `step` kept for `source` (a grpo run's step source; None: no step source), and
    why it cannot be trained on again (or None). A checkpoint taken between a rollout's iterations without one
    (written before checkpoints kept it) resumes with a new rollout, as it did then, and says so."""
    path = folder / ROLLOUT_FILE
    if source is None:
        return None, None
    if not path.is_file():
        if source.inside_rollout(step):
            log.warning(
                "checkpoint %s holds no %s (written before checkpoints kept the rollout): step %d samples a new "
                "rollout instead of training on step %d's again, so the run departs from the uninterrupted one",
                folder,
                ROLLOUT_FILE,
                step + 1,
                step,
            )
        return None, None
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{ROLLOUT_FILE} unreadable ({type(exc).__name__})"
    problem = source.kept_problem(kept, step)
    return (None, f"{ROLLOUT_FILE}: {problem}") if problem else (kept, None)


def load(state: TrainingState, folder: Path) -> int:
    """Restore `state`'s parts in place from `folder` (verified: `resume`), whatever layout wrote it; returns the
    step it was at. Another model, other settings or data: a UserError. A file that is no tensor or RNG state (a
    pickle asking for more), or a tensor holding NaN/inf: integrity.Refused, agreed by every rank before any of
    `state` but the tensors DCP loads is touched (a retry from another checkpoint overwrites those)."""
    written = json.loads((folder / STATE_FILE).read_text())
    check_same_model(folder, written, state.family, state.settings["task"], state.parameter_shapes)
    check_continuation(folder, state.settings, state.data, state.tokens)
    rng_name = f"rng/rank{state.layout.rank}.pt"
    rng, problem = None, None
    if (folder / rng_name).is_file():  # a different world size has other ranks: their dropout masks differ anyway
        try:
            rng = integrity.load_tensors(folder / rng_name, rng_name)
            if not (isinstance(rng, dict) and all(isinstance(rng.get(k), torch.Tensor) for k in ("cpu", "cuda"))):
                problem = f"{rng_name} holds no RNG state"
        except integrity.Refused as exc:
            problem = str(exc)
    kept, kept_problem = read_kept(state.step_source, folder, written["step"])
    moments = state.updates.moment_tensors()  # placeholders with this layout's shapes and placements
    target = {"model": state.model_state(), "optimizer": moments}
    read_tensors(target, folder)  # its failures are every rank's
    # NaN behind a matching manifest (written in, and the manifest made again): said here, not blamed on the lr
    bad = integrity.nonfinite(target)
    problem = _agreed(problem or kept_problem or (bad and f"{bad} holds NaN or inf"), state.layout)
    if problem:
        raise integrity.Refused(problem)
    if state.step_source is not None:
        state.step_source.restore_kept(kept)
    state.updates.restore(target["optimizer"], written)
    # Layouts group parameters differently (DTensor and plain tensors apart, ZeRO buckets), but every group
    # follows the same schedule: restore its position, not the writer's per-group lists.
    scheduler = state.scheduler
    saved, scheduler_state = written["scheduler"], scheduler.state_dict()
    groups = len(scheduler_state["base_lrs"])
    scheduler_state.update(
        last_epoch=saved["last_epoch"], _step_count=saved["_step_count"], _last_lr=[saved["_last_lr"][0]] * groups
    )
    scheduler.load_state_dict(scheduler_state)
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if state.layout.device.type == "cuda" and rng["cuda"].numel():
            torch.cuda.set_rng_state(rng["cuda"])
    log.info(
        "resumed from %s (step %d, written by %s)",
        folder,
        written["step"],
        ", ".join(
            f"{k}={v}"
            for k, v in written["layout"].items()
            if k in ("world_size", "data_parallel", "tensor_parallel", "sharding")
        ),
    )
    return written["step"]
