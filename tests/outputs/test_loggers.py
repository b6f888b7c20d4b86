"""Metric loggers (loggers.py): what `report_to` sends to TensorBoard, MLflow (a real local store, read back with
the MLflow client) and Weights & Biases (offline files, read back record by record), only from rank 0, with the
config as parameters; a resumed run continues the same tracker run; a failed one is marked failed."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import textwrap
import threading
import time
from pathlib import Path

import mlflow
import pytest
import yaml
from conftest import launch, python, tiny_overrides, tmpfs
from wandb.proto import wandb_internal_pb2

from parallel_finetune.errors import UserError
from parallel_finetune.outputs.loggers import DESTINATIONS, TRACKER_GRACE_S, TRACKING_IDS, destinations
from parallel_finetune.outputs.reporting import Reporter, format_step
from parallel_finetune.resolve import load_config

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


def test_only_rank_0_prints_a_line_per_event(tmp_path, capsys):
    """Every rank makes a Reporter; only rank 0's prints, and it prints each step and evaluation once. (tqdm's
    `write` prints whether its bar is disabled or not: other ranks' disabled bars printed every line too.) The
    layouts' runs check the same on their whole output (conftest.assert_one_line_per_event)."""
    for enabled in (False, True):  # another rank, then rank 0
        reporter = Reporter(tmp_path, 2, 1, enabled)
        reporter.step(record(1, 0.9))
        reporter.evaluation(1, {"eval_loss": 0.5})
        reporter.generations(1, [{"prompt": "p", "answer": "a"}])
        reporter.close()
        output = capsys.readouterr()
        lines = (output.out + output.err).splitlines()
        printed = [line for line in lines if line.startswith(("step 1/2", "eval @ step 1", "generations @ step 1"))]
        assert len(printed) == (3 if enabled else 0), printed


