"""task=reward under every layout against one process (fp32, dropout off, the shipped preference sample): the loss and
every reported metric (TRL's names: accuracy, margin, mean_reward, min_reward, max_reward) at every step and held
out within 1e-5. Llama: TP=2, FSDP DP=2, PP=2 1F1B, gradient accumulation 2, LoRA TP=2; Qwen3: TP=2, PP=2 1F1B, FSDP
DP=2 with gradient accumulation 2 (one run), LoRA TP=2. Each row's one-process reference is made once and shared by
the module."""

from __future__ import annotations

import pytest
from conftest import assert_one_line_per_event, launch
from test_preference import PADDED_LAYOUTS, kind_overrides, kind_recipe
from test_reward import HELD_OUT, STEP_METRICS, reward_overrides

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    """One-process reward runs by (family, kind), made on first use and shared by the module."""
    runs = {}

    def get(family: str, kind: str = "full"):
        if (family, kind) not in runs:
            overrides = reward_overrides(sst2, cache_dir, family, *kind_overrides(kind))
            folder = tmp_path_factory.mktemp(f"reward-{family}-{kind}")
            runs[family, kind] = launch(1, overrides, folder, recipe=kind_recipe(family, kind))
        return runs[family, kind]

    return get


def assert_scores_like(run, reference) -> float:
    """Every step's loss and metrics and the held-out ones as `reference`'s; returns the largest difference."""
    assert len(run.records) == len(reference.records) == 6
    assert reference.losses[0] != reference.losses[-1], "the loss must move"
    differences = []
    for mine, theirs in zip(run.records, reference.records):
        for key in STEP_METRICS:
            differences.append(abs(mine[key] - theirs[key]))
            assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE, rel=1e-6), (mine["step"], key)
    for key in HELD_OUT:
        differences.append(abs(run.summary[key] - reference.summary[key]))
        assert run.summary[key] == pytest.approx(reference.summary[key], abs=TOLERANCE, rel=1e-6), key
    assert_one_line_per_event(run)
    return max(differences)


LAYOUTS = PADDED_LAYOUTS


@pytest.mark.parametrize(
    "family,name,nproc,overrides,kind", LAYOUTS, ids=[f"{row[0]}-{row[1]}-reward" for row in LAYOUTS]
)
def test_reward_matches_single_process(family, name, nproc, overrides, kind, references, sst2, cache_dir, tmp_path):
    reference = references(family, kind)
    run = launch(
        nproc,
        reward_overrides(sst2, cache_dir, family, *kind_overrides(kind), *overrides),
        tmp_path / name,
        recipe=kind_recipe(family, kind),
    )
    assert run.summary["layout"]["world_size"] == nproc
    difference = assert_scores_like(run, reference)
    print(f"{family} {name} reward: largest difference {difference:.2e} over {len(run.records)} steps and held out")
