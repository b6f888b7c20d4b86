"""The exported hf/ folder is a plain transformers model with the trained model's outputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import REPO, launch, tiny_overrides

WORKER = str(REPO / "tests" / "workers" / "export_logits.py")
LOADERS = {"classification": AutoModelForSequenceClassification, "causal_lm": AutoModelForCausalLM}


@pytest.mark.parametrize("task", ["classification", "causal_lm"])
def test_export_from_tp2_reloads_with_same_logits(task, sst2, cache_dir, tmp_path):
    launch(2, tiny_overrides(sst2, cache_dir, task, max_steps=3) + ["tensor_parallel_degree=2"], tmp_path,
           script=WORKER)
    saved = torch.load(tmp_path / "trained_logits.pt", weights_only=True)
    model = LOADERS[task].from_pretrained(tmp_path / "hf")
    model.eval()
    with torch.no_grad():
        logits = model(**saved["batch"]).logits
    assert torch.allclose(logits, saved["logits"], atol=1e-5), (logits - saved["logits"]).abs().max()
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("a fine film")["input_ids"]
