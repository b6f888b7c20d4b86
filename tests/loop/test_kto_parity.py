"""task=kto under every layout against one process (fp32, dropout off, the shipped preference sample unpaired): the
loss and every reported metric (TRL's names: kl, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
logps/rejected) at every step and held out within 1e-5 (the logps/* sums, near -60, relative 1e-6). The KL estimate
is measured over the global batch before the step's micro-batches and summed over every rank, so each layout has one
process's. Llama: TP=2, FSDP DP=2, PP=2 1F1B, gradient accumulation 2, LoRA TP=2; Qwen3: TP=2, PP=2 1F1B, FSDP DP=2
with gradient accumulation 2 (one run), LoRA TP=2. kto packs no rows (its rows are padded; packing is refused). Each
row's one-process reference is made once and shared by the module."""

from __future__ import annotations

import pytest
from conftest import assert_one_line_per_event, launch
from test_kto import HELD_OUT, STEP_METRICS, kto_overrides
from test_preference import PADDED_LAYOUTS, kind_overrides, kind_recipe

TOLERANCE = 1e-5
STEPS = 4  # step 2 on has a KL estimate above the clamp, and the loss moves


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    """One-process KTO runs by (family, kind), made on first use and shared by the module."""
    runs = {}

    def get(family: str, kind: str = "full"):
        if (family, kind) not in runs:
            overrides = kto_overrides(sst2, cache_dir, family, *kind_overrides(kind), max_steps=STEPS)
            folder = tmp_path_factory.mktemp(f"kto-{family}-{kind}")
            runs[family, kind] = launch(1, overrides, folder, recipe=kind_recipe(family, kind))
        return runs[family, kind]

    return get


def _close(mine: float, theirs: float, key: str) -> bool:
    return mine == pytest.approx(theirs, abs=TOLERANCE, rel=1e-6 if key.startswith("logps/") else 0)


def assert_scores_like(run, reference) -> float:
    """Every step's loss and metrics and the held-out ones as `reference`'s; returns the largest difference."""
    assert len(run.records) == len(reference.records) == STEPS
    assert reference.losses[0] != reference.losses[-1], "the loss must move"
    assert any(record["kl"] > 0 for record in reference.records), "some step's KL estimate must be above the clamp"
    differences = []
    for mine, theirs in zip(run.records, reference.records):
        for key in STEP_METRICS:
            assert (key in mine) == (key in theirs), (mine["step"], key)
            if key in theirs:
                differences.append(abs(mine[key] - theirs[key]))
                assert _close(mine[key], theirs[key], key), (mine["step"], key, mine[key], theirs[key])
    for key in HELD_OUT:
        differences.append(abs(run.summary[key] - reference.summary[key]))
        assert _close(run.summary[key], reference.summary[key], key), key
    assert_one_line_per_event(run)
    return max(differences)


LAYOUTS = PADDED_LAYOUTS


@pytest.mark.parametrize("family,name,nproc,overrides,kind", LAYOUTS, ids=[f"{row[0]}-{row[1]}-kto" for row in LAYOUTS])
def test_kto_matches_single_process(family, name, nproc, overrides, kind, references, sst2, cache_dir, tmp_path):
    reference = references(family, kind)
    run = launch(
        nproc,
        kto_overrides(sst2, cache_dir, family, *kind_overrides(kind), *overrides, max_steps=STEPS),
        tmp_path / name,
        recipe=kind_recipe(family, kind),
    )
    assert run.summary["layout"]["world_size"] == nproc
    difference = assert_scores_like(run, reference)
    print(f"{family} {name} kto: largest difference {difference:.2e} over {len(run.records)} steps and held out")
