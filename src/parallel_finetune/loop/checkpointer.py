"""When a run writes a checkpoint, and which it keeps: the cadence around checkpoint.py's save.

A checkpoint is written every `checkpoint_every` steps, at the last step, and after the step at which a rank was
asked to stop (SIGTERM); never by an engine whose updates cannot be checkpointed (DeepSpeed), and never of weights
that just gave a NaN/inf loss or gradient norm. After each one, rank 0 keeps the newest `keep_checkpoints` that
runs recorded writing in the checkpoint folder and deletes the older ones (a step folder on no record is someone
else's and stays). The folder itself is chosen with the run folder (runfolder.checkpoint_root: `checkpoint_dir`,
SageMaker's checkpoint folder in a job, or checkpoints/ in the output folder).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ..config import CheckpointSection, OutputSection
from ..outputs import checkpoint
from ..outputs.checkpoint import TrainingState
from ..outputs.reporting import PhaseTimer
from ..outputs.runfolder import checkpoint_folders, recorded

log = logging.getLogger(__name__)


class CheckpointManager:
    """A run's checkpoints: `resume` restores the newest one the run continues, `due` says whether this step
    ends with a checkpoint, `save` writes it (every rank calls them, with the same arguments) and removes the ones
    beyond `keep`. `state(step)` is what a checkpoint of `step` holds (the builder makes it)."""

    def __init__(
        self,
        root: Path,
        *,
        checkpoint: CheckpointSection,
        enabled: bool,
        timer: PhaseTimer,
        state: Callable[[int], TrainingState],
    ):
        self.root = root  # the checkpoint folder
        self.every = checkpoint.checkpoint_every  # None: a checkpoint at the end (or stop) only
        self.keep = checkpoint.keep_checkpoints
        self.resuming = checkpoint  # resume: which checkpoint a run continues
        self.enabled = enabled  # the updates can be checkpointed
        self.timer = timer  # the run's: writing checkpoints is its own phase in summary.json
        self.state = state
        self.resumed_from: Path | None = None

    def resume(self, *, output: OutputSection) -> int:
        """Restore the model, its updates and schedule from the checkpoint this run continues (checkpoint.resume:
        verified and loaded by all ranks together), if there is one; the step it reached, else 0."""
        if not self.enabled:
            return 0
        started, state = time.perf_counter(), self.state(0)
        self.resumed_from = checkpoint.resume(state, self.root, checkpoint=self.resuming, output=output)
        if self.resumed_from is None:
            return 0
        self.timer.seconds["resume"] = time.perf_counter() - started
        return state.step

    def due(self, step: int, total_steps: int, stopping: bool) -> bool:
        """Whether the step just taken ends with a checkpoint: every `every` steps, the last, or a stop."""
        if not self.enabled:
            return False
        return stopping or step >= total_steps or bool(self.every and step % self.every == 0)

    def save(self, step: int, nonfinite_steps: list[int]) -> Path | None:
        """The checkpoint of `step`, or None: not written while `nonfinite_steps` (the divergence
        guard's current run of non-finite steps) holds any, or after a failure checkpoint.save warned about."""
        if nonfinite_steps:  # weights that just gave a NaN/inf loss or gradient are not worth resuming
            log.warning(
                "checkpoint at step %d not written: the loss or gradient norm of step %d was not finite",
                step,
                nonfinite_steps[-1],
            )
            return None
        with self.timer("checkpoint"):
            written = self.state(step)
            folder = checkpoint.save(written, self.root)
            if folder is not None and written.layout.is_main:
                self.remove_old()
        return folder

    def remove_old(self) -> None:
        """Rank 0: delete the recorded checkpoints beyond the newest `keep` (overwrite=true and this rotation
        delete only what runs recorded writing)."""
        ours = set(recorded(self.root))
        for old in [folder for folder in checkpoint_folders(self.root) if folder.name in ours][self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
