"""Metric loggers (loggers.py): what `report_to` sends to TensorBoard, MLflow (a real local store, read back with
the MLflow client) and Weights & Biases (offline files, read back record by record), only from rank 0, with the
config as parameters; a resumed run continues the same tracker run; a failed one is marked failed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlflow
import pytest
import yaml
from conftest import launch, tiny_overrides
from wandb.proto import wandb_internal_pb2

from parallel_finetune.config import load_config
from parallel_finetune.errors import UserError
from parallel_finetune.loggers import DESTINATIONS, TRACKING_IDS, destinations
from parallel_finetune.reporting import Reporter, format_step

WANDB_BLOCK = 32768  # a .wandb file is a LevelDB-style log: 32 KiB blocks of [crc32, length, type] + payload
WANDB_HEADER = 7  # ":W&B", a 2-byte magic and a version byte


def wandb_records(path: Path) -> list:
    """Every protobuf Record of an offline W&B run file, reassembled from its log blocks."""
    data, records, pending, offset = path.read_bytes(), [], b"", WANDB_HEADER
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    while offset + 7 <= len(data):
        if WANDB_BLOCK - offset % WANDB_BLOCK < 7:  # a block's tail too short for a record header is padding
            offset += WANDB_BLOCK - offset % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        payload, offset = data[offset + 7 : offset + 7 + length], offset + 7 + length
        pending += payload
        if kind in (1, 4):  # FULL, LAST (FIRST and MIDDLE continue)
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """step -> {key: value} of an offline run's history records."""
    history = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(int(items.pop("_step")), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")}
            )
    return history


def mlflow_history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_report_to_names_and_refusal():
    assert destinations("none") == () and destinations([]) == ()
    assert destinations("all") == DESTINATIONS
    assert destinations(["mlflow", "tensorboard", "mlflow"]) == ("mlflow", "tensorboard")
    assert destinations("wandb") == ("wandb",)
    with pytest.raises(UserError) as refused:
        load_config(None, ["family=gptj", "report_to=[mlflow, neptune]"])
    assert str(refused.value) == (
        "config: report_to: 'neptune' is not a destination; valid: tensorboard, mlflow, wandb, all or none "
        "(metrics.jsonl and the progress bar are always written)"
    )


def test_trackers_get_rank0s_metrics_and_the_config(sst2, cache_dir, tmp_path):
    """A TP=2 run reporting to all three: one MLflow run and one W&B run (rank 0 only), each holding exactly the
    losses of metrics.jsonl by step, the evaluations, the config as parameters, and the run's name."""
    store = tmp_path / "mlflow.db"
    env = {
        "MLFLOW_TRACKING_URI": f"sqlite:///{store}",
        "MLFLOW_EXPERIMENT_NAME": "sst2-tp",
        "WANDB_DIR": str(tmp_path / "wandb-files"),
        "WANDB_PROJECT": "recipes-test",
        "WANDB_MODE": "offline",
    }
    (tmp_path / "wandb-files").mkdir()
    overrides = tiny_overrides(sst2, cache_dir, eval_every=3, report_to="all", run_name="gptj-tp2")
    run = launch(2, overrides, tmp_path / "run", env=env)
    losses = {r["step"]: r["loss"] for r in run.records}
    evals = [json.loads(line) for line in (run.output_dir / "eval.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and [e["step"] for e in evals] == [3, 6]
    lr = yaml.safe_load((run.output_dir / "config.yaml").read_text())["lr"]

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("sst2-tp")
    (tracked,) = client.search_runs([experiment.experiment_id])  # exactly one: rank 1 logged nothing
    assert tracked.info.run_name == "gptj-tp2" and tracked.info.status == "FINISHED"
    assert tracked.data.params["lr"] == str(lr)
    assert tracked.data.params["tensor_parallel_degree"] == "auto" and tracked.data.params["report_to"] == "all"
    assert json.loads(tracked.data.params["resolved.degrees"]) == {"pp": 1, "dp": 1, "tp": 2}  # what auto became
    assert tracked.data.params["resolved.precision"] == "fp32"
    assert mlflow_history(client, tracked.info.run_id, "train/loss") == sorted(losses.items())
    assert mlflow_history(client, tracked.info.run_id, "eval/accuracy") == [(e["step"], e["accuracy"]) for e in evals]
    assert json.loads((run.output_dir / TRACKING_IDS).read_text())["mlflow"] == tracked.info.run_id

    (run_file,) = (tmp_path / "wandb-files").glob("wandb/offline-run-*/run-*.wandb")
    history = wandb_history(run_file)
    assert {step: values["train/loss"] for step, values in history.items() if "train/loss" in values} == losses
    assert [(step, history[step]["eval/accuracy"]) for step in (3, 6)] == [(e["step"], e["accuracy"]) for e in evals]
    records = wandb_records(run_file)
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert started.display_name == "gptj-tp2" and started.project == "recipes-test"
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert config["lr"] == lr and config["report_to"] == "all"

    assert list((run.output_dir / "tensorboard").glob("events.out.tfevents.*")), "tensorboard is among all"


def record(step: int, loss: float) -> dict:
    return {
        "step": step,
        "epoch": step / 10,
        "loss": loss,
        "lr": 1e-4,
        "grad_norm": None,
        "loss_scale": 1.0,
        "samples_per_s": 10.0,
        "tokens_per_s": 100.0,
        "tflops_per_device": 0.1,
        "mfu": float("nan"),
        "skipped": False,
    }


def test_a_resumed_run_continues_its_tracker_run_and_failure_is_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    output = tmp_path / "run"
    output.mkdir()

    def reporter(resumed_at: int) -> Reporter:
        made = Reporter(output, 4, 1, True, resumed_at)
        made.add_trackers(("mlflow",), None, {"lr": 1e-4})
        return made

    first = reporter(0)
    first.step(record(1, 0.9))
    first.step(record(2, 0.8))
    first.close("stopped")  # SIGTERM: checkpointed, resumable
    second = reporter(2)
    second.step(record(3, 0.7))
    second.close("failed")
    client = mlflow.MlflowClient()
    (tracked,) = client.search_runs(["0"])
    assert tracked.info.run_id == json.loads((output / TRACKING_IDS).read_text())["mlflow"]
    assert tracked.info.status == "FAILED" and tracked.info.run_name == "run"  # the run folder's name
    assert mlflow_history(client, tracked.info.run_id, "train/loss") == [(1, 0.9), (2, 0.8), (3, 0.7)]
    assert "train/mfu" not in tracked.data.metrics  # NaN is not sent (metrics.jsonl writes it as null)
    assert [json.loads(line)["step"] for line in (output / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert format_step(record(3, 0.7), 4).startswith("step 3/4 | epoch 0.30 | loss 0.7000")


def test_a_tracker_that_cannot_start_stops_every_rank_in_one_line(sst2, cache_dir, tmp_path):
    """Rank 0 alone starts trackers; its error reaches rank 1 at once instead of a collective timing out."""
    env = {"MLFLOW_TRACKING_URI": "nosuchscheme://tracker"}
    overrides = tiny_overrides(sst2, cache_dir, report_to="mlflow", collective_timeout_s=60)
    run = launch(2, overrides, tmp_path / "run", env=env, check=False, timeout=120)
    assert run.returncode == 2, run.output[-2000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: report_to=mlflow: cannot start a run at 'nosuchscheme://tracker'"), line
    assert not (tmp_path / "run" / "metrics.jsonl").read_text(), "no step was trained"
