"""Recipe + override parsing: typed values, nesting, tiny-size overrides, and one-line errors."""

from __future__ import annotations

import pytest
from conftest import FAMILIES, RECIPE

from parallel_finetune.config import USER_KEYS
from parallel_finetune.errors import UserError
from parallel_finetune.resolve import load_config


def test_recipe_sections_and_tiny_overrides():
    full = load_config(RECIPE)
    assert (full.family, full.size, full.task, full.batch_size, full.lr) == ("gptj", "full", "classification", 32, 1e-5)
    assert full.recipe == "gptj-tp"
    tiny = load_config(RECIPE, ["size=tiny"])
    assert tiny.lr == 1e-3  # from the recipe's tiny: section
    assert load_config(RECIPE, ["size=tiny", "lr=2e-4"]).lr == 2e-4  # the command line wins


def test_a_model_override_at_tiny_size_is_refused(tmp_path):
    """size=tiny builds a model from config and reads no checkpoint, so a model= the user names with it was trained
    as the recipe's tiny model in silence (issue 54): now one line naming both keys and what to pass instead."""
    refusal = "model='./my-gptj' with size=tiny: a tiny model is built from the family's config and would not load"
    for overrides in (["size=tiny", "model=./my-gptj"], ["model=./my-gptj", "size=tiny"], ["model.model=./my-gptj"]):
        with pytest.raises(UserError) as error:
            load_config(RECIPE, [*overrides, "size=tiny"])
        message = str(error.value)
        assert refusal in message and "pass size=full (make: SIZE=full" in message and "\n" not in message
    tiny_recipe = tmp_path / "tiny.yaml"  # size=tiny from a recipe file, the model from the command line
    tiny_recipe.write_text(f"extends: {RECIPE}\nmodel:\n  size: tiny\n")
    with pytest.raises(UserError, match=f"recipe {tiny_recipe}: model='./my-gptj' with size=tiny"):
        load_config(tiny_recipe, ["model=./my-gptj"])
    # what stays valid: the recipe's own checkpoint at tiny size (its full-size default), an emptied model=, and
    # the named model at full size
    assert load_config(RECIPE, ["size=tiny"]).size == "tiny"
    assert load_config(tiny_recipe, []).size == "tiny"
    assert load_config(RECIPE, ["size=tiny", "model="]).model.source is None
    assert load_config(RECIPE, ["size=full", "model=./my-gptj"]).model.source == "./my-gptj"


@pytest.mark.parametrize(
    "override,key,value",
    [
        ("max_steps=5", "max_steps", 5),
        ("lr=1e-4", "lr", 1e-4),  # YAML reads 1e-4 as a string; the float field takes it
        ("training.lr=3e-5", "lr", 3e-5),
        ("precision=fp16", "precision", "fp16"),
        ("tensor_parallel_degree=2", "tensor_parallel_degree", 2),
        ("tensor_parallel_degree=auto", "tensor_parallel_degree", "auto"),
        ("data_dir=../shared/data/sst2", "data_dir", "../shared/data/sst2"),
        ("epochs=2", "epochs", 2.0),
        ("seed=7", "seed", 7),
        ("group_by_length=false", "group_by_length", False),
        ("max_grad_norm=null", "max_grad_norm", None),
        ("model_config.n_layer=4", "model_config", {"n_layer": 4}),
        ("model_config={n_layer: 4, n_embd: 256}", "model_config", {"n_layer": 4, "n_embd": 256}),
    ],
)
def test_overrides(override, key, value):
    assert getattr(load_config(RECIPE, [override]), key) == value


def test_every_issue_spelling_is_a_key():
    for key in (
        "size",
        "data_dir",
        "output_dir",
        "task",
        "max_steps",
        "epochs",
        "precision",
        "seed",
        "tensor_parallel_degree",
        "batch_size",
        "lr",
    ):
        assert key in USER_KEYS


