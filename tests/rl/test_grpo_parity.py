"""task=grpo under every layout against one process, in the fixed-rollouts mode (tests/workers/grpo_fixed.py: the
completions given, so the update is deterministic), fp32, dropout off: the loss and every reported metric at every
step within 1e-5. The length reward (its penalty over 4 tokens) makes the advantages differ from 0; a tiny reward
model (model:folder, its forwards split over every rank and its scores gathered) is the second reward. Llama and
Qwen 3 each: DP=2, TP=2, FSDP DP=2, gradient accumulation 2, LoRA TP=2, num_iterations 2 (DP=2), beta 0.04 with
LoRA TP=2, QLoRA TP=2. The held-out prompts' completions are given as well (sampled, a tiny run's evaluation cost
more than its 4 steps): their rewards within 1e-5 too. Each row's one-process reference is made once and shared."""

from __future__ import annotations

import math

import pytest
from conftest import REPO, launch, recipe, tiny_overrides, tiny_reward_model

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
    "rewards/tiny-rm/mean",
    "completions/mean_length",
    "completions/clipped_ratio",
    "clip_ratio/region_mean",
)

HELD_OUT_METRICS = ("eval_reward", "eval_rewards/length/mean", "eval_rewards/tiny-rm/mean")


def grpo_overrides(sst2, cache_dir, reward_model, family: str, *extra: str) -> list[str]:
    keys = {"data_dir": "", "max_length": 96, "max_steps": 4, "batch_size": 16, "lr": 2e-2}
    grpo = ["num_generations=4", "max_completion_length=12", f"reward_functions=[length, model:{reward_model}]"]
    grpo += ["length_limit=4", "length_ramp=6", "epsilon=0.02", "loss_type=dapo"]
    return tiny_overrides(sst2, cache_dir, "grpo", family, **keys) + grpo + list(extra)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    return tiny_reward_model(tmp_path_factory.mktemp("grpo-reward-model") / "tiny-rm")


@pytest.fixture(scope="module")
def references(sst2, cache_dir, reward_model, tmp_path_factory):
    """One-process runs by their settings (what each layout row adds besides the layout), made once."""
    runs = {}

    def get(family: str, settings: tuple[str, ...]):
        if (family, settings) not in runs:
            folder = tmp_path_factory.mktemp(f"grpo-reference-{family}")
            overrides = grpo_overrides(sst2, cache_dir, reward_model, family, "tensor_parallel_degree=1", *settings)
            runs[family, settings] = launch(1, overrides, folder, script=WORKER, recipe=recipe(family))
        return runs[family, settings]

    return get


ITERATIONS = ("num_iterations=2",)  # each rollout trained on twice: the old policy's log-probabilities kept
BETA = (*LORA, "beta=0.04")
# tiny NF4 blocks (recipes' qlora.yaml tiny section): each tensor-parallel shard holds whole scaler groups
QLORA = (
    *LORA,
    "lora_base_quantization=nf4",
    "nf4_block_size=16",
    "nf4_scaler_block_size=8",
)  # the KL to the reference, the base with its adapters disabled
ROWS = [
    # (name, processes, layout, settings: what the one-process reference runs with too)
    ("dp2", 2, ["tensor_parallel_degree=1"], ()),
    ("tp2", 2, ["tensor_parallel_degree=2"], ()),
    ("fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"], ()),
    ("accumulation2", 1, ["tensor_parallel_degree=1", "gradient_accumulation_steps=2"], ()),
    ("lora_tp2", 2, ["tensor_parallel_degree=2"], tuple(LORA)),
    ("iterations2_dp2", 2, ["tensor_parallel_degree=1"], ITERATIONS),
    ("lora_beta_tp2", 2, ["tensor_parallel_degree=2"], BETA),
    ("qlora_tp2", 2, ["tensor_parallel_degree=2"], QLORA),
]
LAYOUTS = [(family, *row) for family in ("llama", "qwen3") for row in ROWS]


@pytest.mark.parametrize(
    "family,name,nproc,layout,settings", LAYOUTS, ids=[f"{r[0]}-{r[1]}-grpo-matches_single_process" for r in LAYOUTS]
)
def test_grpo_matches_single_process(
    family, name, nproc, layout, settings, references, reward_model, sst2, cache_dir, tmp_path
):
    reference = references(family, settings)
    overrides = grpo_overrides(sst2, cache_dir, reward_model, family, *layout, *settings)
    run = launch(nproc, overrides, tmp_path / name, script=WORKER, recipe=recipe(family))
    assert run.summary["family"] == family
    assert run.summary["layout"]["world_size"] == nproc
    # held out (its completions given too): each data-parallel rank's gathered, the reward model's forwards split
    # over every rank, and the rewards one process's
    for key in HELD_OUT_METRICS:
        assert math.isfinite(reference.summary[key]), (key, reference.summary)
        assert run.summary[key] == pytest.approx(reference.summary[key], abs=TOLERANCE, rel=1e-6), key
    records, expected = run.records, reference.records
    assert len(records) == len(expected) == 4
    assert len({round(r["loss"], 6) for r in expected}) > 1, "the loss must move"
    assert len({round(r["rewards/tiny-rm/mean"], 6) for r in expected}) > 1, "the reward model scores each step's own"
    keys = STEP_METRICS + (("kl",) if "beta=0.04" in settings else ())
    if "num_iterations=2" in settings:  # the second iteration's ratio moves off 1
        assert any(r["clip_ratio/region_mean"] > 0 for r in expected[1::2])
    differences = []
    for mine, theirs in zip(records, expected):
        for key in keys:
            assert math.isfinite(theirs[key]), (key, theirs)
            differences.append(abs(mine[key] - theirs[key]))
            assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE, rel=1e-6), (mine["step"], key)
    print(f"{family} {name} grpo: largest difference {max(differences):.2e} over {len(records)} steps")
