"""What a run leaves behind and shows: run folder, progress bar, log lines, metrics.jsonl, TensorBoard, summary."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import resource
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from .errors import UserError
from .runfolder import LOCK, sagemaker_folder

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


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB: peak RSS


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


class Reporter:
    """Rank 0's view of training. Other ranks get a Reporter that does nothing."""

    def __init__(self, output_dir: Path, total_steps: int, log_every: int, enabled: bool, resumed_at: int = 0):
        self.enabled = enabled
        self.output_dir = output_dir
        self.log_every = log_every
        self.total_steps = total_steps
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
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.metrics = _continue_jsonl(output_dir / "metrics.jsonl", resumed_at)
        self.evals = _continue_jsonl(output_dir / "eval.jsonl", resumed_at)
        self.tensorboard = SummaryWriter(str(output_dir / "tensorboard"))

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        self.metrics.write(json.dumps(finite_or_null(record)) + "\n")
        self.metrics.flush()
        for key in (
            "loss",
            "lr",
            "grad_norm",
            "loss_scale",
            "samples_per_s",
            "tokens_per_s",
            "tflops_per_device",
            "mfu",
        ):
            if record.get(key) is not None and math.isfinite(record[key]):
                self.tensorboard.add_scalar(f"train/{key}", record[key], record["step"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", refresh=False)
        if record["step"] % self.log_every == 0 or record["step"] == self.total_steps or record["skipped"]:
            self.bar.write(format_step(record, self.total_steps))

    def evaluation(self, step: int, results: dict) -> None:
        if not self.enabled:
            return
        self.evals.write(json.dumps({"step": step, **results}) + "\n")
        self.evals.flush()
        for key, value in results.items():
            self.tensorboard.add_scalar(f"eval/{key}", value, step)
        self.bar.write(f"eval @ step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items()))

    def close(self) -> None:
        self.bar.close()
        if self.enabled:
            self.metrics.close()
            self.evals.close()
            self.tensorboard.close()


def finite_or_null(record: dict) -> dict:
    """Strict JSON has no NaN or Infinity: a non-finite number is written as null."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


def format_step(record: dict, total_steps: int) -> str:
    norm = "-" if record["grad_norm"] is None else f"{record['grad_norm']:.3f}"
    line = (
        f"step {record['step']}/{total_steps} | epoch {record['epoch']:.2f} | loss {record['loss']:.4f} | "
        f"lr {record['lr']:.2e} | grad_norm {norm} | loss_scale {record['loss_scale']:g} | "
        f"{record['samples_per_s']:.1f} samples/s | {record['tokens_per_s']:.0f} tokens/s | "
        f"{record['tflops_per_device']:.3g} TFLOP/s | MFU {percent(record['mfu'])}"
    )
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


def write_yaml(path: Path, data: dict) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
