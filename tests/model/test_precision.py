"""fp16 loss scaling: one rank's overflow makes every rank skip the step and halve the scale."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, launch, tiny_overrides

WORKER = str(REPO / "tests" / "workers" / "inject_overflow.py")


# The planted inf sits in the final LayerNorm's gradient of the last rank: under pipeline parallelism that rank
# holds the last stage, and the others must learn of the overflow across the pipeline (and tensor) groups.
@pytest.mark.parametrize(
    "nproc,layout",
    [
        (2, ["tensor_parallel_degree=2"]),
        # The inf is planted after the backward; overlapped buckets were summed during it and are written back
        # over it, so this row sums after the backward (an overflow inside the backward is in the sum either way).
        (2, ["tensor_parallel_degree=1", "overlap_gradients=false"]),
        # Overlapped: the inf enters during the backward, before its bucket is summed (INJECT_DURING_BACKWARD).
        (2, ["tensor_parallel_degree=1", "overlap_gradients=true", "gradient_bucket_mib=0.25"]),
        (2, ["tensor_parallel_degree=1", "sharding=optimizer"]),
        (2, ["tensor_parallel_degree=1", "sharding=full"]),
        (2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]),
        (4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
    ],
    ids=[
        "tp2",
        "dp2",
        "dp2_overlap_inf_in_backward",
        "optimizer_dp2",
        "full_dp2",
        "pp2_last_stage",
        "pp2_tp2_last_stage",
    ],
)
def test_overflow_on_one_rank_skips_everywhere(nproc, layout, sst2, cache_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("INJECT_RANK", str(nproc - 1))
    monkeypatch.setenv("INJECT_STEP", "3")
    monkeypatch.setenv("INJECT_DURING_BACKWARD", "1" if "overlap_gradients=true" in layout else "0")
    overrides = tiny_overrides(
        sst2,
        cache_dir,
        precision="fp16",
        max_steps=5,
        batch_size=8,
        max_length=32,
        initial_loss_scale=1024,
        loss_scale_growth_interval=100,
    )
    launch(nproc, overrides + layout, tmp_path, script=WORKER)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rank in ranks:
        history = rank["history"]
        assert [r["skipped"] for r in history] == [False, False, True, False, False]
        assert [r["loss_scale"] for r in history] == [1024, 1024, 1024, 512, 512]
        assert rank["final_scale"] == 512
        assert rank["params_unchanged_at_injected_step"]
        assert all(r["loss"] == r["loss"] and r["loss"] < 20 for r in history), "no NaN/inf losses"
        assert history[2]["grad_norm"] is None  # a skipped step reports no norm
    timing = ("step_time_s", "samples_per_s", "tokens_per_s", "tflops_per_device", "mfu")
    decisions = [[{k: v for k, v in r.items() if k not in timing} for r in rank["history"]] for rank in ranks]
    assert all(d == decisions[0] for d in decisions), "every rank logged the same steps, losses, norms and scales"


@pytest.mark.parametrize("family", ["gpt2", "gptneo", "bert", "llama", "qwen3", "mistral"])
def test_fp16_loss_scaling_runs_for_every_family(family, sst2, cache_dir, tmp_path):
    from conftest import recipe

    overrides = tiny_overrides(
        sst2,
        cache_dir,
        "classification",
        family,
        precision="fp16",
        max_steps=6,
        batch_size=8,
        max_length=32,
        initial_loss_scale=1024,
        loss_scale_growth_interval=2,
    )
    run = launch(2, overrides + ["tensor_parallel_degree=2"], tmp_path, recipe=recipe(family))
    scale, clean = 1024.0, 0
    for record in run.records:
        assert record["loss"] is not None and record["loss"] < 20, record
        assert record["loss_scale"] == scale, (record, scale)
        if record["skipped"]:
            scale, clean = scale / 2, 0
        else:
            assert record["grad_norm"] is not None
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
    assert run.summary["precision"] == "fp16"
    assert run.summary["skipped_steps"] < len(run.records)


@pytest.mark.parametrize(
    "capability,expected", [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((8, 6), "bf16"), ((9, 0), "bf16")]
)
def test_auto_is_bf16_from_compute_capability_8_else_fp16(capability, expected, monkeypatch):
    """V100 (7.0) and T4 (7.5) have no bf16 tensor cores: fp16 with loss scaling; A100 (8.0) on: bf16. No GPU here,
    so the capability is faked; what a CPU gets is unchanged."""
    import torch

    from parallel_finetune.model.precision import cpu_has_bf16, resolve_precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_precision("auto", torch.device("cuda")) == expected
    assert resolve_precision("fp16", torch.device("cuda")) == "fp16"  # what a recipe names is kept
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if cpu_has_bf16() else "fp32")


@pytest.mark.parametrize("family", ["gptj", "gpt2", "gptneo", "bert", "llama", "qwen3", "mistral"])
def test_recipes_name_their_precision(family):
    """The seed families' recipes keep the fp16 they were tuned in on GPUs (auto at tiny size, on a CPU); the newer
    families' bf16 checkpoints train under auto (bf16 from an A100 on)."""
    from parallel_finetune.resolve import load_config

    full = load_config(REPO / "recipes" / family / "tp.yaml").precision
    tiny = load_config(REPO / "recipes" / family / "tp.yaml", ["size=tiny"]).precision
    assert (full, tiny) == (("auto", "auto") if family in ("llama", "qwen3", "mistral") else ("fp16", "auto"))
