"""The exported hf/ folder is a plain transformers model with the trained (sharded) model's outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, launch, python, recipe, tiny_overrides
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

WORKER = str(REPO / "tests" / "workers" / "export_logits.py")
LOADERS = {"classification": AutoModelForSequenceClassification, "causal_lm": AutoModelForCausalLM}


TP2 = ["tensor_parallel_degree=2"]
PP2 = ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]


@pytest.mark.parametrize(
    "family,task,layout",
    [
        ("gptj", "classification", TP2),
        ("gptj", "causal_lm", TP2),
        ("gpt2", "classification", TP2),
        ("gpt2", "causal_lm", TP2),
        ("gptneo", "classification", TP2),
        ("bert", "classification", TP2),
        # stages on two ranks, the tied GPT-2 embedding / LM head on both: the export writes one model
        ("gpt2", "causal_lm", PP2),
        ("bert", "classification", PP2),
        # families made from transformers' plans: Llama's sharded embedding; Qwen 3's tied one on both stages
        ("llama", "classification", TP2),
        ("qwen3", "causal_lm", PP2),
    ],
    ids=lambda value: "pp2" if value == PP2 else "tp2" if value == TP2 else None,
)
def test_export_reloads_with_same_logits(family, task, layout, sst2, cache_dir, tmp_path):
    launch(
        2,
        tiny_overrides(sst2, cache_dir, task, family, max_steps=3, export="true") + layout,
        tmp_path,
        script=WORKER,
        recipe=recipe(family),
    )
    saved = torch.load(tmp_path / "trained_logits.pt", weights_only=True)
    model = LOADERS[task].from_pretrained(tmp_path / "hf")
    model.eval()
    with torch.no_grad():
        logits = model(**saved["batch"]).logits
    assert torch.allclose(logits, saved["logits"], atol=1e-5), (logits - saved["logits"]).abs().max()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("a fine film")["input_ids"]
    if family == "gpt2":
        # Back to transformers' own layout: Conv1D [in, out] weights and one fused c_attn.
        assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
        assert model.transformer.h[0].attn.c_attn.weight.shape == (128, 3 * 128)
    if task == "causal_lm":
        assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr() or family == "gptj"
        with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as weights:
            if family == "gpt2":  # tied: saved once
                assert "lm_head.weight" not in weights.keys()
            embedding = weights.get_tensor(
                next(k for k in weights.keys() if k.endswith(("wte.weight", "embed_tokens.weight")))
            )
            if "lm_head.weight" in weights.keys() and family != "gptj":  # tied, saved twice: the same values
                assert torch.equal(weights.get_tensor("lm_head.weight"), embedding)


SAVE_BOTH_WAYS = """
import sys
from pathlib import Path
import torch
from parallel_finetune.families import get_family
from parallel_finetune.model.pretrained import save_model

family = get_family("gptj")
torch.manual_seed(0)
model = family.model_classes["causal_lm"](family.tiny_config(8192, 64))
out = Path(sys.argv[1])
save_model(model, out / "ours")
print("deepspeed imported:", "deepspeed" in sys.modules)
model.save_pretrained(out / "transformers")
"""


def test_an_export_writes_what_save_pretrained_writes_without_importing_deepspeed(tmp_path):
    """transformers' save_pretrained unwraps through accelerate, which imports deepspeed when installed (seconds of
    imports per export); save_model skips that unwrapping and writes the same bytes."""
    script = tmp_path / "save_both_ways.py"
    script.write_text(SAVE_BOTH_WAYS)
    done = python(str(script), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "deepspeed imported: False" in done.stdout
    ours, theirs = tmp_path / "ours", tmp_path / "transformers"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for file in theirs.iterdir():
        assert (ours / file.name).read_bytes() == file.read_bytes(), file.name
