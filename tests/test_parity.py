"""The project's promise: every parallel layout trains exactly like one process (same seed, same data).

Each row of LAYOUTS is one layout; adding a parallel feature adds a row. fp32, tiny GPT-J, real SST-2."""

from __future__ import annotations

import pytest

from conftest import launch, tiny_overrides

TOLERANCE = 1e-5

LAYOUTS = [
    # (name, processes, overrides, tasks)
    ("tp2", 2, ["tensor_parallel_degree=2"], ("classification", "causal_lm")),
    ("dp2", 2, ["tensor_parallel_degree=1"], ("classification", "causal_lm")),
    ("dp2_tp2", 4, ["tensor_parallel_degree=2"], ("classification",)),
    ("accumulation4", 1, ["gradient_accumulation_steps=4"], ("classification", "causal_lm")),
    ("dp2_accumulation2", 2, ["tensor_parallel_degree=1", "gradient_accumulation_steps=2"], ("classification",)),
]
CASES = [pytest.param(name, nproc, overrides, task, id=f"{name}-{task}")
         for name, nproc, overrides, tasks in LAYOUTS for task in tasks]


@pytest.fixture(scope="module")
def single_process(sst2, cache_dir, tmp_path_factory):
    runs = {}

    def get(task: str):
        if task not in runs:
            runs[task] = launch(1, tiny_overrides(sst2, cache_dir, task), tmp_path_factory.mktemp(f"single-{task}"))
        return runs[task]

    return get


@pytest.mark.parametrize("name,nproc,overrides,task", CASES)
def test_layout_matches_single_process(name, nproc, overrides, task, single_process, sst2, cache_dir, tmp_path):
    reference = single_process(task)
    run = launch(nproc, tiny_overrides(sst2, cache_dir, task) + overrides, tmp_path / name)
    assert len(run.losses) == len(reference.losses) >= 5
    differences = [abs(a - b) for a, b in zip(run.losses, reference.losses)]
    assert max(differences) < TOLERANCE, f"{name}: loss differences {differences}"
    # The loss must actually move, or equal trajectories would prove nothing.
    assert reference.losses[0] != reference.losses[-1]
    # Evaluation: every dev row scored once, whatever the layout.
    metric = "accuracy" if task == "classification" else "perplexity"
    assert run.summary[metric] == pytest.approx(reference.summary[metric], rel=1e-5)
    assert run.summary["eval_loss"] == pytest.approx(reference.summary["eval_loss"], abs=TOLERANCE)
    layout = run.summary["layout"]
    assert layout["world_size"] == nproc
    assert layout["data_parallel"] * layout["tensor_parallel"] == nproc
