"""Families made from transformers' own parallel plans (families/plans.py: llama, qwen3, mistral, any model type
with plans, `family: auto`) beyond training parity (tests/test_plan_parity.py): the exported hf/ reloads with
transformers, and the LoRA adapter with peft, to the trained model's logits (Qwen 3's tied embeddings stay tied);
what no plan covers is refused in one line, by load_config, `--check` and the family itself."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REPO, check, launch, recipe, sst2_head, tiny_overrides
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from parallel_finetune.errors import UserError
from parallel_finetune.families import get_family
from parallel_finetune.families.plans import PlanFamily
from parallel_finetune.model import synthetic
from parallel_finetune.model.load import load_model
from parallel_finetune.resolve import load_config
from parallel_finetune.train import main

WORKER = str(REPO / "tests" / "workers" / "export_logits.py")
TP2 = ["tensor_parallel_degree=2"]
PP2 = ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]
ATOL = 1e-5


def trained_logits_difference(model, run_dir) -> float:
    """The largest difference between `model`'s logits and those the trained (sharded) run saved on its batch."""
    saved = torch.load(run_dir / "trained_logits.pt", weights_only=True)
    with torch.no_grad():
        logits = model.eval()(**saved["batch"]).logits
    assert logits.shape == saved["logits"].shape
    return (logits - saved["logits"]).abs().max().item()


def test_lora_adapter_reloads_with_peft(sst2, cache_dir, tmp_path):
    """A TP=2 Llama LoRA run: adapter/ (peft's format) on base/ gives the trained logits."""
    from peft import PeftModel

    lora = ["lora_dropout=0", "lora_rank=8", "lora_alpha=16"]
    launch(
        2,
        tiny_overrides(sst2, cache_dir, "classification", "llama", max_steps=3, export="true") + lora + TP2,
        tmp_path,
        script=WORKER,
        recipe=REPO / "recipes" / "llama" / "lora.yaml",
    )
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    difference = trained_logits_difference(model, tmp_path)
    print(f"llama lora tp2: peft-reloaded logits within {difference:.1e} of the trained ones")
    assert difference < ATOL
    with safe_open(tmp_path / "adapter" / "adapter_model.safetensors", "pt") as adapter:
        keys = list(adapter.keys())
        trained_b = [adapter.get_tensor(k).abs().sum().item() for k in keys if "lora_B" in k]
    # the recipe's targets, column-wise (B sharded under TP) and row-wise (A sharded) alike
    assert {k.split(".")[-3] for k in keys if ".lora_" in k} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert trained_b and all(b > 0 for b in trained_b)  # every B trained away from zero


# --- refusals: one line each ---


