"""Whole runs of the CUDA branch of packed attention on the CPU (PARALLEL_FINETUNE_KERNEL_STANDINS=1: the strict
stand-in of flash's varlen_attn, model/standins.py), the way the sft and dpo recipes run on GPUs: bf16 autocast over
fp32 weights, packed batches, activation checkpointing on every block, one process, TP=2 and FSDP DP=2, and packed
DPO pairs. Each run is held to the dense-mask run of the same rows (the path CPUs take) within bf16's resolution
(tests/model/test_attention.py says why 1e-2 relative), and says in one line which attention it took (where the
mask stays and why, fp32 among them, is test_attention.py's, in-process)."""

from __future__ import annotations

import pytest
from conftest import launch, recipe
from test_chat import sft_run_overrides
from test_preference import dpo_overrides

STANDINS = {"PARALLEL_FINETUNE_KERNEL_STANDINS": "1"}
BF16 = 1e-2
GPU_LIKE = ["precision=bf16", "packing=true", "activation_checkpointing=true"]
LAYOUTS = {
    "one_process": (1, []),
    "tp2": (2, ["tensor_parallel_degree=2"]),
    "fsdp_dp2": (2, ["tensor_parallel_degree=1", "sharding=full"]),
}


@pytest.fixture(scope="module")
def dense_sft(sst2, cache_dir, tmp_path_factory):
    """The one-process packed sft run on the dense mask (no stand-ins: the CPU's path)."""
    overrides = sft_run_overrides(sst2, cache_dir, "llama", *[]) + GPU_LIKE
    run = launch(1, overrides, tmp_path_factory.mktemp("dense"), recipe=recipe("llama"))
    assert "packing: a dense 4-D attention mask per packed sequence (varlen attention is CUDA's)" in run.output
    return run


def _close(run, reference) -> float:
    assert len(run.losses) == len(reference.losses) == 6
    worst = max(abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses))
    assert worst < BF16, (run.losses, reference.losses)
    return worst


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_sft_on_varlen_trains_like_the_dense_mask(layout, dense_sft, sst2, cache_dir, tmp_path):
    nproc, overrides = LAYOUTS[layout]
    run = launch(
        nproc,
        sft_run_overrides(sst2, cache_dir, "llama") + GPU_LIKE + overrides,
        tmp_path / layout,
        recipe=recipe("llama"),
        env=STANDINS,
    )
    assert "CUDA-only kernels run as strict CPU stand-ins" in run.output
    assert "packing: varlen attention over each packed row (no dense mask)" in run.output
    print(f"varlen sft {layout}: largest relative loss difference to the dense mask {_close(run, dense_sft):.2e}")


def test_packed_dpo_pairs_on_varlen_train_like_the_dense_mask(sst2, cache_dir, tmp_path):
    overrides = dpo_overrides(sst2, cache_dir, "llama", *GPU_LIKE)
    dense = launch(1, overrides, tmp_path / "dense", recipe=recipe("llama"))
    run = launch(1, overrides, tmp_path / "varlen", recipe=recipe("llama"), env=STANDINS)
    assert "packing: varlen attention over each packed row (no dense mask)" in run.output
    print(f"varlen dpo: largest relative loss difference to the dense mask {_close(run, dense):.2e}")