def test_a_dpo_step_shows_and_tracks_its_pairs_rewards(tmp_path):
    """Issue 54: a DPO step's rewards/accuracies and margins were in metrics.jsonl only: the step line shows them
    and the trackers get every pair metric (TRL's names, loop/loss.py's PAIR_METRICS) each logged step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from parallel_finetune.loop.loss import PAIR_METRICS

    pairs = {key: 0.25 + number / 8 for number, key in enumerate(PAIR_METRICS[1:])}  # the step's, as the trainer's
    step = record(2, 0.6) | pairs
    line = format_step(step, 4)
    accuracy, margins = pairs["rewards/accuracies"], pairs["rewards/margins"]
    assert line.endswith(f"| rewards/accuracies {accuracy:.3f} | rewards/margins {margins:.4f}"), line
    assert "rewards" not in format_step(record(2, 0.6), 4)  # the other tasks' line as before
    output = tmp_path / "run"
    output.mkdir()
    reporter = Reporter(output, 4, 1, True)
    reporter.add_trackers(("tensorboard",), None, {})
    reporter.step(step)
    reporter.close()
    events = EventAccumulator(str(output / "tensorboard")).Reload()
    tracked = {tag: events.Scalars(tag)[0] for tag in events.Tags()["scalars"]}
    for key, value in pairs.items():
        assert tracked[f"train/{key}"].step == 2 and abs(tracked[f"train/{key}"].value - value) < 1e-6, key
    written = json.loads((output / "metrics.jsonl").read_text())
    assert {key: written[key] for key in pairs} == pairs


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on: a connection is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_server():
    """A server on 127.0.0.1 that takes connections and never answers: its URL."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def start_mlflow(tmp_path, monkeypatch, uri: str, timeout_s: float = 5) -> Reporter:
    """A Reporter in tmp_path/run that starts MLflow at `uri` within `timeout_s`."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    (tmp_path / "run").mkdir(exist_ok=True)
    reporter = Reporter(tmp_path / "run", 4, 1, True)
    reporter.add_trackers(("mlflow",), None, {"lr": 1e-4}, timeout_s)
    return reporter


@pytest.mark.parametrize("server", ["closed", "silent", "nosuchscheme"])
def test_a_tracker_that_cannot_start_fails_in_one_line_within_tracker_timeout(
    server, silent_server, tmp_path, monkeypatch
):
    """MLflow's own retries at a closed port took ~250 s; a server that never answers is cut by our deadline."""
    uri = {"closed": f"http://127.0.0.1:{closed_port()}", "silent": silent_server, "nosuchscheme": "nosuchscheme://x"}
    started = time.monotonic()
    with pytest.raises(UserError) as refused:
        start_mlflow(tmp_path, monkeypatch, uri[server], timeout_s=5)
    assert time.monotonic() - started < 5 + TRACKER_GRACE_S + 5
    message = str(refused.value)
    assert "\n" not in message and message.startswith("report_to=mlflow: "), message
    expected = {
        "closed": f"cannot start a run at {uri['closed']!r} (MLFLOW_TRACKING_URI): ",
        "silent": f"no run started at {uri['silent']!r} (MLFLOW_TRACKING_URI) within tracker_timeout_s=5 s",
        "nosuchscheme": "cannot start a run at 'nosuchscheme://x' (MLFLOW_TRACKING_URI): ",
    }[server]
    assert expected in message, message
    assert "Connection refused" in message or server != "closed", message


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_stops_a_tracker_start_at_once(name, silent_server, tmp_path, monkeypatch):
    """SIGTERM (the trainer's handler: stop) abandons the start and says so; Ctrl-C stops it. Either within a second
    or two of the signal, not after MLflow's retries."""
    asked = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))
    # To the main thread, as a terminal's Ctrl-C or a `kill` reaches a process whose other threads are idle: a
    # signal sent to the process may be taken by another thread (this one, or one an earlier test left running),
    # which does not interrupt the main thread's blocking read (seen once in ~7 suite runs: the start ran to its
    # 60 s deadline).
    # MLflow imported first: under load its import outlasted the 1 s, and a Ctrl-C during that import left the
    # start to run to its 60 s deadline (once, in a suite beside other jobs)
    import mlflow  # noqa: F401

    # Ctrl-C pressed again each second while the start goes on, three times at most, as at a terminal: in one of two
    # full suites on 2026-11-29 the one Ctrl-C at 1 s never interrupted the start, and it ran to its 60 s deadline
    # (what earlier tests of a pytest process leave was checked: no handler or signal mask changed). Each
    # press raises KeyboardInterrupt as Python's own handler does, the first that lands only: a later one must not
    # interrupt pytest. SIGTERM is sent once: its handler's calls are counted.
    ended, sent, interrupted = threading.Event(), [], []

    def press(signum, frame):
        if not interrupted:
            interrupted.append(time.monotonic())
            raise KeyboardInterrupt

    previous_int = signal.signal(signal.SIGINT, press)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def send(signum: int = getattr(signal, name), presses: int = 3 if name == "SIGINT" else 1) -> None:
        while not ended.wait(1.0) and len(sent) < presses:
            sent.append(time.monotonic())
            signal.pthread_kill(threading.main_thread().ident, signum)

    timer = threading.Thread(target=send, daemon=True)
    timer.start()
    try:
        if name == "SIGTERM":
            reporter = Reporter(tmp_path, 4, 1, True)
            monkeypatch.setenv("MLFLOW_TRACKING_URI", silent_server)
            assert reporter.add_trackers(("tensorboard", "mlflow"), None, {}, timeout_s=60) is False
            assert asked == [signal.SIGTERM]
            assert [type(logger).__name__ for logger in reporter.loggers] == ["ProgressLogger", "JsonlLogger"]
        else:
            with pytest.raises(KeyboardInterrupt):
                start_mlflow(tmp_path, monkeypatch, silent_server, timeout_s=60)
    finally:
        ended.set()  # where the start ended before a signal (it failed): none stops pytest later
        timer.join()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    assert sent and time.monotonic() - sent[0] < 10, sent
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_an_unwritable_mlflow_store_is_named_with_the_reason(tmp_path, monkeypatch):
    """Not MLflow's notice that file stores are deprecated (or SQLite's minutes of retries): the folder and why."""
    folder = tmp_path / "read-only"
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount
        with tmpfs(folder, "ro,size=1m"):
            with pytest.raises(UserError) as refused:
                start_mlflow(tmp_path, monkeypatch, f"file:{folder / 'mlruns'}")
        reason = "Read-only file system"
    else:
        folder.mkdir()
        folder.chmod(0o555)
        with pytest.raises(UserError) as refused:
            start_mlflow(tmp_path, monkeypatch, f"file:{folder / 'mlruns'}")
        reason = "Permission denied"
    assert str(refused.value) == (
        f"report_to=mlflow: the MLflow store {folder / 'mlruns'} (MLFLOW_TRACKING_URI='file:{folder / 'mlruns'}') "
        f"cannot be written ({reason}: {folder}); choose a writable store"
    )