def assert_one_line(exc: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture(scope="module")
def small_data(sst2, tmp_path_factory):
    """The first SST-2 rows: enough for `--check` to read and validate, fast."""
    return sst2_head(sst2, tmp_path_factory.mktemp("sst2-head"), 200, 32)


@pytest.fixture(scope="module")
def written(small_data, tmp_path_factory):
    """family or model type -> a small checkpoint folder written by synthetic.write_checkpoint."""
    sentences = [line.rsplit("\t", 1)[0] for line in (small_data / "train.tsv").read_text().splitlines()[1:]]
    folders = {}

    def get(name: str):
        if name not in folders:
            folders[name] = tmp_path_factory.mktemp(f"written-{name}") / "model"
            synthetic.write_checkpoint(folders[name], name, sentences, hidden=64, layers=2, heads=4, vocab_size=512)
        return folders[name]

    return get


def test_family_auto_refuses_an_architecture_without_plans(small_data, cache_dir, tmp_path):
    """OPT ships no base_model_tp_plan: load_config and `--check` both say so in the same line."""
    from transformers import OPTConfig, OPTForCausalLM

    folder = tmp_path / "opt"
    opt = OPTConfig(
        vocab_size=64, hidden_size=16, word_embed_proj_dim=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2
    )
    OPTForCausalLM(opt).save_pretrained(folder)
    overrides = ["family=auto", "size=full", f"model={folder}", f"data_dir={small_data}", f"cache_dir={cache_dir}"]
    with pytest.raises(UserError) as exc:
        load_config(recipe("llama"), overrides)
    message = assert_one_line(exc, "family=auto", "OPTConfig (opt) declares no base_model_tp_plan", str(folder))
    checked = check(*overrides, f"output_dir={tmp_path / 'run'}", recipe=recipe("llama"))
    assert checked.returncode == 2 and checked.stderr == f"error: {message}\n", checked.stderr


def test_family_auto_needs_a_checkpoint():
    with pytest.raises(UserError) as exc:
        load_config(recipe("llama"), ["family=auto", "size=tiny"])
    assert_one_line(exc, "family=auto reads model_type from a checkpoint's config.json", "family=llama")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_plans_are_refused_under_tp(model_type):
    family = get_family(model_type)
    config = family.tiny_config(256, 128)
    with pytest.raises(UserError) as exc:
        family.check_tp(config, 2)
    assert_one_line(exc, f"family={model_type}", "mixture-of-experts", "moe_tp_experts", "tensor_parallel_degree=1")
    family.check_tp(config, 1)  # without TP the model's own forward runs: nothing to refuse


def test_mixture_of_experts_refused_by_check(small_data, cache_dir, tmp_path, capsys):
    common = [f"data_dir={small_data}", f"cache_dir={cache_dir}", f"output_dir={tmp_path}", "size=tiny"]
    argv = ["--check", "--nproc", "2", str(recipe("llama")), "family=mixtral", "tensor_parallel_degree=2", *common]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: family=mixtral: ") and "mixture-of-experts" in err, err


@pytest.mark.parametrize(
    "model_type,style,key",
    [
        ("minicpm3", "mla_kv_a_proj", "layers.*.self_attn.kv_a_proj_with_mqa"),  # a dense model's own plan
        ("doge", "embedding_rowwise", "layers.*.mlp.down_embed"),
    ],
)
def test_an_unimplemented_style_is_refused_by_name(model_type, style, key):
    family = get_family(model_type)
    with pytest.raises(UserError) as exc:
        family.check_tp(family.config_class(), 2)
    assert_one_line(exc, f"names style {style!r} for {key}", "does not implement", "tensor_parallel_degree=1")


def test_an_unimplemented_style_of_a_modified_plan_is_refused_by_name():
    from transformers import LlamaConfig

    from parallel_finetune.families.plans import PlanFamily

    class PackedLlamaConfig(LlamaConfig):
        base_model_tp_plan = {**LlamaConfig.base_model_tp_plan, "layers.*.mlp.gate_up_proj": "packed_colwise"}

    family = PlanFamily(PackedLlamaConfig, name="packed_llama")
    with pytest.raises(UserError) as exc:
        family.check_tp(family.tiny_config(256, 128), 2)
    assert_one_line(exc, "family=packed_llama: PackedLlamaConfig's", "'packed_colwise' for layers.*.mlp.gate_up_proj")


def test_tp_degree_must_divide_the_key_value_heads(small_data, cache_dir, tmp_path, capsys):
    """Grouped-query attention: 8 query heads but 2 key/value heads, so TP=4 cannot split them."""
    message = "tensor_parallel_degree=4 does not divide llama num_key_value_heads=2; valid degrees: 1, 2"
    family = get_family("llama")
    config = family.sized_config(256, 128, hidden=128, layers=2, heads=8)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 2)
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        family.check_tp(config, 4)
    family.check_tp(config, 2)
    common = [f"data_dir={small_data}", f"cache_dir={cache_dir}", f"output_dir={tmp_path}", "size=tiny"]
    assert main(["--check", "--nproc", "4", str(recipe("llama")), "tensor_parallel_degree=4", *common]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_check_pipeline_refuses_a_forward_that_does_more_than_its_plan(small_data, cache_dir, tmp_path, capsys):
    """Granite scales its embeddings and its logits in the model's forward, outside the modules of its pp plan."""
    family = get_family("granite")
    config = family.tiny_config(256, 128)
    config.embedding_multiplier, config.logits_scaling = 12.0, 8.0  # as the published Granite models have them
    family.set_task(config, "causal_lm", 0)
    with pytest.raises(UserError) as exc:
        family.check_pipeline(config, "causal_lm")
    message = assert_one_line(
        exc,
        "family=granite: GraniteForCausalLM's forward does more than its pipeline plan",
        "pipeline_parallel_degree=1",
    )
    common = [f"data_dir={small_data}", f"cache_dir={cache_dir}", f"output_dir={tmp_path}", "size=tiny"]
    argv = ["--check", "--nproc", "2", str(recipe("llama")), "family=granite", "task=causal_lm", *PP2, *common]
    assert main([*argv, "model_config.logits_scaling=8.0"]) == 2  # refused before any process starts
    assert capsys.readouterr().err.startswith(f"error: {message.split(' (a shrunk copy')[0]}")
    assert main(argv) == 0  # Granite's default multipliers are 1: the plan is the forward
    classifier = ["--check", "--nproc", "2", str(recipe("llama")), "task=classification", *PP2, *common]
    assert main(classifier) == 0  # checked before the tokenizer gives the config its padding id


def test_check_pipeline_sees_a_soft_cap_the_pieces_would_miss(monkeypatch):
    """Gemma 2 caps its logits at 30 after the head; random weights give logits far below that, so the check scales
    the head up: pieces without the cap are refused, with it (plans.py) they pass."""
    family = get_family("gemma2")
    config = family.config_class()
    family.set_task(config, "causal_lm", 0)
    family.check_pipeline(config, "causal_lm")
    uncapped = PlanFamily(family.config_class, name="gemma2_uncapped")
    monkeypatch.setattr(uncapped, "pipeline_head", lambda model, hidden, mask: model.lm_head(model.model.norm(hidden)))
    with pytest.raises(UserError) as exc:
        uncapped.check_pipeline(config, "causal_lm")
    assert_one_line(exc, "Gemma2ForCausalLM's forward does more than its pipeline plan")


def test_pipelines_are_refused_without_a_pp_plan():
    family = get_family("nemotron")  # a tensor-parallel plan only
    with pytest.raises(UserError) as exc:
        family.check_pipeline(family.tiny_config(256, 128), "causal_lm")
    assert_one_line(exc, "family=nemotron: transformers' NemotronConfig declares no base_model_pp_plan", "=1")


@pytest.mark.parametrize(
    "model_type", ["llama", "qwen3", "mistral", "qwen2", "starcoder2", "olmo2", "gemma3_text", "phi3", "gemma2"]
)
def test_check_pipeline_passes_where_the_plan_is_the_forward(model_type):
    family = get_family(model_type)
    assert family.tasks
    for task in family.tasks:
        config = family.config_class()  # the published defaults: every architecture flag as released
        family.set_task(config, task, 0)
        family.check_pipeline(config, task)


@pytest.mark.parametrize(
    "name,family", [("qwen2", "qwen2"), ("llama", "llama"), ("gpt2", "gpt2"), ("bert", "bert"), ("gptneo", "gptneo")]
)
def test_family_auto_names_the_family_of_a_written_checkpoint(name, family, written, small_data, cache_dir):
    """A model type with plans is its own family; one a hand-written family covers gets that family's name
    (gpt_neo -> gptneo)."""
    folder = written(name)
    config = load_config(
        recipe("llama"),
        ["family=auto", "size=full", f"model={folder}", f"data_dir={small_data}", f"cache_dir={cache_dir}"],
    )
    assert config.family == family
    assert config.recipe == f"{family}-tp"


@pytest.mark.parametrize("model_type,layers", [("qwen3", 4), ("gemma3_text", 7), ("gemma3_text", 1)])
def test_a_layer_count_override_resizes_layer_types(model_type, layers):
    """model_config.num_hidden_layers on a config that lists each layer's attention kind: the list follows (the
    first layers' kinds, then the config class's own rule), so every block finds its entry."""
    family = get_family(model_type)
    default = family.hf_config(None, "tiny", 256, 128, {})
    config = family.hf_config(None, "tiny", 256, 128, {"num_hidden_layers": layers})
    rule = family.config_class(**{**default.to_dict(), "num_hidden_layers": 8, "layer_types": None}).layer_types
    assert config.layer_types == rule[:layers]
    assert len(family.blocks(family.build("causal_lm", config))) == layers


# --- mixture-of-experts checkpoints: experts stored one per expert, as on the Hub ---


def tiny_moe(model_type: str):
    """A tiny transformers mixture-of-experts causal LM (4 experts, 2 per token), randomly initialised."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if model_type == "mixtral":
        return MixtralForCausalLM(MixtralConfig(intermediate_size=48, num_local_experts=4, **common))
    config = Qwen2MoeConfig(
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        **common,
    )
    return Qwen2MoeForCausalLM(config)


# One expert's tensors in the Hub layout (what real Mixtral and Qwen2-MoE checkpoints hold) and the router's key
HUB_EXPERT_KEYS = {
    "mixtral": ("block_sparse_moe.experts.3.w1.weight", "block_sparse_moe.gate.weight"),
    "qwen2_moe": ("mlp.experts.3.gate_proj.weight", "mlp.gate.weight"),
}


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_checkpoint_loads_its_experts(model_type, small_data, cache_dir, tmp_path):
    """family: auto, size=full, TP=1 on a checkpoint whose experts are stored one per expert (transformers'
    save_pretrained writes that Hub layout): every parameter, the fused experts (gate_up_proj, down_proj) and the
    router included, equals what transformers' from_pretrained loads, through transformers' own conversion."""
    torch.manual_seed(0)
    folder = tmp_path / model_type
    tiny_moe(model_type).save_pretrained(folder)
    with safe_open(folder / "model.safetensors", "pt") as files:
        keys = list(files.keys())
    expert, router = HUB_EXPERT_KEYS[model_type]
    assert f"model.layers.1.{expert}" in keys and f"model.layers.1.{router}" in keys
    assert not any("gate_up_proj" in key for key in keys)  # the per-expert layout, not the model's fused one
    overrides = ["family=auto", "size=full", f"model={folder}", "task=causal_lm", "tensor_parallel_degree=1"]
    config = load_config(recipe("llama"), [*overrides, f"data_dir={small_data}", f"cache_dir={cache_dir}"])
    assert config.family == model_type
    family = get_family(config.family)
    hf_config = family.config_for(
        model=config.model, head="causal_lm", max_length=config.max_length, tokenizer_size=0, pad_token_id=0
    )
    loaded = load_model(family, config.task, hf_config, config.model.model, seed=config.seed).model.state_dict()
    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(loaded) == set(expected)
    fused = [
        name for name in expected if name.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"))
    ]
    assert len(fused) == 3 * 2  # both layers' experts and routers
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