@pytest.mark.parametrize(
    "override,message",
    [
        ("learning_rate=1e-4", "unknown key 'learning_rate'"),
        ("batchsize=8", "did you mean 'batch_size'?"),
        ("precision=fp8", "precision='fp8' is not valid; expected one of auto|fp16|bf16|fp32"),
        ("batch_size=big", "batch_size='big' is not valid; expected an integer"),
        ("batch_size=0", "batch_size=0 must be at least 1"),
        ("pad_to_multiple_of=0", "pad_to_multiple_of=0 must be at least 1"),
        ("task=translation", "task='translation' is not valid"),
        ("family=nonesuch", f"family='nonesuch' is not known; valid: {', '.join(sorted(FAMILIES))}"),
        ("tensor_parallel_degree=0", "tensor_parallel_degree=0 must be a positive integer"),
        ("lr", "must look like key=value"),
        ("training.nope=1", "unknown key 'nope'"),
        ("sharding=zero", "sharding='zero' is not valid; expected one of none|optimizer|full|hybrid"),
        ("shard_group_size=2", "shard_group_size=2 only applies to sharding=hybrid, not sharding=none"),
        ("activation_checkpointing=-1", "activation_checkpointing=-1 must be true, false or N >= 1"),
        ("activation_checkpointing=maybe", "activation_checkpointing='maybe' is not valid; expected true|false"),
    ],
)
def test_bad_overrides_are_one_line_errors(override, message):
    with pytest.raises(UserError) as error:
        load_config(RECIPE, [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "recipe,overrides,message",
    [
        (
            "gptj/tp.yaml",
            ["loss_chunk_tokens=256"],
            "loss_chunk_tokens=256 chunks a language model's head, and task=classification has none; drop it",
        ),
        (
            "llama/tp.yaml",
            ["task=causal_lm", "engine=deepspeed", "loss_chunk_tokens=0"],
            "loss_chunk_tokens=0 is engine=torch's (under engine=deepspeed the model computes its whole logits); "
            "drop it or use engine=torch",
        ),
        (
            "llama/dpo.yaml",
            ["num_labels=2"],
            "num_labels=2 shapes a classification head, and task=dpo trains the language-model head; drop it",
        ),
        (
            "llama/sft.yaml",
            ["problem_type=regression"],
            "problem_type='regression' shapes a classification head, and task=sft trains the language-model head",
        ),
    ],
)
def test_a_key_that_does_nothing_in_the_run_is_refused_naming_it(recipe, overrides, message):
    """Issue 54: loss_chunk_tokens under a classification head or DeepSpeed, num_labels and problem_type under a
    language-model task were taken and did nothing; their defaults (every shipped recipe's) pass."""
    with pytest.raises(UserError) as error:
        load_config(RECIPE.parents[1] / recipe, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
    load_config(RECIPE.parents[1] / recipe, overrides[:-1])  # the key at its default: the run reads as before


def test_task_must_suit_the_family():
    with pytest.raises(UserError, match="task='causal_lm' is not supported by family bert; valid: classification"):
        load_config(RECIPE.parents[1] / "bert" / "tp.yaml", ["task=causal_lm"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(UserError) as error:
        load_config(RECIPE, ["nonsense=1"])
    assert "valid keys: family, model, revision, size" in str(error.value)


def test_bad_recipe_files(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  family: gptj\n  nonsense: 1\n")
    with pytest.raises(UserError, match=r"bad.yaml section 'model': unknown key 'nonsense'"):
        load_config(bad)
    bad.write_text("family: gptj\nlr: [1\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(bad)
    flat = tmp_path / "flat.yaml"
    flat.write_text("family: gptj\nbatch_size: 8\n")
    assert load_config(flat).batch_size == 8


def test_a_recipe_extends_another(tmp_path):
    pipeline = load_config(RECIPE.parent / "pp.yaml")
    assert pipeline.recipe == "gptj-pp"
    assert (pipeline.pipeline_parallel_degree, pipeline.tensor_parallel_degree, pipeline.lr) == (4, 1, 1e-5)
    tiny = load_config(RECIPE.parent / "pp.yaml", ["size=tiny"])
    assert (tiny.pipeline_parallel_degree, tiny.lr) == (2, 1e-3)  # its own tiny section, then tp.yaml's
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {RECIPE}\nmodel_config: {{n_layer: 4}}\ntiny:\n  training:\n    lr: 5.0e-4\n")
    config = load_config(child, ["size=tiny"])
    assert (config.family, config.lr, config.model_config, config.recipe) == (
        "gptj",
        5e-4,
        {"n_layer": 4},
        "gptj-child",
    )
    child.write_text("extends: nowhere.yaml\n")
    with pytest.raises(UserError, match=r"child.yaml: extends .*nowhere.yaml: no such file"):
        load_config(child)
    child.write_text("extends: child.yaml\n")
    with pytest.raises(UserError, match="extends itself"):
        load_config(child)


@pytest.mark.parametrize(
    "recipe", sorted(str(p.relative_to(RECIPE.parents[1])) for p in RECIPE.parents[1].glob("*/*.yaml"))
)
def test_every_shipped_recipe_loads_at_both_sizes(recipe):
    for size in ("full", "tiny"):
        assert load_config(RECIPE.parents[1] / recipe, [f"size={size}"]).family == recipe.split("/")[0]


def test_linear_lr_scaling_says_what_it_did():
    scaled = load_config(RECIPE, ["size=tiny", "lr_scaling=linear", "batch_size=64"])
    assert scaled.lr == pytest.approx(2e-3)  # the tiny recipe's 1e-3 was tuned for batch 32
    assert scaled.lr_note == "lr_scaling=linear: lr 0.001 x batch_size 64 / recipe batch_size 32 = 0.002"
    assert load_config(RECIPE, ["size=tiny", "batch_size=64"]).lr == 1e-3  # off unless asked
    kept = load_config(RECIPE, ["lr_scaling=linear"])
    assert kept.lr == 1e-5 and "is the recipe's, lr 1e-05 kept" in kept.lr_note
    with pytest.raises(UserError, match="lr_scaling=linear scales the recipe's lr .* drop the lr override"):
        load_config(RECIPE, ["lr_scaling=linear", "batch_size=16", "lr=1e-4"])


def test_checkpoint_keys_are_validated():
    with pytest.raises(UserError, match="checkpoint_every=0 must be at least 1"):
        load_config(RECIPE, ["checkpoint_every=0"])
    with pytest.raises(UserError, match="checkpoint_every=5 is not supported with engine=deepspeed yet"):
        load_config(RECIPE, ["engine=deepspeed", "checkpoint_every=5"])
    assert load_config(RECIPE, ["checkpoint.resume=none"]).resume == "none"


def test_a_child_recipe_value_wins_over_the_parents_tiny_section(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {RECIPE}\ntraining:\n  lr: 2.0e-4\n  seed: 7\n")
    tiny = load_config(child, ["size=tiny"])
    assert tiny.lr == 2e-4  # tp.yaml's tiny: lr 1e-3 no longer overrides the child's own lr
    assert tiny.warmup_ratio == 0.02  # what the child leaves alone still comes from the parent's tiny:
    child.write_text(f"extends: {RECIPE}\ntraining:\n  lr: 2.0e-4\ntiny:\n  lr: 3.0e-4\n")
    assert load_config(child, ["size=tiny"]).lr == 3e-4  # the child's own tiny: wins
    assert load_config(child).lr == 2e-4


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "family: gptj\ntraining:\n  lr: 1.0e-4\n  lr: 2.0e-4\n",
            "dup.yaml line 4: key 'lr' is given twice (first at line 3)",
        ),
        (
            "family: gptj\ntraining:\n  lr: 1.0e-4\ntraining:\n  seed: 3\n",
            "dup.yaml line 4: key 'training' is given twice (first at line 2)",
        ),
        (
            "family: gptj\nlr: 1.0e-4\ntraining:\n  lr: 2.0e-4\n",
            "dup.yaml: lr is set twice (lr at line 2, training.lr at line 4)",
        ),
        (
            "family: gptj\ntiny:\n  lr: 1.0e-4\n  training:\n    lr: 2.0e-4\n",
            "dup.yaml (tiny): lr is set twice (lr at line 3, training.lr at line 5)",
        ),
    ],
)
def test_duplicate_keys_are_errors_naming_the_line(tmp_path, text, message):
    (tmp_path / "dup.yaml").write_text(text)
    with pytest.raises(UserError) as error:
        load_config(tmp_path / "dup.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_duplicate_keys_in_an_override_are_errors():
    with pytest.raises(
        UserError,
        match=r"override 'model_config=\{n_layer: 2, n_layer: 4\}': line 1: key 'n_layer' "
        "is given twice",
    ):
        load_config(RECIPE, ["model_config={n_layer: 2, n_layer: 4}"])
