"""The project's promise: every parallel layout trains exactly like one process (same seed, same data).

Each row of CASES is one (family, layout, task) run; adding a parallel feature adds rows, a registered family
gets its TP=2 row of every task it supports.
fp32, tiny models, real SST-2."""

from __future__ import annotations

import pytest
from conftest import FAMILIES, assert_trains_like, launch, recipe, tiny_overrides

from parallel_finetune.families import get_family
from parallel_finetune.tools.planner import Candidate, memory_per_gpu, model_shape

TOLERANCE = 1e-5

GPTJ_LAYOUTS = [
    # (name, processes, overrides, tasks)
    ("tp2", 2, ["tensor_parallel_degree=2"], ("classification", "causal_lm")),
    # each batch as long as its longest row (pad_to_multiple_of's default; the tiny runs pad to 8): the same training
    ("tp2_longest", 2, ["tensor_parallel_degree=2", "pad_to_multiple_of=1"], ("classification",)),
    ("dp2", 2, ["tensor_parallel_degree=1"], ("classification", "causal_lm")),
    # quarter-MiB buckets: gradients summed in several buckets during the backward (overlap_gradients)
    ("dp2_tp2", 4, ["tensor_parallel_degree=2", "gradient_bucket_mib=0.25"], ("classification",)),
    ("accumulation4", 1, ["gradient_accumulation_steps=4"], ("classification", "causal_lm")),
    (
        "dp2_accumulation2",
        2,
        ["tensor_parallel_degree=1", "gradient_accumulation_steps=2", "gradient_bucket_mib=0.25"],
        ("classification",),
    ),
    ("dp2_after_backward", 2, ["tensor_parallel_degree=1", "overlap_gradients=false"], ("classification",)),
]
# Memory savers: each row turns on one sharding scheme plus one activation saver, all checked against one process.
MEMORY_LAYOUTS = [
    ("optimizer_dp2", 2, ["tensor_parallel_degree=1", "sharding=optimizer"]),
    ("full_dp2_checkpointing", 2, ["tensor_parallel_degree=1", "sharding=full", "activation_checkpointing=true"]),
    (
        "hybrid_2x2_offload",
        4,
        ["tensor_parallel_degree=1", "sharding=hybrid", "shard_group_size=2", "offload_activations=true"],
    ),
    (
        "full_dp2_tp2_checkpointing_every2",
        4,
        ["tensor_parallel_degree=2", "sharding=full", "activation_checkpointing=2"],
    ),
]
# 6 heads on TP=2 leaves 3 heads per rank: an odd count exposes any head-count bookkeeping error.
SIX_HEADS = {
    "gptj": ["model_config.n_head=6", "model_config.n_embd=192"],
    "gpt2": ["model_config.n_head=6", "model_config.n_embd=192"],
    "gptneo": ["model_config.num_heads=6", "model_config.hidden_size=192"],
    "bert": [
        "model_config.num_attention_heads=6",
        "model_config.hidden_size=192",
        "model_config.intermediate_size=384",
    ],
}

CASES = [
    pytest.param("gptj", name, nproc, overrides, task, (), id=f"gptj-{name}-{task}")
    for name, nproc, overrides, tasks in GPTJ_LAYOUTS
    for task in tasks
]
CASES += [
    pytest.param(family, "tp2", 2, ["tensor_parallel_degree=2"], task, (), id=f"{family}-tp2-{task}")
    for family in FAMILIES
    if family != "gptj"  # GPT-J's tp2 rows are among GPTJ_LAYOUTS'
    for task in get_family(family).tasks
]
CASES += [
    pytest.param(
        family,
        "tp2",
        2,
        ["tensor_parallel_degree=2"],
        "classification",
        tuple(SIX_HEADS[family]),
        id=f"{family}-tp2-3_heads_per_rank",
    )
    for family in SIX_HEADS
]
CASES += [
    pytest.param(family, name, nproc, overrides, "classification", (), id=f"{family}-{name}")
    for family in ("gptj", "bert")
    for name, nproc, overrides in MEMORY_LAYOUTS
]
CASES += [
    pytest.param(
        "gpt2",
        "full_dp2_tp2",
        4,
        ["tensor_parallel_degree=2", "sharding=full"],
        "classification",
        (),
        id="gpt2-full_dp2_tp2",
    )
]


