"""Scale-out paths, run for real on this machine: docs/multi-node.md's two-node torchrun command as two agents (two
"nodes") on 127.0.0.1, and scripts/train.sbatch submitted to a real two-node Slurm started here (tests/
slurm_cluster.py). Both run 2 nodes x 2 processes with the recipe's tensor_parallel_degree: auto, which must give
TP=2 inside each node and DP=2 across them, and train like one process. (The SageMaker path: test_sagemaker.py.)"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_cluster
from conftest import RECIPE, REPO, Run, assert_trains_like, subprocess_env, tiny_overrides
from zygote import free_port

from parallel_finetune.errors import UserError
from parallel_finetune.preflight import preflight
from parallel_finetune.resolve import load_config

TOLERANCE = 1e-5
NODES, PROCESSES_PER_NODE = 2, 2
RECORD_GROUPS = REPO / "tests" / "workers" / "record_groups.py"
SBATCH_SCRIPT = REPO / "scripts" / "train.sbatch"
TIMEOUT_S = 600


def documented_two_node_command() -> list[str]:
    """docs/multi-node.md's two-node torchrun command (the one line starting `torchrun --nnodes 2 `, continuation
    joined)."""
    text = (REPO / "docs" / "multi-node.md").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("torchrun --nnodes 2 ")]
    return shlex.split(line)


def as_two_local_agents(command: list[str], port: int, script: Path) -> list[str]:
    """`command` as each agent runs it here: 2 processes per node for 8, the rendezvous on 127.0.0.1:`port` for
    HOST0:29500, `script` for scripts/train.py (the same training, plus a record of the process groups)."""
    words = list(command)
    assert words[0] == "torchrun" and {"--nproc_per_node", "--rdzv_endpoint", "scripts/train.py"} <= set(words), (
        f"docs/multi-node.md's two-node command changed shape: {shlex.join(command)}"
    )
    assert words[words.index("--nnodes") + 1] == str(NODES) and words[words.index("--rdzv_backend") + 1] == "c10d"
    words[words.index("--nproc_per_node") + 1] = str(PROCESSES_PER_NODE)
    words[words.index("--rdzv_endpoint") + 1] = f"127.0.0.1:{port}"
    words[words.index("scripts/train.py")] = str(script)
    return [sys.executable, "-m", "torch.distributed.run", *words[1:]]


def run_agents(command: list[str], env: dict[str, str], logs: Path) -> str:
    """`command` started NODES times at once, as one agent on each node; their output, agent by agent."""
    logs.mkdir()
    agents = []
    for node in range(NODES):
        with open(logs / f"agent{node}.log", "w") as log:
            agents.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [agent.wait(timeout=TIMEOUT_S) for agent in agents]
    except subprocess.TimeoutExpired:
        codes = ["timed out"]
    finally:
        for agent in agents:  # an agent stops its workers on SIGTERM
            if agent.poll() is None:
                agent.terminate()
                agent.wait(timeout=60)
    output = "".join(f"===== agent {node}\n{(logs / f'agent{node}.log').read_text()}" for node in range(NODES))
    if codes != [0] * NODES:
        pytest.fail(f"the agents ended with {codes}:\n{output[-8000:]}")
    return output


def check_two_nodes(run: Run, reference: Run) -> float:
    """Trains like `reference` on 2 x 2 processes that auto made TP=2 x DP=2; the largest loss difference."""
    difference = assert_trains_like(run, reference, "classification", TOLERANCE)
    layout = run.summary["layout"]
    assert (layout["world_size"], layout["tensor_parallel"], layout["data_parallel"]) == (4, 2, 2), layout
    return difference


@pytest.fixture
def reference(single_process_run, sst2, cache_dir) -> Run:
    return single_process_run(RECIPE, tiny_overrides(sst2, cache_dir))


def test_the_readme_two_node_command_as_two_agents_trains_like_one_process(reference, sst2, cache_dir, tmp_path):
    groups = tmp_path / "groups"
    groups.mkdir()
    command = as_two_local_agents(documented_two_node_command(), free_port(), RECORD_GROUPS)
    command += [*tiny_overrides(sst2, cache_dir), f"output_dir={tmp_path / 'run'}"]
    output = run_agents(command, {**subprocess_env(), "GROUPS_DIR": str(groups)}, tmp_path / "agents")
    difference = check_two_nodes(Run(0, output, tmp_path / "run"), reference)
    print(f"2 agents x 2 processes vs one process: largest loss difference {difference:.3g}")
    recorded = {int(path.stem.removeprefix("rank")): json.loads(path.read_text()) for path in groups.iterdir()}
    node = {rank: seen["node"] for rank, seen in recorded.items()}
    assert sorted(node.items()) == [(0, 0), (1, 0), (2, 1), (3, 1)], "each agent starts a run of consecutive ranks"
    for rank, seen in recorded.items():
        assert len(seen["tp"]) == 2 and {node[peer] for peer in seen["tp"]} == {node[rank]}, (rank, seen)
        assert len(seen["dp"]) == 2 and {node[peer] for peer in seen["dp"]} == {0, 1}, (rank, seen)


@pytest.fixture
def slurm(tmp_path):
    reason = slurm_cluster.unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_cluster.Cluster(tmp_path / "slurm", NODES, PROCESSES_PER_NODE) as cluster:
        yield cluster


def test_the_sbatch_script_on_a_two_node_slurm_trains_like_one_process(slurm, reference, sst2, cache_dir, tmp_path):
    job_output = tmp_path / "job.out"
    # sbatch hands its environment to the job: this interpreter, as a user's activated environment would be
    env = {
        **subprocess_env(),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "NPROC_PER_NODE": str(PROCESSES_PER_NODE),
        "RDZV_PORT": str(free_port()),
    }
    command = [
        "sbatch",
        "--wait",
        f"--nodes={NODES}",
        f"--output={job_output}",
        str(SBATCH_SCRIPT),
        str(RECIPE),
        *tiny_overrides(sst2, cache_dir),
        f"output_dir={tmp_path / 'run'}",
    ]
    try:
        submitted = slurm.command(*command, env=env, cwd=tmp_path, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        submitted = None
    output = job_output.read_text() if job_output.exists() else ""
    if submitted is None or submitted.returncode != 0:
        pytest.fail(
            f"the job {'timed out' if submitted is None else f'failed: {submitted.stderr}'}\n"
            f"{output[-8000:]}\n{slurm.logs()}"
        )
    assert f"{NODES} nodes (n[1-2]) x {PROCESSES_PER_NODE} processes, rendezvous 127.0.0.1:" in output
    assert "4 processes on 2 nodes = 2 data-parallel x 2 tensor-parallel" in output  # its --check, before srun
    difference = check_two_nodes(Run(0, output, tmp_path / "run"), reference)
    print(f"Slurm, 2 nodes x 2 processes vs one process: largest loss difference {difference:.3g}")


@pytest.mark.parametrize(
    "arguments,env,error",
    [
        ([], {}, "error: usage: sbatch [--nodes N] scripts/train.sbatch RECIPE.yaml [key=value ...]"),
        ([str(RECIPE)], {}, "error: not inside a Slurm job: submit it, sbatch [--nodes N] scripts/train.sbatch"),
        (
            [str(RECIPE)],
            {"SLURM_JOB_ID": "7", "NPROC_PER_NODE": "eight"},
            "error: NPROC_PER_NODE='eight' is not a positive whole number (processes per node)",
        ),
        ([str(RECIPE)], {"SLURM_JOB_ID": "7"}, "error: no GPU found on "),
    ],
    ids=["no recipe", "outside slurm", "bad NPROC_PER_NODE", "no GPU"],
)
def test_the_sbatch_script_refuses_bad_input_in_one_line(arguments, env, error, tmp_path):
    # an nvidia-smi that finds no GPU, as on a CPU node
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    outside = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "NPROC_PER_NODE"))}
    outside["PATH"] = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    proc = subprocess.run(
        ["bash", str(SBATCH_SCRIPT), *arguments], env={**outside, **env}, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and error in proc.stderr, proc.stderr


def test_check_spreads_processes_over_nodes(sst2, cache_dir, tmp_path):
    config = load_config(RECIPE, tiny_overrides(sst2, cache_dir) + [f"output_dir={tmp_path / 'run'}"])
    assert "4 processes on 2 nodes = 2 data-parallel x 2 tensor-parallel" in preflight(config, 4, 2)
    assert "4 processes = 1 data-parallel x 4 tensor-parallel" in preflight(config, 4, 1)
    with pytest.raises(UserError, match=r"^--nproc 5 processes do not spread evenly over --nnodes 2 nodes$"):
        preflight(config, 5, 2)
