"""Where a run's metrics go: one `MetricLogger` per destination, chosen by `report_to`.

The run folder's record (metrics.jsonl, eval.jsonl) and the progress bar are always on; TensorBoard, MLflow and
Weights & Biases are what `report_to` picks, as `report_to` does in accelerate and the Hugging Face Trainer. Each
library's own environment variables keep their meaning because each library reads them itself:
MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME (unset: MLflow's own defaults), WANDB_MODE, WANDB_PROJECT and
WANDB_DIR (unset here: offline, project "parallel-finetune", the run folder). Only rank 0 makes loggers.

MLflow and W&B may wait on a server or a store when their run starts: `tracker_timeout_s` bounds that, through the
libraries' own settings (MLflow's HTTP timeout and retries, W&B's init_timeout) and, TRACKER_GRACE_S later, a
deadline of ours (SIGALRM) that ends whatever they still wait in. SIGTERM during the start abandons it (the run stops
before its first step, as SIGTERM stops it elsewhere) and Ctrl-C stops the run; a helper process the abandoned start
left (W&B's service) is ended, so the process exits at once.

A logger is four calls (train record, evaluation, generations, close); adding a destination is one class here and
its name in `DESTINATIONS`. Generations (generate_every's answers, generation.py) go to generations.jsonl, the log,
TensorBoard's text tab, an MLflow artifact per step and a W&B table.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Protocol

from tqdm.auto import tqdm

from ..errors import UserError
from .runfolder import record_written

# The optional destinations, in the order they are set up; "none" = only the run folder's files and the bar.
DESTINATIONS = ("tensorboard", "mlflow", "wandb")
# Per-step numbers sent to every tracker as "train/<key>" (metrics.jsonl keeps the whole record).
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "loss_scale", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu")
# The pair metrics TRL names without a "/" (ORPO's, loop/pair_losses.py); the others are rewards/*, logps/*.
PAIR_SCALARS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")
GENERATIONS = "generations.jsonl"  # generate_every's answers: step, prompt, answer per line
# Tracker run ids of this run folder, so that a resumed run continues the same MLflow / W&B run.
TRACKING_IDS = "tracking.json"
# The trackers whose start may wait on a server or a store: tracker_timeout_s bounds it.
TIMED_TRACKERS = ("mlflow", "wandb")
# The libraries' own timeouts (tracker_timeout_s) end a start first, with their reason; ours ends it this much later.
TRACKER_GRACE_S = 5.0
# MLflow's HTTP retries while its run starts, unless the environment sets them: its defaults (7 retries, backoff
# factor 2) wait about 250 s for an unreachable server before they give up.
MLFLOW_START_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


class MetricLogger(Protocol):
    def log_train(self, record: dict) -> None: ...

    def log_eval(self, step: int, results: dict) -> None: ...

    def log_generations(self, step: int, generations: list[dict]) -> None:
        """generations: {prompt, answer} per held-out prompt."""

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
    """A train record's tracked numbers: TRAIN_SCALARS and task=dpo's pair metrics (TRL's rewards/*, logps/*,
    PAIR_SCALARS)."""
    keys = [*TRAIN_SCALARS, *PAIR_SCALARS, *(key for key in record if "/" in key)]
    return {
        f"train/{key}": float(record[key])
        for key in keys
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
    """Rank 0's progress bar and, every `log_every` steps, one log line. Only rank 0 has one: a disabled bar would
    not do, since tqdm's `write` prints whether its bar is disabled or not, so every rank printed every line (with
    its own throughput)."""

    def __init__(self, total_steps: int, log_every: int, resumed_at: int, format_step):
        self.total_steps, self.log_every, self.format_step = total_steps, log_every, format_step
        # In a log file (not a terminal) every redraw is a line of text: redraw every 30 s there.
        self.bar = tqdm(
            total=total_steps,
            initial=resumed_at,
            desc="train",
            unit="step",
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

    def log_generations(self, step: int, generations: list[dict]) -> None:
        answers = " | ".join(repr(g["answer"][:60]) for g in generations)
        self.bar.write(f"generations @ step {step} (generations.jsonl): {answers}")

    def close(self, status: str = "finished") -> None:
        self.bar.close()


def generations_markdown(generations: list[dict]) -> str:
    """A markdown table of prompts and answers (TensorBoard renders a text summary as markdown)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | answer |", "| --- | --- |"]
    lines += [f"| {cell(g['prompt'])} | {cell(g['answer'])} |" for g in generations]
    return "\n".join(lines)


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
        record_written(output_dir, "metrics.jsonl", "eval.jsonl")
        self.output_dir, self.resumed_at = output_dir, resumed_at
        self.metrics = _continue_jsonl(output_dir / "metrics.jsonl", resumed_at)
        self.evals = _continue_jsonl(output_dir / "eval.jsonl", resumed_at)
        self.generations = None  # generations.jsonl, opened by the first generations (generate_every)

    def log_train(self, record: dict) -> None:
        self.metrics.write(json.dumps(finite_or_null(record)) + "\n")
        self.metrics.flush()

    def log_eval(self, step: int, results: dict) -> None:
        self.evals.write(json.dumps({"step": step, **results}) + "\n")
        self.evals.flush()

    def log_generations(self, step: int, generations: list[dict]) -> None:
        if self.generations is None:
            record_written(self.output_dir, GENERATIONS)
            self.generations = _continue_jsonl(self.output_dir / GENERATIONS, self.resumed_at)
        for generation in generations:
            self.generations.write(json.dumps({"step": step, **generation}, ensure_ascii=False) + "\n")
        self.generations.flush()

    def close(self, status: str = "finished") -> None:
        self.metrics.close()
        self.evals.close()
        if self.generations is not None:
            self.generations.close()


