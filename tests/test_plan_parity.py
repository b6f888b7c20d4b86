"""Families made from transformers' own parallel plans (families/plans.py) train exactly like one process.

Named families (Llama, Qwen 3 with its tied embeddings and per-head q/k norms, Mistral with sliding-window masks)
under every kind of layout, both tasks between them; their TP=2 rows of both tasks are test_parity.py's (every
registered family gets them). Three further architectures, picked from transformers' configs that declare both
plans, run through `family: auto` from a checkpoint written here: Qwen 2 (biased q/k/v), StarCoder 2 (LayerNorm
with bias, GELU MLP c_fc/c_proj, tied embeddings), OLMo 2 (norms over all heads: `colwise_gather_output` and
`rowwise_split_input` in its plan). fp32, tiny models (2 layers, 4 heads, 2 key/value heads), real SST-2."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, assert_trains_like, launch, recipe, tiny_overrides

from parallel_finetune.data.prepare import column, read_glue_dir
from parallel_finetune.model import synthetic

TOLERANCE = 1e-5
PP2 = ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]
LAYOUTS = {
    "gpipe": (2, PP2 + ["pipeline_schedule=gpipe"]),
    "1f1b": (2, PP2 + ["pipeline_schedule=1f1b"]),
    "pp2_tp2": (4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
    "fsdp_dp2": (2, ["tensor_parallel_degree=1", "sharding=full", "activation_checkpointing=true"]),
    "tp2": (2, ["tensor_parallel_degree=2"]),
}
# (family, layout, task): each named family under each layout, the tasks alternating so that both are covered.
NAMED = [
    ("llama", "gpipe", "classification"),
    ("llama", "1f1b", "causal_lm"),
    ("llama", "pp2_tp2", "classification"),
    ("llama", "fsdp_dp2", "causal_lm"),
    ("qwen3", "gpipe", "causal_lm"),  # tied embeddings: the first and last stage share the gradient
    ("qwen3", "1f1b", "classification"),
    ("qwen3", "pp2_tp2", "causal_lm"),
    ("qwen3", "fsdp_dp2", "classification"),
    ("mistral", "gpipe", "classification"),
    ("mistral", "1f1b", "causal_lm"),
    ("mistral", "pp2_tp2", "causal_lm"),
    ("mistral", "fsdp_dp2", "classification"),
]


# Mistral's window narrower than the sequences (its default, 4,096, never masks a 64-token row): every stage must
# build the sliding-window mask itself.
MODEL = {"mistral": ("model_config.sliding_window=8",)}


@pytest.fixture
def reference(single_process_run, sst2, cache_dir):
    def get(family: str, task: str, extra: tuple[str, ...] = (), recipe_path: Path | None = None):
        overrides = tiny_overrides(sst2, cache_dir, task, family, max_steps=5) + list(extra)
        return single_process_run(recipe_path or recipe(family), overrides)

    return get


@pytest.mark.parametrize("family,name,task", NAMED, ids=[f"{f}-{n}-{t}" for f, n, t in NAMED])
def test_named_family_layout_matches_single_process(family, name, task, reference, sst2, cache_dir, tmp_path):
    nproc, layout = LAYOUTS[name]
    model = MODEL.get(family, ())
    single = reference(family, task, model)
    run = launch(
        nproc,
        tiny_overrides(sst2, cache_dir, task, family, max_steps=5) + list(model) + layout,
        tmp_path / name,
        recipe=recipe(family),
    )
    difference = assert_trains_like(run, single, task, TOLERANCE)
    print(f"{family} {name} {task}: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    if "pipeline_parallel_degree=2" in layout:
        assert "stage 1 (rank 1)" in run.output


LORA = ["lora_dropout=0", "lora_rank=8", "lora_alpha=16"]
# (family, task, extra): OLMo 2's q/k/v are `colwise_gather_output` and o_proj `rowwise_split_input`, so all-linear
# puts adapters on layers whose output is gathered: they stay replicated, and still train as one process does.
LORA_CASES = [
    ("llama", "classification", ()),
    ("qwen3", "causal_lm", ()),
    ("mistral", "classification", ()),
    ("olmo2", "classification", ("lora_target_modules=all-linear",)),
]


@pytest.mark.parametrize("family,task,extra", LORA_CASES, ids=[f"{f}-lora_tp2-{t}" for f, t, _ in LORA_CASES])
def test_family_lora_tp2_matches_single_process(family, task, extra, reference, sst2, cache_dir, tmp_path):
    named = (REPO / "recipes" / family).is_dir()
    lora_recipe = REPO / "recipes" / (family if named else "llama") / "lora.yaml"
    lora = LORA + list(extra) + ([] if named else [f"family={family}"])
    single = reference(family, task, tuple(lora), lora_recipe)
    run = launch(
        2,
        tiny_overrides(sst2, cache_dir, task, family, max_steps=5) + lora + ["tensor_parallel_degree=2"],
        tmp_path / "lora",
        recipe=lora_recipe,
    )
    difference = assert_trains_like(run, single, task, TOLERANCE)
    print(f"{family} lora tp2 {task}: largest loss difference {difference:.2e}")
    assert "the base is frozen" in run.output


AUTO_ARCHITECTURES = ("qwen2", "starcoder2", "olmo2")


@pytest.fixture(scope="module")
def auto_checkpoint(sst2, tmp_path_factory):
    """model type -> a written checkpoint folder (random weights, dropout off, 2 layers, GQA 4:2)."""
    sentences = column(read_glue_dir(sst2)["train"], "text")
    folders = {}

    def get(model_type: str) -> Path:
        if model_type not in folders:
            folder = tmp_path_factory.mktemp(f"auto-{model_type}") / "model"
            synthetic.write_checkpoint(folder, model_type, sentences, hidden=64, layers=2, heads=4)
            folders[model_type] = folder
        return folders[model_type]

    return get


@pytest.mark.parametrize("layout", ["tp2", "1f1b"])
@pytest.mark.parametrize("model_type", AUTO_ARCHITECTURES)
def test_family_auto_matches_single_process(model_type, layout, auto_checkpoint, reference, sst2, cache_dir, tmp_path):
    folder = auto_checkpoint(model_type)
    extra = ("family=auto", "size=full", f"model={folder}", "lr=1e-3")
    single = reference("llama", "classification", extra)
    nproc, overrides = LAYOUTS[layout]
    run = launch(
        nproc,
        tiny_overrides(sst2, cache_dir, "classification", "llama", max_steps=5) + list(extra) + overrides,
        tmp_path / layout,
        recipe=recipe("llama"),
    )
    difference = assert_trains_like(run, single, "classification", TOLERANCE)
    print(f"auto {model_type} {layout}: largest loss difference {difference:.2e}")
    assert run.summary["family"] == model_type