@pytest.mark.parametrize("family,name,nproc,overrides,task,model", CASES)
def test_layout_matches_single_process(
    family, name, nproc, overrides, task, model, single_process, sst2, cache_dir, tmp_path
):
    reference = single_process(family, task, model)
    run = launch(
        nproc,
        tiny_overrides(sst2, cache_dir, task, family) + list(model) + overrides,
        tmp_path / name,
        recipe=recipe(family),
    )
    difference = assert_trains_like(run, reference, task, TOLERANCE)
    print(f"{family} {name} {task}: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    layout = run.summary["layout"]
    assert layout["world_size"] == nproc
    assert layout["data_parallel"] * layout["tensor_parallel"] == nproc
    assert layout["sharding"] == _value(overrides, "sharding", "none")
    _check_state_bytes(
        family, overrides, run.summary["state_bytes_per_rank"], reference.summary["state_bytes_per_rank"][0]
    )
    if not model:  # the planner knows the default tiny configs
        _check_planner_estimate(family, task, overrides, layout, run.summary["state_bytes_per_rank"])


def _value(overrides: list[str], key: str, default: str) -> str:
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")), default)


def _check_planner_estimate(family: str, task: str, overrides: list[str], layout: dict, per_rank: list[dict]) -> None:
    """The planner's parameter, gradient and optimizer bytes for this layout, against the measured ones."""
    sharding = layout["sharding"]
    shard_degree = {
        "none": 1,
        "optimizer": layout["data_parallel"],
        "full": layout["data_parallel"],
        "hybrid": layout["shard_group_size"],
    }[sharding]
    candidate = Candidate(
        layout["tensor_parallel"],
        1,
        layout["data_parallel"],
        sharding,
        _value(overrides, "activation_checkpointing", "false") != "false",
        1,
        shard_degree,
    )
    estimate = memory_per_gpu(model_shape(f"tiny:{family}", task), candidate, seq_len=64, batch_size=16)
    for category, planned in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer")):
        measured = max(rank[category] for rank in per_rank)
        assert estimate[planned] == pytest.approx(measured, rel=0.10), (category, estimate[planned], measured)


SHARDED = 0.55  # of one process's bytes: half, plus padding and the small replicated pieces


def _check_state_bytes(family: str, overrides: list[str], per_rank: list[dict], single: dict) -> None:
    """Per-rank parameter, gradient and optimizer-state bytes (tensor accounting) against one process."""
    sharding = _value(overrides, "sharding", "none")
    tp = int(_value(overrides, "tensor_parallel_degree", "1"))
    for category in ("params", "grads", "optimizer"):
        ratio = max(rank[category] for rank in per_rank) / single[category]
        if sharding in ("full", "hybrid") or (sharding == "optimizer" and category == "optimizer"):
            assert ratio <= SHARDED, f"{category}: {ratio:.3f} of one process under sharding={sharding}"
        elif tp > 1 and family == "gptj":  # its embedding is vocabulary-sharded too: every big matrix is split
            assert ratio <= SHARDED, f"{category}: {ratio:.3f} of one process with TP={tp}"
        elif tp > 1:  # BERT, GPT-2 and GPT-Neo keep their embeddings replicated
            assert ratio < 1.0, f"{category}: {ratio:.3f} of one process with TP={tp}"
        else:
            assert ratio == 1.0, f"{category}: {ratio:.3f} of one process but nothing is sharded"


# ---------------------------------------------------------------------------------------------------------------
# Issue 28: the tasks beyond SST-2 train like one process too. The user's CSV files of the `derived_tasks` fixture
# (real SST-2 rows): sentence pairs with string labels (BERT: the pair template and token type ids; GPT-J: A EOS B),
# 5 classes, regression (one float target, pairs). One reference per (family, task) serves its TP=2 and PP=2 rows.
TASK_LAYOUTS = [
    ("tp2", ["tensor_parallel_degree=2"]),
    ("pp2", ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]),
]
TASK_METRICS = {
    "pairs": ("accuracy", "f1"),
    "five_classes": ("accuracy", "macro_f1"),
    "regression": ("pearson", "spearmanr", "mse"),
}
TASK_CASES = [
    pytest.param(family, task, name, overrides, id=f"{family}-{name}-{task}")
    for family, task in (("bert", "pairs"), ("gptj", "pairs"), ("bert", "five_classes"), ("gptj", "regression"))
    for name, overrides in TASK_LAYOUTS
]


@pytest.mark.parametrize("family,task,name,overrides", TASK_CASES)
def test_task_matches_single_process(
    family, task, name, overrides, derived_tasks, single_process_run, sst2, cache_dir, tmp_path
):
    run_overrides = tiny_overrides(sst2, cache_dir, "classification", family) + derived_tasks[task]
    reference = single_process_run(recipe(family), run_overrides)
    run = launch(2, run_overrides + overrides, tmp_path / name, recipe=recipe(family))
    difference = assert_trains_like(run, reference, "classification", TOLERANCE)
    print(f"{family} {name} {task}: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    assert tuple(key for key in TASK_METRICS[task] if key in run.summary) == TASK_METRICS[task]
    layout = run.summary["layout"]
    assert layout["tensor_parallel"] * layout["pipeline_parallel"] == 2


# ---------------------------------------------------------------------------------------------------------------
# Issue 36: instruction tuning (task=sft) on the shipped chat sample, the loss on the answers' tokens only (each
# row's target_mask, averaged over the global batch's target count), for the families made for chat: every
# layout against one process (test_chat's run for Llama; one reference per family, shared in a session).
SFT_LAYOUTS = [
    # (name, processes, overrides)
    ("tp2", 2, ["tensor_parallel_degree=2"]),
    ("pp2_1f1b", 2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2", "pipeline_schedule=1f1b"]),
    ("pp2_tp2", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2", "pipeline_schedule=1f1b"]),
    ("fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"]),
]
SFT_CASES = [
    pytest.param(family, name, nproc, overrides, id=f"{family}-{name}-sft")
    for family in ("llama", "qwen3", "mistral")
    for name, nproc, overrides in SFT_LAYOUTS
]


@pytest.mark.parametrize("family,name,nproc,overrides", SFT_CASES)
def test_sft_matches_single_process(family, name, nproc, overrides, single_process_run, sst2, cache_dir, tmp_path):
    from test_chat import sft_reference, sft_run_overrides

    reference = sft_reference(single_process_run, sst2, cache_dir, family)
    run = launch(nproc, sft_run_overrides(sst2, cache_dir, family) + overrides, tmp_path / name, recipe=recipe(family))
    difference = assert_trains_like(run, reference, "sft", TOLERANCE)
    print(f"{family} {name} sft: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    layout = run.summary["layout"]
    assert layout["world_size"] == nproc
    assert layout["data_parallel"] * layout["tensor_parallel"] * layout["pipeline_parallel"] == nproc