WANDB_ONLINE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from parallel_finetune.errors import UserError
    from parallel_finetune.outputs.reporting import Reporter

    reporter = Reporter(Path(sys.argv[1]), 4, 1, True)
    started = time.monotonic()
    try:
        reporter.add_trackers(("wandb",), None, {"lr": 1e-4}, float(sys.argv[2]))
    except UserError as exc:
        print(f"{time.monotonic() - started:.1f}", exc, sep="\\n")
    """
)


def test_wandb_online_without_a_server_fails_within_tracker_timeout(tmp_path):
    """W&B online with an API key and no server waited until killed: init_timeout is tracker_timeout_s."""
    pytest.importorskip("wandb")
    (tmp_path / "run").mkdir()
    env = {
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "x" * 40,
        "WANDB_BASE_URL": f"http://127.0.0.1:{closed_port()}",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
    }
    started = time.monotonic()
    (tmp_path / "start_wandb.py").write_text(WANDB_ONLINE)
    ran = python(str(tmp_path / "start_wandb.py"), str(tmp_path / "run"), "5", env=env, timeout=120)
    lines = ran.stdout.strip().splitlines()
    assert ran.returncode == 0 and len(lines) == 2, ran.stdout + ran.stderr
    assert float(lines[0]) < 5 + TRACKER_GRACE_S + 5 and time.monotonic() - started < 60
    assert lines[1].startswith("report_to=wandb: "), lines[1]


def test_a_tracker_that_cannot_start_stops_every_rank_in_one_line(sst2, cache_dir, tmp_path):
    """Rank 0 alone starts trackers, within tracker_timeout_s; its error reaches rank 1 at once instead of a
    collective timing out."""
    uri = f"http://127.0.0.1:{closed_port()}"
    overrides = tiny_overrides(sst2, cache_dir, report_to="mlflow", collective_timeout_s=60, tracker_timeout_s=5)
    run = launch(2, overrides, tmp_path / "run", env={"MLFLOW_TRACKING_URI": uri}, check=False, timeout=120)
    assert run.returncode == 2, run.output[-2000:]
    (line,) = [line for line in run.output.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: report_to=mlflow: cannot start a run at {uri!r}"), line
    assert not (tmp_path / "run" / "metrics.jsonl").read_text(), "no step was trained"


def test_generations_reach_the_run_folder_tensorboard_and_mlflow_and_survive_a_resume(tmp_path, monkeypatch):
    """generate_every's answers: generations.jsonl (cut back to the resumed step, as metrics.jsonl), TensorBoard's
    text tab and an MLflow artifact per step, read back through each library."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps its artifacts in ./mlruns: here, not in the repository
    output = tmp_path / "run"
    output.mkdir()
    answers = [{"prompt": "<|im_start|>user\nhi | there<|im_end|>\n", "answer": "hello"}]
    first = Reporter(output, 4, 1, True)
    first.add_trackers(("tensorboard", "mlflow"), None, {})
    first.generations(2, answers)
    first.generations(4, [{**answers[0], "answer": "lost to the resume"}])
    first.close("stopped")
    second = Reporter(output, 4, 1, True, resumed_at=2)
    second.generations(4, [{**answers[0], "answer": "hi!"}])
    second.close()
    written = [json.loads(line) for line in (output / "generations.jsonl").read_text().splitlines()]
    assert written == [{"step": 2, **answers[0]}, {"step": 4, **answers[0], "answer": "hi!"}]
    assert "generations.jsonl" in (output / ".parallel-finetune-outputs").read_text().splitlines()
    events = EventAccumulator(str(output / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    texts = events.Tensors("generations/text_summary")  # the first run's two (TensorBoard keeps a stopped run's)
    assert [text.step for text in texts] == [2, 4]
    table = texts[0].tensor_proto.string_val[0].decode()
    assert "| hello |" in table and "hi \\| there" in table and "<br>" in table
    client = mlflow.MlflowClient()
    (tracked,) = client.search_runs(["0"])
    artifacts = client.list_artifacts(tracked.info.run_id, "generations")
    assert [a.path for a in artifacts] == ["generations/step-00000002.md", "generations/step-00000004.md"]
