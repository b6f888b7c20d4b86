"""summary.json: what a run did (dev metrics, throughput, MFU, padding, memory per rank, seconds per phase), made
from plain values that the trainer measured, and the closing lines rank 0 logs with it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..model.throughput import Peak
from ..parallel.hardware import peak_memory_mib
from .reporting import format_throughput, package_versions
from .runfolder import write_json

log = logging.getLogger(__name__)


def padding_fraction(counts) -> float | None:
    """Share of the token slots that were padding, from [real tokens, slots] pairs."""
    real, slots = (sum(c[i] for c in counts) for i in (0, 1))
    return 1 - real / slots if slots else None


def packing_efficiency(counts) -> float | None:
    """Share of the packed token slots that held real tokens, from [real tokens, slots] pairs."""
    fraction = padding_fraction(counts)
    return None if fraction is None else 1 - fraction


def per_rank(value, layout) -> list:
    """`value` of every rank, in rank order (a collective)."""
    values = [None] * layout.world_size
    dist.all_gather_object(values, value)
    return values


@dataclass
class RunRecord:
    """A trained run's plain values, what summary.json reports: `results` (the dev metrics), `history` (the train
    records), `padding` (epoch -> [real tokens, token slots]), `seconds` per phase, this rank's `state_bytes` and
    load figures, `zero_stage` (DeepSpeed only)."""

    results: dict
    task: str
    family: str  # its name
    model: str | None  # "tiny gptj (from config)", or the pretrained model's name
    engine: str
    batch_size: int
    data: str  # the data source's description
    steps: int
    history: list[dict]
    padding: dict[int, list[int]]
    peak: Peak
    precision: str
    resumed_from: Path | None
    seconds: dict[str, float]
    load_peak_mib: float
    load_seconds: float
    state_bytes: dict[str, int] | None
    zero_stage: int | None
    packing: bool = False  # packed training batches: `padding` counts the packed sequences' slots


def run_summary(record: RunRecord, layout) -> dict:
    """summary.json's content: the dev metrics first, then the run as trained; the per-rank figures are gathered
    from every rank (every rank calls it)."""
    history, peak, padding = record.history, record.peak, record.padding
    train_seconds = sum(r["step_time_s"] for r in history) or float("nan")
    samples = len(history) * record.batch_size
    return {
        **record.results,
        "task": record.task,
        "family": record.family,
        "model": record.model,
        "data": record.data,
        "steps": record.steps,
        "skipped_steps": sum(r["skipped"] for r in history),
        "final_loss": history[-1]["loss"] if history else None,
        "train_samples_per_s": samples / train_seconds,
        "train_tokens_per_s": sum(r["tokens_per_s"] * r["step_time_s"] for r in history) / train_seconds,
        # model FLOPs of all trained steps over their time: the run's mean, not the mean of per-step MFUs
        "train_tflops_per_device": (
            tflops := sum(r["tflops_per_device"] * r["step_time_s"] for r in history) / train_seconds
        ),
        "mfu": peak.mfu(tflops),  # None: unknown, and why
        "mfu_unknown": peak.unknown_reason(tflops),
        "peak_tflops_per_device": peak.tflops,
        "peak_source": peak.source,
        "achievable_matmul_tflops": peak.achievable_tflops,  # a CPU's matmul probe (what it reached)
        "padding_fraction": padding_fraction(padding.values()),
        "padding_fraction_per_epoch": {epoch: padding_fraction([counts]) for epoch, counts in sorted(padding.items())},
        # packing=true: real tokens / the packed sequences' token slots (1 - padding_fraction)
        **({"packing_efficiency": packing_efficiency(padding.values())} if record.packing else {}),
        "layout": layout.describe(),
        "resumed_from": str(record.resumed_from) if record.resumed_from else None,
        "precision": record.precision,
        "engine": record.engine,
        **({"zero_stage": record.zero_stage} if record.zero_stage is not None else {}),
        "seconds": {k: round(v, 3) for k, v in record.seconds.items()},
        "peak_memory_mib_per_rank": per_rank(round(peak_memory_mib(layout.device), 1), layout),
        # when the model was ready, before the first step: process peak RSS (CPU) or allocated bytes (CUDA)
        "load_peak_mib_per_rank": per_rank(round(record.load_peak_mib, 1), layout),
        "load_seconds": round(record.load_seconds, 3),
        "state_bytes_per_rank": per_rank(record.state_bytes, layout),
        "versions": package_versions(),
    }


def write_summary(run_folder: Path, summary: dict, results: dict) -> None:
    """Rank 0: summary.json, and the run's closing lines."""
    write_json(run_folder / "summary.json", summary)
    log.info(
        "done: %s | %s",
        ", ".join(f"{k} {v:.4f}" for k, v in results.items()),
        ", ".join(f"{k} {v:.1f}s" for k, v in summary["seconds"].items()),
    )
    log.info("%s", format_throughput(summary))
    log.info("outputs in %s", run_folder)
