"""Pipeline parallelism against one process (same seed, same data): every schedule and 3-D layout, every family.

Tiny models with 4 blocks (interleaving needs 2 ranks x 2 virtual stages = 4 stages), fp32, real SST-2."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_trains_like, launch, recipe, tiny_overrides

from parallel_finetune.families import get_family
from parallel_finetune.parallel.pipeline import balanced_partition, plan_stages

TOLERANCE = 1e-5
FOUR_BLOCKS = {
    "gptj": ["model_config.n_layer=4"],
    "gpt2": ["model_config.n_layer=4"],
    "gptneo": ["model_config.num_layers=4", 'model_config.attention_types=[[["global","local"],2]]'],
    "bert": ["model_config.num_hidden_layers=4"],
}
LAYOUTS = [
    # (name, processes, overrides)
    ("gpipe", 2, ["pipeline_parallel_degree=2", "pipeline_schedule=gpipe"]),
    ("1f1b", 2, ["pipeline_parallel_degree=2", "pipeline_schedule=1f1b"]),
    ("interleaved_2x2", 2, ["pipeline_parallel_degree=2", "pipeline_schedule=interleaved", "virtual_stages=2"]),
    ("pp2_tp2", 4, ["pipeline_parallel_degree=2", "tensor_parallel_degree=2"]),
    ("pp2_dp2", 4, ["pipeline_parallel_degree=2", "tensor_parallel_degree=1"]),
]
CASES = [
    pytest.param(family, "classification", name, nproc, overrides, id=f"{family}-{name}")
    for family in FOUR_BLOCKS
    for name, nproc, overrides in LAYOUTS
]
# GPT-2 and GPT-Neo tie the LM head to the token embedding: the first and the last stage both hold it.
CASES += [
    pytest.param("gpt2", "causal_lm", "1f1b", 2, ["pipeline_parallel_degree=2"], id="gpt2-1f1b-causal_lm_tied"),
    pytest.param(
        "gptneo",
        "causal_lm",
        "interleaved_2x2",
        2,
        ["pipeline_parallel_degree=2", "pipeline_schedule=interleaved"],
        id="gptneo-interleaved-causal_lm_tied",
    ),
]


def run_overrides(sst2, cache_dir, family: str, task: str, model: list[str]) -> list[str]:
    return tiny_overrides(sst2, cache_dir, task, family, max_steps=5) + model


@pytest.fixture
def single_process(single_process_run, sst2, cache_dir):
    def get(family: str, task: str, model: tuple[str, ...]):
        return single_process_run(recipe(family), run_overrides(sst2, cache_dir, family, task, list(model)))

    return get


@pytest.mark.parametrize("family,task,name,nproc,overrides", CASES)
def test_pipeline_matches_single_process(
    family, task, name, nproc, overrides, single_process, sst2, cache_dir, tmp_path
):
    model = tuple(FOUR_BLOCKS[family])
    reference = single_process(family, task, model)
    run = launch(
        nproc,
        run_overrides(sst2, cache_dir, family, task, list(model)) + overrides,
        tmp_path / name,
        recipe=recipe(family),
    )
    assert_trains_like(run, reference, task, TOLERANCE)
    layout = run.summary["layout"]
    assert layout["pipeline_parallel"] == 2
    assert layout["pipeline_parallel"] * layout["data_parallel"] * layout["tensor_parallel"] == nproc
    assert "pipeline: " in run.output and "stage 1 (rank 1)" in run.output  # the chosen split is printed


def test_uneven_split_three_blocks_on_two_stages(single_process, sst2, cache_dir, tmp_path):
    model = ("model_config.n_layer=3",)
    reference = single_process("gptj", "classification", model)
    run = launch(
        2,
        run_overrides(sst2, cache_dir, "gptj", "classification", list(model))
        + ["pipeline_parallel_degree=2", "partition=[2,1]"],
        tmp_path,
        recipe=recipe("gptj"),
    )
    assert_trains_like(run, reference, "classification", TOLERANCE)
    assert "stage 0 (rank 0): embeddings + blocks 0-1; stage 1 (rank 1): block 2 + head" in run.output


def test_auto_partition_balances_compute_and_counts_the_head():
    assert balanced_partition([1] * 4, 0, 2) == [2, 2]
    assert balanced_partition([1] * 3, 0, 2) in ([2, 1], [1, 2])
    assert balanced_partition([1] * 8, 2, 2) == [5, 3]  # a head as costly as two blocks: two blocks fewer there
    assert balanced_partition([1] * 7, 0, 7) == [1] * 7
    # GPT-J 6B shape: 28 equal blocks; the LM head (vocabulary x hidden) costs about one block
    counts = balanced_partition([201] * 28, 206, 4)
    assert sum(counts) == 28 and counts[-1] < counts[0]


def test_plan_stages_from_a_tiny_model():
    family = get_family("gptj")
    config = family.hf_config(None, "tiny", 512, 128, {"n_layer": 4})
    from transformers import GPTJForCausalLM

    torch.manual_seed(0)
    model = GPTJForCausalLM(config)
    stages = plan_stages(model, family, 2, 1, "auto")
    # the LM head (512 x 128) costs about a third of a block (196,608 matrix parameters): blocks split 2 + 2
    assert [s.blocks for s in stages] == [(0, 1), (2, 3)]
    assert stages[0].first and stages[-1].last
    stages = plan_stages(model, family, 2, 2, "auto")
    assert [s.blocks for s in stages] == [(0,), (1,), (2,), (3,)]
