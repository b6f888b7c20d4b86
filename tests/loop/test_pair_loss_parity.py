"""The reference-free pair losses (dpo_loss: simpo | orpo, loop/pair_losses.py) proven like DPO: each layout
against one process on the shipped preference sample (fp32, dropout off), the loss and every metric the loss reports
at every step and held out within 1e-5, and no reference pass in either run. A module of its own beside
test_preference.py, so that the test workers share the runs out."""

from __future__ import annotations

import pytest
from conftest import assert_one_line_per_event, launch, recipe
from test_preference import PP2, TOLERANCE, TP2, dpo_overrides

from parallel_finetune.loop.pair_losses import ORPOLoss, SimPOLoss

# The reference-free pair losses (loop/pair_losses.py), each against its own one-process run: every metric it
# reports (TRL's names) at every step and held out, within TOLERANCE. Their rewards are beta x each answer's mean
# log-probability, never 0, so rewards/accuracies has no ties and is compared too.
FREE_LAYOUTS = [
    ("tp2", 2, TP2),
    ("fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"]),
    ("pp2_1f1b", 2, PP2),
    ("accumulation2", 1, ["gradient_accumulation_steps=2"]),
    ("packed", 1, ["packing=true"]),
]
FREE_LOSSES = {
    "simpo": ["dpo_loss=simpo", "simpo_gamma=0.3"],
    "orpo": ["dpo_loss=orpo"],
}


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    """The one-process run of each loss, made on first use and shared by the module."""
    runs = {}

    def get(loss: str):
        if loss not in runs:
            overrides = dpo_overrides(sst2, cache_dir, "llama", *FREE_LOSSES[loss])
            runs[loss] = launch(1, overrides, tmp_path_factory.mktemp(f"{loss}-llama"), recipe=recipe("llama"))
        return runs[loss]

    return get


def assert_reference_free_like(run, reference, loss: str) -> float:
    """Every metric of `loss` (its own names) at every step and held out, as one process; no reference pass ran
    in either (no reference time in summary.json, no reference line in the log)."""
    names = {"simpo": SimPOLoss, "orpo": ORPOLoss}[loss].metric_names
    assert len(run.records) == len(reference.records) >= 5
    assert reference.losses[0] != reference.losses[-1], "the loss must move"
    differences = []
    for mine, theirs in zip(run.records, reference.records):
        for key in ("loss", *names):
            differences.append(abs(mine[key] - theirs[key]))
            assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE, rel=1e-6), (mine["step"], key)
    for key in ("eval_loss", *names):
        differences.append(abs(run.summary[key] - reference.summary[key]))
        assert run.summary[key] == pytest.approx(reference.summary[key], abs=TOLERANCE, rel=1e-6), key
    for done in (run, reference):
        assert done.summary["seconds"].get("reference", 0.0) == 0.0, done.summary["seconds"]
        assert "reference log-probabilities" not in done.output
    assert_one_line_per_event(run)
    return max(differences)


@pytest.mark.parametrize("loss", list(FREE_LOSSES))
@pytest.mark.parametrize("name,nproc,overrides", FREE_LAYOUTS, ids=[row[0] for row in FREE_LAYOUTS])
def test_reference_free_losses_match_single_process(
    loss, name, nproc, overrides, references, sst2, cache_dir, tmp_path
):
    """SimPO and ORPO (llama) under TP=2, FSDP DP=2, PP=2 1F1B, gradient accumulation 2 and packed pairs: ORPO's
    NLL, a token mean over the global batch's chosen rows, is the same whatever the split into ranks and
    micro-batches."""
    reference = references(loss)
    run = launch(
        nproc,
        dpo_overrides(sst2, cache_dir, "llama", *FREE_LOSSES[loss], *overrides),
        tmp_path / name,
        recipe=recipe("llama"),
    )
    difference = assert_reference_free_like(run, reference, loss)
    print(f"llama {name} {loss}: largest difference {difference:.2e} over {len(run.records)} steps")