class TensorBoardLogger:
    """Event files in the run folder's tensorboard/ (`tensorboard --logdir runs`)."""

    def __init__(self, output_dir: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        record_written(output_dir, "tensorboard")
        self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log_train(self, record: dict) -> None:
        for name, value in _scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def log_eval(self, step: int, results: dict) -> None:
        for name, value in _finite(results).items():
            self.writer.add_scalar(name, value, step)

    def log_generations(self, step: int, generations: list[dict]) -> None:
        self.writer.add_text("generations", generations_markdown(generations), step)

    def close(self, status: str = "finished") -> None:
        self.writer.close()


class MLflowLogger:
    """One MLflow run per training run (continued on resume): the config as parameters, train/* and eval/*
    metrics by step. Where it goes is MLflow's to decide (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), so a
    local store, `mlflow server` or a SageMaker-managed MLflow ARN all work unchanged."""

    STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}

    def __init__(self, output_dir: Path, run_name: str, params: dict, run_id: str | None, timeout_s: float, **_):
        import mlflow

        self.mlflow = mlflow
        uri = mlflow.get_tracking_uri()
        _check_local_store(uri)
        if mlflow.active_run() is not None:  # one process, one run: a caller's leftover run would absorb ours
            mlflow.end_run()
        try:
            with _environment(MLFLOW_HTTP_REQUEST_TIMEOUT=str(max(1, int(timeout_s))), **MLFLOW_START_RETRIES):
                if run_id:
                    self.run = mlflow.start_run(run_id=run_id)
                else:
                    self.run = mlflow.start_run(run_name=run_name)
                    mlflow.log_params(flat_params(params))
        except Exception as exc:  # a bad URI or an unreachable server: one line, before any step is trained
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            where = f"{uri!r} (MLFLOW_TRACKING_URI)"
            raise UserError(f"report_to=mlflow: cannot start a run at {where}: {reason}") from None
        self.run_id = self.run.info.run_id

    @staticmethod
    def destination() -> str:
        import mlflow

        return f"{mlflow.get_tracking_uri()!r} (MLFLOW_TRACKING_URI)"

    @staticmethod
    def abandon() -> None:
        pass

    def log_train(self, record: dict) -> None:
        self.mlflow.log_metrics(_scalars(record), step=record["step"])

    def log_eval(self, step: int, results: dict) -> None:
        self.mlflow.log_metrics(_finite(results), step=step)

    def log_generations(self, step: int, generations: list[dict]) -> None:
        self.mlflow.log_text(generations_markdown(generations), f"generations/step-{step:08d}.md")

    def close(self, status: str = "finished") -> None:
        self.mlflow.end_run(self.STATUS[status])


class WandbLogger:
    """A Weights & Biases run, offline unless WANDB_MODE says otherwise: its files (in WANDB_DIR, else the run
    folder) are uploaded later with `wandb sync`. The config is the run's config."""

    EXIT_CODE = {"finished": 0, "stopped": 0, "failed": 1}

    def __init__(self, output_dir: Path, run_name: str, params: dict, run_id: str | None, timeout_s: float, **_):
        import wandb

        folder = os.environ.get("WANDB_DIR") or str(output_dir)
        if not os.environ.get("WANDB_DIR"):
            record_written(output_dir, "wandb")  # where W&B writes its files under `dir`
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "parallel-finetune",
                dir=folder,
                mode=os.environ.get("WANDB_MODE") or "offline",
                name=run_name,
                config=params,
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(init_timeout=timeout_s),
            )
        except Exception as exc:  # e.g. WANDB_MODE=online without an API key, or no answer within init_timeout
            raise UserError(f"report_to=wandb: cannot start a run: {str(exc).strip().splitlines()[0]}") from None
        self.run_id = self.run.id

    @staticmethod
    def destination() -> str:
        if (os.environ.get("WANDB_MODE") or "offline") in ("offline", "disabled"):
            return f"{os.environ.get('WANDB_DIR') or 'the run folder'} (WANDB_DIR)"
        return f"{os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai'} (WANDB_BASE_URL)"

    @staticmethod
    def abandon() -> None:
        """Forget the abandoned start (its service process is ended by then), so that exiting waits for nothing."""
        import wandb

        with contextlib.suppress(Exception):
            wandb.teardown(1)

    def log_train(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def log_eval(self, step: int, results: dict) -> None:
        self.run.log(_finite(results), step=step)

    def log_generations(self, step: int, generations: list[dict]) -> None:
        import wandb

        rows = [[step, g["prompt"], g["answer"]] for g in generations]
        self.run.log({"generations": wandb.Table(columns=["step", "prompt", "answer"], data=rows)}, step=step)

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=self.EXIT_CODE[status])


