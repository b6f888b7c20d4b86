"""The harness that forks ranks from a pre-warmed zygote (harness.py, zygote.py) stands in for torchrun: the
same environment, the same losses to the bit, and a failed, killed or hung rank's output in the test report;
a forked plain `python` prints and exits as a fresh interpreter does."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from conftest import REPO, launch, python, subprocess_env, tiny_overrides
from zygote import fork_hazards

PROBE = str(REPO / "tests" / "workers" / "rank_probe.py")


def probe(out, *, torchrun: bool = False, check: bool = True, timeout: int = 600, **env):
    """Two ranks of workers/rank_probe.py; what each saw, from its rank{N}.json."""
    run = launch(2, [], out, script=PROBE, torchrun=torchrun, check=check, timeout=timeout, env=env)
    return run, [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_ranks_see_what_torchrun_workers_see_but_its_agent(tmp_path):
    _, forked = probe(tmp_path / "forked")
    _, torchrun = probe(tmp_path / "torchrun", torchrun=True)
    for rank, (ours, theirs) in enumerate(zip(forked, torchrun)):
        agent = {k for k in theirs["env"] if k.startswith("TORCHELASTIC_")}
        assert agent and not any(k.startswith("TORCHELASTIC_") for k in ours["env"])
        assert ours["env"].keys() == theirs["env"].keys() - agent
        assert {k for k in ours["env"] if ours["env"][k] != theirs["env"][k]} == {"MASTER_PORT"}
        assert ours["env"]["RANK"] == ours["env"]["LOCAL_RANK"] == str(rank) and ours["env"]["WORLD_SIZE"] == "2"
        assert ours["argv"][:-1] == theirs["argv"][:-1]  # the script and its arguments, but the output folder
        # one intra-op thread (OMP_NUM_THREADS=1), the interpreter's signal handlers, a working gloo group
        view = {k: v for k, v in ours.items() if k not in ("env", "argv")}
        assert view == {k: v for k, v in theirs.items() if k not in ("env", "argv")}
        assert view == {"cwd": str(REPO), "threads": 1, "sigterm_default": True, "sigint_raises": True, "rank_sum": 1}


def test_forked_ranks_train_bit_identically_to_torchrun(sst2, cache_dir, tmp_path):
    overrides = tiny_overrides(sst2, cache_dir) + ["tensor_parallel_degree=2"]
    forked = launch(2, overrides, tmp_path / "forked")
    torchrun = launch(2, overrides, tmp_path / "torchrun", torchrun=True)
    assert forked.losses == torchrun.losses and forked.losses[0] != forked.losses[-1]
    assert [r["grad_norm"] for r in forked.records] == [r["grad_norm"] for r in torchrun.records]
    assert (forked.summary["eval_loss"], forked.summary["accuracy"]) == (
        torchrun.summary["eval_loss"],
        torchrun.summary["accuracy"],
    )


def test_a_failing_rank_reports_its_traceback_and_exit_code(tmp_path):
    run, _ = probe(tmp_path / "run", check=False, PROBE_RANK="1", PROBE_DOES="fail")
    assert run.returncode == 1
    assert "rank 1: exit code 1" in run.output and "rank 0:" not in run.output
    # the interpreter's own traceback, from the script down: no harness frames
    assert 'rank_probe.py", line' in run.output and "zygote.py" not in run.output
    assert "RuntimeError: the probe's planted failure" in run.output
    with pytest.raises(pytest.fail.Exception) as failure:
        probe(tmp_path / "checked", PROBE_RANK="1", PROBE_DOES="fail")
    assert "===== rank 1: exit code 1" in str(failure.value) and "planted failure" in str(failure.value)


def test_the_peers_of_a_failed_rank_are_stopped(tmp_path):
    run, _ = probe(tmp_path / "run", check=False, PROBE_RANK="1", PROBE_DOES="fail", PROBE_PEERS="hang")
    assert run.returncode == 1  # the root cause, not the peer's SIGKILL
    assert run.output.endswith(
        "rank 1: exit code 1\nrank 0: killed by SIGKILL (the harness killed it: still running 10 s after rank 1 failed)"
    )


def test_a_rank_killed_by_a_signal_is_reported_as_such(tmp_path):
    run, _ = probe(tmp_path / "run", check=False, PROBE_RANK="0", PROBE_DOES="sigkill")
    assert run.returncode == -9
    assert run.output.endswith("rank 0 will sigkill\n\nrank 0: killed by SIGKILL")


def test_a_hung_rank_is_killed_at_the_timeout_with_its_output(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failure:
        probe(tmp_path / "run", timeout=10, PROBE_RANK="1", PROBE_DOES="hang")
    report = str(failure.value)
    assert report.startswith("training timed out after 10 s")
    assert "rank 1: killed by SIGKILL (the harness killed it: still running at the 10 s timeout)" in report
    assert "rank 1 will hang" in report


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "parallel_finetune.train", "--check", str(REPO / "recipes" / "gptj" / "tp.yaml"), "max_stepz=3"],
        [PROBE, "no_output_dir=here"],  # a traceback from the script's own frame on
    ],
    ids=["module_one_line_error", "script_traceback"],
)
def test_a_forked_python_exits_and_prints_as_a_fresh_one(args):
    fresh = subprocess.run([sys.executable, *args], cwd=REPO, env=subprocess_env(), capture_output=True, text=True)
    forked = python(*args)
    assert forked.returncode == fresh.returncode != 0
    assert (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr)


def test_the_zygote_refuses_to_fork_beside_a_thread():
    before = fork_hazards()  # pytest-xdist runs threads of its own in this process
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert len(fork_hazards()) == len(before) + 1
    finally:
        stop.set()
        thread.join()
