"""Where a run's metrics go: one `MetricLogger` per destination, chosen by `report_to`.

The run folder's record (metrics.jsonl, eval.jsonl) and the progress bar are always on; TensorBoard, MLflow and
Weights & Biases are what `report_to` picks, as `report_to` does in accelerate and the Hugging Face Trainer. Each
library's own environment variables keep their meaning because each library reads them itself:
MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME (unset: MLflow's own defaults), WANDB_MODE, WANDB_PROJECT and
WANDB_DIR (unset here: offline, project "parallel-finetune", the run folder). Only rank 0 makes loggers.

A logger is three calls (train record, evaluation, close); adding a destination is one class here and its name in
`DESTINATIONS`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from .errors import UserError

# The optional destinations, in the order they are set up; "none" = only the run folder's files and the bar.
DESTINATIONS = ("tensorboard", "mlflow", "wandb")
# Per-step numbers sent to every tracker as "train/<key>" (metrics.jsonl keeps the whole record).
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu")
# Tracker run ids of this run folder, so that a resumed run continues the same MLflow / W&B run.
TRACKING_IDS = "tracking.json"


class MetricLogger(Protocol):
    def log_train(self, record: dict) -> None: ...

    def log_eval(self, step: int, results: dict) -> None: ...

    def close(self, status: str = "finished") -> None:
        """status: finished | stopped (SIGTERM, resumable) | failed."""


def destinations(report_to) -> tuple[str, ...]:
    """`report_to` as config and overrides spell it (a name, all, none, or a list of names) -> the names, or a
    one-line error naming the value and the valid names."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if names in (["none"], []):
        return ()
    if names == ["all"]:
        return DESTINATIONS
    unknown = [n for n in names if n not in DESTINATIONS]
    if unknown:
        raise UserError(
            f"report_to: {unknown[0]!r} is not a destination; valid: {', '.join(DESTINATIONS)}, all or none "
            "(metrics.jsonl and the progress bar are always written)"
        )
    return tuple(dict.fromkeys(names))


def _scalars(record: dict) -> dict[str, float]:
    return {
        f"train/{key}": float(record[key])
        for key in TRAIN_SCALARS
        if isinstance(record.get(key), (int, float)) and math.isfinite(record[key])
    }