TRACKERS = {"tensorboard": TensorBoardLogger, "mlflow": MLflowLogger, "wandb": WandbLogger}


class StartStopped(Exception):
    """SIGTERM arrived while a tracker started: the start was abandoned, and the run stops before its first step."""


class _Deadline(BaseException):
    """Our deadline on a tracker's start (SIGALRM). A BaseException, as KeyboardInterrupt is, so that a library's
    own `except Exception` does not swallow it."""


class _StopAsked(BaseException):
    """SIGTERM while a tracker starts."""


def make_loggers(
    names: tuple[str, ...], output_dir: Path, run_name: str, params: dict, resumed_at: int, timeout_s: float = 30.0
) -> list[MetricLogger]:
    """The chosen trackers, MLflow's and W&B's start bounded by `timeout_s` (a UserError past it; StartStopped on
    SIGTERM). A resumed run continues the runs whose ids tracking.json recorded; new ids are recorded there. If one
    cannot start, those started before it are closed as failed."""
    ids_path = output_dir / TRACKING_IDS
    ids = json.loads(ids_path.read_text(encoding="utf-8")) if resumed_at and ids_path.is_file() else {}
    loggers = []
    try:
        for name in names:
            logger = _start(name, output_dir, run_name, params, ids.get(name), timeout_s)
            loggers.append(logger)
            if hasattr(logger, "run_id"):
                ids[name] = logger.run_id
    except BaseException as exc:
        for logger in loggers:
            with contextlib.suppress(Exception):
                logger.close("stopped" if isinstance(exc, StartStopped) else "failed")
        raise
    if ids:
        record_written(output_dir, TRACKING_IDS)
        ids_path.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    return loggers


def _start(name: str, output_dir: Path, run_name: str, params: dict, run_id: str | None, timeout_s: float):
    tracker = TRACKERS[name]
    if name not in TIMED_TRACKERS:
        return tracker(output_dir=output_dir, run_name=run_name, params=params, run_id=run_id)
    helpers = _child_processes()
    try:
        with _bounded(timeout_s):
            return tracker(output_dir=output_dir, run_name=run_name, params=params, run_id=run_id, timeout_s=timeout_s)
    except (_Deadline, _StopAsked, KeyboardInterrupt) as exc:
        for pid in _child_processes() - helpers:  # the abandoned start's helper would hold the exit until it gives up
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        tracker.abandon()
        if isinstance(exc, _Deadline):
            raise UserError(
                f"report_to={name}: no run started at {tracker.destination()} within tracker_timeout_s={timeout_s:g} s "
                "(unreachable, or not answering?); check that it is up, or raise tracker_timeout_s"
            ) from None
        if isinstance(exc, _StopAsked):
            raise StartStopped(name) from None
        raise


@contextlib.contextmanager
def _bounded(timeout_s: float):
    """While a tracker starts: SIGALRM at timeout_s + TRACKER_GRACE_S raises _Deadline, and SIGTERM runs its own
    handler (the trainer's stop request) then raises _StopAsked, so neither waits for the library to give up. Only
    the main thread takes signals; elsewhere the libraries' own timeouts alone bound the start."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    on_term = signal.getsignal(signal.SIGTERM)

    def deadline(signum, frame):
        raise _Deadline

    def stop(signum, frame):
        on_term(signum, frame)
        raise _StopAsked

    on_alarm = signal.signal(signal.SIGALRM, deadline)
    if callable(on_term):  # SIG_DFL ends the process by itself
        signal.signal(signal.SIGTERM, stop)
    signal.setitimer(signal.ITIMER_REAL, timeout_s + TRACKER_GRACE_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, on_alarm)
        signal.signal(signal.SIGTERM, on_term)


def _child_processes() -> set[int]:
    """This process's children (Linux's /proc; elsewhere none are known)."""
    pids: set[int] = set()
    for listing in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(pid) for pid in listing.read_text().split())
    return pids


@contextlib.contextmanager
def _environment(**values: str):
    """`values` as environment variables meanwhile, except those the environment already sets (the user's)."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _check_local_store(uri: str) -> None:
    """A local MLflow store (file:, a plain path, sqlite:///) in a folder that cannot be written: one line naming
    the folder and why, before MLflow answers with something else (a file store's deprecation notice) or retries
    for minutes (SQLite)."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file"):
        store = Path(urllib.parse.unquote(parsed.path))
    elif parsed.scheme == "sqlite" and uri.startswith("sqlite:///") and ":memory:" not in uri:
        store = Path(uri.removeprefix("sqlite:///").split("?")[0])
    else:
        return
    folder = store
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        raise UserError(
            f"report_to=mlflow: the MLflow store {store} (MLFLOW_TRACKING_URI={uri!r}) cannot be written "
            f"({exc.strerror}: {folder}); choose a writable store"
        ) from None
