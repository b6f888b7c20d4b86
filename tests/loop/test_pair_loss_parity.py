"""The reference-free pair losses (dpo_loss: simpo | orpo, loop/pair_losses.py) proven like DPO: each layout
against one process on the shipped preference sample (fp32, dropout off), the loss and every metric the loss reports
at every step and held out within 1e-5, and no reference pass in either run. A module of its own beside
test_preference.py, so that the test workers share the runs out."""

from __future__ import annotations

import pytest
from conftest import assert_one_line_per_event, launch
from test_preference import FSDP_ACCUMULATION2, PP2, TOLERANCE, TP2, dpo_overrides, kind_overrides, kind_recipe

from parallel_finetune.loop.pair_losses import ORPOLoss, SimPOLoss

# The reference-free pair losses (loop/pair_losses.py), each against its own one-process run: every metric it
# reports (TRL's names) at every step and held out, within TOLERANCE. Their rewards are beta x each answer's mean
# log-probability, never 0, so rewards/accuracies has no ties and is compared too.
FREE_LAYOUTS = [
    # (family, name, processes, overrides, kind: full | lora)
    ("llama", "tp2", 2, TP2, "full"),
    ("llama", "fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"], "full"),
    ("llama", "pp2_1f1b", 2, PP2, "full"),
    ("llama", "accumulation2", 1, ["gradient_accumulation_steps=2"], "full"),
    ("llama", "packed", 1, ["packing=true"], "full"),
    ("llama", "lora_tp2", 2, TP2, "lora"),
    # one more family: its plans (q/k norms) under every layout, FSDP, accumulation and packing in one run
    ("qwen3", "tp2", 2, TP2, "full"),
    ("qwen3", "pp2_1f1b", 2, PP2, "full"),
    ("qwen3", "fsdp_dp2_accumulation2_packed", 2, [*FSDP_ACCUMULATION2, "packing=true"], "full"),
    ("qwen3", "lora_tp2", 2, TP2, "lora"),
]
FREE_LOSSES = {
    "simpo": ["dpo_loss=simpo", "simpo_gamma=0.3"],
    "orpo": ["dpo_loss=orpo"],
}


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    """The one-process run of each (loss, family, kind), made on first use and shared by the module."""
    runs = {}

    def get(loss: str, family: str, kind: str):
        key = (loss, family, kind)
        if key not in runs:
            overrides = dpo_overrides(sst2, cache_dir, family, *FREE_LOSSES[loss], *kind_overrides(kind))
            folder = tmp_path_factory.mktemp(f"{loss}-{family}-{kind}")
            runs[key] = launch(1, overrides, folder, recipe=kind_recipe(family, kind))
        return runs[key]

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
@pytest.mark.parametrize(
    "family,name,nproc,overrides,kind",
    FREE_LAYOUTS,
    ids=[name if family == "llama" else f"{family}-{name}" for family, name, *_ in FREE_LAYOUTS],  # llama's as before
)
def test_reference_free_losses_match_single_process(
    loss, family, name, nproc, overrides, kind, references, sst2, cache_dir, tmp_path
):
    """SimPO and ORPO under TP=2, FSDP DP=2, PP=2 1F1B, gradient accumulation 2, packed pairs and LoRA TP=2 (llama),
    TP=2 and LoRA TP=2 (qwen3): ORPO's NLL, a token mean over the global batch's chosen rows, is the same whatever
    the split into ranks and micro-batches."""
    reference = references(loss, family, kind)
    run = launch(
        nproc,
        dpo_overrides(sst2, cache_dir, family, *FREE_LOSSES[loss], *kind_overrides(kind), *overrides),
        tmp_path / name,
        recipe=kind_recipe(family, kind),
    )
    difference = assert_reference_free_like(run, reference, loss)
    print(f"{family} {name} {loss}: largest difference {difference:.2e} over {len(run.records)} steps")
