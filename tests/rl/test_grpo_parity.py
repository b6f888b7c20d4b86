"""task=grpo under every layout against one process, in the fixed-rollouts mode (tests/workers/grpo_fixed.py: the
completions given, so the update is deterministic), fp32, dropout off: the loss and every reported metric at every
step within 1e-5. The length reward (its penalty over 4 tokens) makes the advantages differ from 0. Llama: DP=2,
TP=2, FSDP DP=2, gradient accumulation 2, LoRA TP=2. Each row's one-process reference is made once and shared."""

from __future__ import annotations

import math

import pytest
from conftest import REPO, launch, tiny_overrides

TOLERANCE = 1e-5
WORKER = str(REPO / "tests" / "workers" / "grpo_fixed.py")
LORA = ["peft=lora", "lora_dropout=0", "lora_rank=8", "lora_alpha=16", "lora_target_modules=all-linear"]
# TRL's names (rewards/length/mean and /std, reward, reward_std, completions/*, clip_ratio/*), and the loss
STEP_METRICS = (
    "loss",
    "grad_norm",
    "reward",
    "reward_std",
    "rewards/length/mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
)


def grpo_overrides(sst2, cache_dir, *extra: str) -> list[str]:
    keys = {"data_dir": "", "max_length": 96, "max_steps": 4, "batch_size": 16, "lr": 2e-2}
    grpo = ["num_generations=4", "max_completion_length=12", "reward_functions=[length]", "length_limit=4"]
    grpo += ["length_ramp=6", "epsilon=0.02", "loss_type=dapo"]
    return tiny_overrides(sst2, cache_dir, "grpo", "llama", **keys) + grpo + list(extra)


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    runs = {}

    def get(kind: str):
        if kind not in runs:
            extra = LORA if kind == "lora" else []
            folder = tmp_path_factory.mktemp(f"grpo-{kind}")
            runs[kind] = launch(
                1, grpo_overrides(sst2, cache_dir, "tensor_parallel_degree=1", *extra), folder, script=WORKER
            )
        return runs[kind]

    return get


LAYOUTS = [
    ("dp2", 2, ["tensor_parallel_degree=1"], "full"),
    ("tp2", 2, ["tensor_parallel_degree=2"], "full"),
    ("fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"], "full"),
    ("accumulation2", 1, ["tensor_parallel_degree=1", "gradient_accumulation_steps=2"], "full"),
    ("lora_tp2", 2, ["tensor_parallel_degree=2", *LORA], "lora"),
]


@pytest.mark.parametrize(
    "name,nproc,overrides,kind", LAYOUTS, ids=[f"llama-{r[0]}-grpo-matches_single_process" for r in LAYOUTS]
)
def test_grpo_matches_single_process(name, nproc, overrides, kind, references, sst2, cache_dir, tmp_path):
    reference = references(kind)
    run = launch(nproc, grpo_overrides(sst2, cache_dir, *overrides), tmp_path / name, script=WORKER)
    assert run.summary["layout"]["world_size"] == nproc
    records, expected = run.records, reference.records
    assert len(records) == len(expected) == 4
    assert len({round(r["loss"], 6) for r in expected}) > 1, "the loss must move"
    differences = []
    for mine, theirs in zip(records, expected):
        for key in STEP_METRICS:
            assert math.isfinite(theirs[key]), (key, theirs)
            differences.append(abs(mine[key] - theirs[key]))
            assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE, rel=1e-6), (mine["step"], key)
    print(f"llama {name} grpo: largest difference {max(differences):.2e} over {len(records)} steps")
