"""What a run shows: Reporter (the loggers of loggers.py), phase timer, the step and throughput lines (summary.json
itself: summary.py; the run folder and what is written there: runfolder.py)."""

from __future__ import annotations

import contextlib
import platform
import time
from importlib import metadata
from pathlib import Path

from .loggers import JsonlLogger, MetricLogger, ProgressLogger, StartStopped, make_loggers


class PhaseTimer:
    """Wall seconds per phase (setup, data, model, train, eval, export) for summary.json."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def package_versions() -> dict[str, str]:
    names = (
        "parallel-finetune",
        "torch",
        "transformers",
        "datasets",
        "tokenizers",
        "evaluate",
        "accelerate",
        "deepspeed",
    )
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


class Reporter:
    """Rank 0's view of training: the progress bar and its lines, the run folder's metrics.jsonl/eval.jsonl and
    the trackers `report_to` names (loggers.py), each given every train record and evaluation. Other ranks get a
    Reporter with no loggers: each event is one line, printed once, whatever the number of ranks. Rank 0's
    values are the run's: the step's loss and norm are reduced over every rank (a pipeline's last stage holds the
    loss) and an evaluation's figures are handed to every stage, so rank 0 prints what one process would."""

    def __init__(self, output_dir: Path, total_steps: int, log_every: int, enabled: bool, resumed_at: int = 0):
        self.output_dir, self.resumed_at = output_dir, resumed_at
        self.loggers: list[MetricLogger] = []
        self.closed = False
        self.started = True  # False: SIGTERM arrived while rank 0 started the trackers (the run stops)
        if enabled:
            self.loggers += [
                ProgressLogger(total_steps, log_every, resumed_at, format_step),
                JsonlLogger(output_dir, resumed_at),
            ]

    def add_trackers(self, names: tuple[str, ...], run_name: str | None, params: dict, timeout_s: float = 30.0) -> bool:
        """Rank 0: start the trackers `report_to` names, MLflow's and W&B's within `timeout_s` (a UserError if one
        cannot start; the trainer hands it to every rank through rank0_decides). False where SIGTERM arrived
        meanwhile: the start was abandoned, and the run stops before its first step."""
        run_name = run_name or self.output_dir.name
        try:
            self.loggers += make_loggers(names, self.output_dir, run_name, params, self.resumed_at, timeout_s)
        except StartStopped:
            return False
        return True

    def step(self, record: dict) -> None:
        for logger in self.loggers:
            logger.log_train(record)

    def evaluation(self, step: int, results: dict) -> None:
        for logger in self.loggers:
            logger.log_eval(step, results)

    def generations(self, step: int, generations: list[dict]) -> None:
        for logger in self.loggers:
            logger.log_generations(step, generations)

    def close(self, status: str = "finished") -> None:
        """Once: finished, stopped (SIGTERM) or failed, which trackers record as the run's status. The bar closes
        first, so what follows (an error) gets a line of its own."""
        if self.closed:
            return
        self.closed = True
        problem = None
        for logger in self.loggers:  # every logger gets closed, even after one failed to
            try:
                logger.close(status)
            except Exception as exc:
                problem = problem or exc
        if problem is not None and status != "failed":  # when failing already, the first error is the one to see
            raise problem


def format_step(record: dict, total_steps: int) -> str:
    norm = "-" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"
    line = (
        f"step {record['step']}/{total_steps} | epoch {record['epoch']:.2f} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.2e} | grad_norm {norm} | loss_scale {record['loss_scale']:g} | "
        f"{record['samples_per_s']:.1f} samples/s | {record['tokens_per_s']:.0f} tokens/s | "
        f"{record['tflops_per_device']:.3g} TFLOP/s | MFU {percent(record['mfu'])}"
    )
    if "rewards/accuracies" in record:  # task=dpo: how the step's pairs are preferred (every pair metric: trackers)
        accuracies, margins = record["rewards/accuracies"], record["rewards/margins"]
        line += f" | rewards/accuracies {accuracies:.3f} | rewards/margins {margins:.4f}"
    if "kl" in record:  # task=kto: the step's KL estimate and margin (every metric: metrics.jsonl, trackers)
        line += f" | kl {record['kl']:.4f} | rewards/margins {record.get('rewards/margins', float('nan')):.4f}"
    if "mean_reward" in record:  # task=reward: how the step's pairs are scored (min/max_reward: metrics.jsonl)
        line += f" | accuracy {record['accuracy']:.3f} | margin {record['margin']:.4f}"
    return line + (" | SKIPPED (non-finite gradients)" if record["skipped"] else "")


def percent(mfu: float | None) -> str:
    return "unknown" if mfu is None else f"{mfu:.1%}"


def format_throughput(summary: dict) -> str:
    """The run's mean throughput, MFU (or why it is unknown) and, on a CPU, the achievable matmul rate beside it."""
    if summary["mfu"] is None:
        mfu = f"MFU unknown ({summary['mfu_unknown']})"
    else:
        mfu = f"MFU {percent(summary['mfu'])} of {summary['peak_tflops_per_device']:.3g} TFLOP/s"
    achievable = summary.get("achievable_matmul_tflops")
    return (
        f"throughput: {summary['train_samples_per_s']:.1f} samples/s, {summary['train_tokens_per_s']:.0f} tokens/s, "
        f"{summary['train_tflops_per_device']:.3g} TFLOP/s per device, {mfu}"
        + (f" | achievable matmul rate {achievable:.3g} TFLOP/s" if achievable is not None else "")
    )