def _finite(results: dict) -> dict[str, float]:
    return {f"eval/{k}": float(v) for k, v in results.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def flat_params(config: dict, limit: int = 500) -> dict[str, str]:
    """The config as tracker parameters: one string per key (lists and mappings as JSON), cut at `limit`
    characters (MLflow refuses longer values)."""
    params = {}
    for key, value in config.items():
        text = value if isinstance(value, str) else json.dumps(value)
        params[key] = text if len(text) <= limit else text[: limit - 3] + "..."
    return params


class ProgressLogger:
    """The progress bar and, every `log_every` steps, one log line (also on rank != 0: a disabled bar)."""

    def __init__(self, total_steps: int, log_every: int, resumed_at: int, enabled: bool, format_step):
        self.total_steps, self.log_every, self.format_step = total_steps, log_every, format_step
        # In a log file (not a terminal) every redraw is a line of text: redraw every 30 s there.
        self.bar = tqdm(
            total=total_steps,
            initial=resumed_at,
            desc="train",
            unit="step",
            disable=not enabled,
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.2 if sys.stderr.isatty() else 30,
        )

    def log_train(self, record: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
        if record["step"] % self.log_every == 0 or record["step"] == self.total_steps or record["skipped"]:
            self.bar.write(self.format_step(record, self.total_steps))

    def log_eval(self, step: int, results: dict) -> None:
        self.bar.write(f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))

    def close(self, status: str = "finished") -> None:
        self.bar.close()


def finite_or_null(record: dict) -> dict:
    """Strict JSON has no NaN or Infinity: a non-finite number is written as null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def _continue_jsonl(path: Path, resumed_at: int):
    """Open a step-keyed JSON-lines file: fresh, or (resuming) keeping the records up to the resumed step, so
    the file reads as one uninterrupted run."""
    kept = []
    if resumed_at and path.is_file():
        kept = [
            line
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= resumed_at
        ]
    handle = open(path, "w", encoding="utf-8")
    handle.writelines(line + "\n" for line in kept)
    handle.flush()
    return handle


class JsonlLogger:
    """metrics.jsonl (every step's whole record) and eval.jsonl in the run folder."""

    def __init__(self, output_dir: Path, resumed_at: int):
        self.metrics = _continue_jsonl(output_dir / "metrics.jsonl", resumed_at)
        self.evals = _continue_jsonl(output_dir / "eval.jsonl", resumed_at)

    def log_train(self, record: dict) -> None:
        self.metrics.write(json.dumps(finite_or_null(record)) + "\n")
        self.metrics.flush()

    def log_eval(self, step: int, results: dict) -> None:
        self.evals.write(json.dumps({"step": step, **results}) + "\n")
        self.evals.flush()

    def close(self, status: str = "finished") -> None:
        self.metrics.close()
        self.evals.close()


class TensorBoardLogger:
    """Event files in the run folder's tensorboard/ (`tensorboard --logdir runs`)."""

    def __init__(self, output_dir: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log_train(self, record: dict) -> None:
        for name, value in _scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def log_eval(self, step: int, results: dict) -> None:
        for name, value in _finite(results).items():
            self.writer.add_scalar(name, value, step)

    def close(self, status: str = "finished") -> None:
        self.writer.close()


class MLflowLogger:
    """One MLflow run per training run (continued on resume): the config as parameters, train/* and eval/*
    metrics by step. Where it goes is MLflow's to decide (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), so a
    local store, `mlflow server` or a SageMaker-managed MLflow ARN all work unchanged."""

    STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def __init__(self, output_dir: Path, run_name: str, params: dict, run_id: str | None, **_):
        import mlflow

        self.mlflow = mlflow
        if mlflow.active_run() is not None:  # one process, one run: a caller's leftover run would absorb ours
            mlflow.end_run()
        try:
            if run_id:
                self.run = mlflow.start_run(run_id=run_id)
            else:
                self.run = mlflow.start_run(run_name=run_name)
                mlflow.log_params(flat_params(params))
        except Exception as exc:  # a bad URI or an unreachable server: one line, before any step is trained
            uri = mlflow.get_tracking_uri()
            raise UserError(f"report_to=mlflow: cannot start a run at {uri!r} (MLFLOW_TRACKING_URI): {exc}") from None
        self.run_id = self.run.info.run_id

    def log_train(self, record: dict) -> None:
        self.mlflow.log_metrics(_scalars(record), step=record["step"])

    def log_eval(self, step: int, results: dict) -> None:
        self.mlflow.log_metrics(_finite(results), step=step)

    def close(self, status: str = "finished") -> None:
        self.mlflow.end_run(self.STATUS[status])


class WandbLogger:
    """A Weights & Biases run, offline unless WANDB_MODE says otherwise: its files (in WANDB_DIR, else the run
    folder) are uploaded later with `wandb sync`. The config is the run's config."""

    EXIT_CODE = {"finished": 0, "stopped": 0, "failed": 1}

    def __init__(self, output_dir: Path, run_name: str, params: dict, run_id: str | None, **_):
        import wandb

        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "parallel-finetune",
                dir=os.environ.get("WANDB_DIR") or str(output_dir),
                mode=os.environ.get("WANDB_MODE") or "offline",
                name=run_name,
                config=params,
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as exc:  # e.g. WANDB_MODE=online without an API key
            raise UserError(f"report_to=wandb: cannot start a run: {str(exc).strip().splitlines()[0]}") from None
        self.run_id = self.run.id

    def log_train(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def log_eval(self, step: int, results: dict) -> None:
        self.run.log(_finite(results), step=step)

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=self.EXIT_CODE[status])


TRACKERS = {"tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "wandb": WandbLogger}


def make_loggers(
    names: tuple[str, ...], output_dir: Path, run_name: str, params: dict, resumed_at: int
) -> list[MetricLogger]:
    """The chosen trackers. A resumed run continues the runs whose ids tracking.json recorded; new ids are
    recorded there."""
    ids_path = output_dir / TRACKING_IDS
    ids = json.loads(ids_path.read_text(encoding="utf-8")) if resumed_at and ids_path.is_file() else {}
    loggers = []
    for name in names:
        logger = TRACKERS[name](output_dir=output_dir, run_name=run_name, params=params, run_id=ids.get(name))
        loggers.append(logger)
        if hasattr(logger, "run_id"):
            ids[name] = logger.run_id
    if ids:
        ids_path.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    return loggers
