"""LoRA (peft=lora) under every parallel layout trains like one process; the base stays bit-identical; the adapter
exports in peft's format and reloads with peft to the trained model's logits; a LoRA checkpoint resumes exactly.

fp32, tiny models, real SST-2, adapter dropout off (dropout draws differ on differently sharded tensors)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, assert_trains_like, launch, tiny_overrides
from safetensors.torch import load_file

TOLERANCE = 1e-5
WORKER = str(REPO / "tests" / "workers" / "export_logits.py")
# all-linear: column-wise (B sharded) and row-wise (A sharded) adapters both
LORA = ["lora_dropout=0", "lora_rank=8", "lora_alpha=16", "lora_target_modules=all-linear"]


def lora_recipe(family: str):
    return REPO / "recipes" / family / "lora.yaml"


def lora_overrides(sst2, cache_dir, family: str, *extra: str) -> list[str]:
    return tiny_overrides(sst2, cache_dir, "classification", family) + LORA + list(extra)


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    """One-process LoRA runs, one per family, made on first use."""
    runs = {}

    def get(family: str):
        if family not in runs:
            runs[family] = launch(
                1,
                lora_overrides(sst2, cache_dir, family),
                tmp_path_factory.mktemp(f"lora-single-{family}"),
                recipe=lora_recipe(family),
            )
        return runs[family]

    return get


TP2 = ["tensor_parallel_degree=2"]
PP2 = ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]
CASES = [
    ("gptj", "tp2", TP2 + ["checkpoint_every=3"]),
    ("gptj", "pp2", PP2),
    ("gptj", "fsdp_dp2_checkpointing", ["tensor_parallel_degree=1", "sharding=full", "activation_checkpointing=true"]),
    ("gptj", "zero1_dp2", ["tensor_parallel_degree=1", "sharding=optimizer"]),
    ("gpt2", "tp2", TP2),
    ("gpt2", "pp2", PP2),
    ("bert", "tp2", TP2),
]
_runs: dict = {}


@pytest.mark.parametrize("family,name,layout", CASES, ids=[f"{f}-{n}" for f, n, _ in CASES])
def test_lora_layout_matches_single_process(family, name, layout, references, sst2, cache_dir, tmp_path_factory):
    reference = references(family)
    run = launch(
        2,
        lora_overrides(sst2, cache_dir, family, *layout),
        tmp_path_factory.mktemp(f"lora-{family}-{name}"),
        recipe=lora_recipe(family),
    )
    _runs[(family, name)] = run
    difference = assert_trains_like(run, reference, "classification", TOLERANCE)
    print(f"{family} {name}: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    assert "trainable" in run.output and "the base is frozen" in run.output
    per_rank = run.summary["state_bytes_per_rank"]
    assert all(rank["optimizer"] > 0 for rank in per_rank)


# Issue 28: a trained head wider than SST-2's (5 classes; GPT-J's `score`) and sentence pairs (BERT's token type
# ids) under LoRA, from the user's CSV files of the `derived_tasks` fixture (real SST-2 rows).
TASK_CASES = [
    ("gptj", "five_classes", "tp2", TP2),
    ("gptj", "five_classes", "pp2", PP2),
    ("bert", "pairs", "tp2", TP2),
]


@pytest.mark.parametrize("family,task,name,layout", TASK_CASES, ids=[f"{f}-{n}-{t}" for f, t, n, _ in TASK_CASES])
def test_lora_task_matches_single_process(
    family, task, name, layout, derived_tasks, single_process_run, sst2, cache_dir, tmp_path
):
    overrides = lora_overrides(sst2, cache_dir, family, *derived_tasks[task])
    reference = single_process_run(lora_recipe(family), overrides)
    run = launch(2, overrides + layout, tmp_path / name, recipe=lora_recipe(family))
    difference = assert_trains_like(run, reference, "classification", TOLERANCE)
    print(f"{family} {name} {task}: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    assert "macro_f1" in run.summary if task == "five_classes" else "f1" in run.summary
    assert "the base is frozen" in run.output


def test_lora_optimizer_state_is_under_5_percent_of_full_fine_tuning(references, sst2, cache_dir, tmp_path):
    """Per-rank tensor accounting (TP=2, tiny GPT-J): AdamW state exists only for adapters and head; frozen
    weights have no gradient."""
    lora = _runs.get(("gptj", "tp2")) or launch(
        2, lora_overrides(sst2, cache_dir, "gptj", *TP2), tmp_path / "lora", recipe=lora_recipe("gptj")
    )
    full = launch(
        2,
        tiny_overrides(sst2, cache_dir, "classification", "gptj", max_steps=1) + TP2,
        tmp_path / "full",
        recipe=REPO / "recipes" / "gptj" / "tp.yaml",
    )
    for mine, theirs in zip(lora.summary["state_bytes_per_rank"], full.summary["state_bytes_per_rank"]):
        ratio = mine["optimizer"] / theirs["optimizer"]
        print(f"optimizer bytes per rank: LoRA {mine['optimizer']:,} vs full {theirs['optimizer']:,} ({ratio:.2%})")
        assert ratio <= 0.05
        assert mine["grads"] <= 0.05 * theirs["grads"]
        assert mine["params"] > 0.95 * theirs["params"]  # the base is all there (fp32 in an fp32 run)


def test_lora_resumes_exactly(references, sst2, cache_dir, tmp_path):
    """The TP=2 run checkpointed at step 3: only adapters and head were written, and continuing from there gives
    the same losses bit for bit."""
    run = _runs.get(("gptj", "tp2")) or launch(
        2,
        lora_overrides(sst2, cache_dir, "gptj", *TP2, "checkpoint_every=3"),
        tmp_path / "first",
        recipe=lora_recipe("gptj"),
    )
    step3 = run.output_dir / "checkpoints" / "step-00000003"
    state = json.loads((step3 / "trainer_state.json").read_text())
    written = state["lora"]["written"]
    assert written and all(".lora_" in name or name.startswith("score.") for name in written)
    assert state["lora"]["base"].startswith("tiny gptj")
    resumed = launch(
        2,
        lora_overrides(sst2, cache_dir, "gptj", *TP2, f"resume={step3}"),
        tmp_path / "resumed",
        recipe=lora_recipe("gptj"),
    )
    assert resumed.losses == run.losses[3:]
    assert resumed.summary["accuracy"] == run.summary["accuracy"]


@pytest.mark.parametrize("family", ["gptj", "gpt2"])
def test_lora_export_loads_with_peft_and_merges(family, sst2, cache_dir, tmp_path):
    """adapter/ (peft format) onto base/ gives the trained TP=2 model's logits; hf/ (merged) too, and its weights
    are base + alpha/r * B·A; the base's weights, its trained score head included (issue 54), are bit-identical to
    the initial ones."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    launch(
        2,
        lora_overrides(sst2, cache_dir, family, *TP2, "max_steps=3", "export=true", "lora_export_merged=true"),
        tmp_path,
        script=WORKER,
        recipe=lora_recipe(family),
    )
    saved = torch.load(tmp_path / "trained_logits.pt", weights_only=True)
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    _check_base_unchanged(family, "classification", tmp_path, base)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    model.eval()
    with torch.no_grad():
        logits = model(**saved["batch"]).logits
    assert torch.allclose(logits, saved["logits"], atol=1e-5), (logits - saved["logits"]).abs().max()
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.allclose(merged(**saved["batch"]).logits, saved["logits"], atol=1e-5)
    # merged = base + scaling * B·A, module by module, in transformers' own layout (GPT-2: Conv1D, fused c_attn)
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    base_weights = load_file(tmp_path / "base" / "model.safetensors")
    merged_weights = load_file(tmp_path / "hf" / "model.safetensors")
    modules = sorted({k.removeprefix("base_model.model.").split(".lora_")[0] for k in adapter if ".lora_" in k})
    assert modules
    for module in modules:
        a = adapter[f"base_model.model.{module}.lora_A.weight"]
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        leaf = module.rsplit(".", 1)[-1]
        rank, alpha = (
            config["rank_pattern"].get(leaf, config["r"]),
            config["alpha_pattern"].get(leaf, config["lora_alpha"]),
        )
        delta = (alpha / rank) * (b @ a)
        if family == "gpt2":
            delta = delta.t()  # Conv1D holds [in, out]
        expected = base_weights[f"{module}.weight"] + delta
        assert torch.allclose(merged_weights[f"{module}.weight"], expected, atol=1e-6), module
        assert b.abs().sum() > 0  # the adapter trained (B starts at zero)
    # export_hf.py from the LoRA checkpoint (adapters + head only): the base from its source, merged
    from parallel_finetune.outputs.convert import export_checkpoint

    export_checkpoint(tmp_path / "checkpoints" / "step-00000003", tmp_path / "from-checkpoint")
    again = load_file(tmp_path / "from-checkpoint" / "model.safetensors")
    assert again.keys() == merged_weights.keys()
    assert all(torch.allclose(again[k], merged_weights[k], atol=1e-6) for k in again)


# Issue 36: instruction tuning (task=sft) under LoRA on the shipped chat sample, the loss on the answers only: the
# families made for chat, TP=2 against one process (one reference per family, shared in a session).
SFT_FAMILIES = ("llama", "qwen3", "mistral")


def lora_sft_overrides(sst2, cache_dir, family: str, **extra) -> list[str]:
    from test_chat import sft_run_overrides

    return sft_run_overrides(sst2, cache_dir, family, **extra) + LORA


@pytest.mark.parametrize("family", SFT_FAMILIES, ids=[f"{f}-tp2-sft" for f in SFT_FAMILIES])
def test_lora_sft_matches_single_process(family, single_process_run, sst2, cache_dir, tmp_path):
    overrides = lora_sft_overrides(sst2, cache_dir, family)
    reference = single_process_run(lora_recipe(family), overrides)
    run = launch(2, overrides + TP2, tmp_path / "tp2", recipe=lora_recipe(family))
    difference = assert_trains_like(run, reference, "sft", TOLERANCE)
    print(f"{family} tp2 sft LoRA: largest loss difference {difference:.2e} over {len(run.losses)} steps")
    assert "the base is frozen" in run.output and run.summary["task"] == "sft"


def test_lora_sft_adapter_loads_with_peft_onto_its_base(sst2, cache_dir, tmp_path):
    """A TP=2 sft LoRA run of the tiny Llama, its lm_head trained in full (lora_modules_to_save): adapter/ onto base/
    with peft's own loader gives the trained model's logits over every vocabulary entry at every position of chat
    rows; the merged hf/ too; base/ is the frozen base, its lm_head the initial one, not the trained (issue 54)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved_head = ["lora_modules_to_save=[lm_head]"]
    launch(
        2,
        lora_sft_overrides(sst2, cache_dir, "llama", max_steps=3, export="true")
        + TP2
        + ["lora_export_merged=true", *saved_head],
        tmp_path,
        script=WORKER,
        recipe=lora_recipe("llama"),
    )
    saved = torch.load(tmp_path / "trained_logits.pt", weights_only=True)
    assert saved["logits"].shape[:2] == saved["batch"]["input_ids"].shape  # (rows, positions, vocabulary)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    _check_base_unchanged("llama", "causal_lm", tmp_path, base)
    merged_head = load_file(tmp_path / "hf" / "model.safetensors")["lm_head.weight"]
    assert not torch.equal(merged_head, base.lm_head.weight)  # the head trained: the adapter carries it
    scored = saved["batch"]["attention_mask"].bool()
    with torch.no_grad():
        untrained = base(**saved["batch"]).logits
    assert (untrained - saved["logits"])[scored].abs().max() > 1e-3  # the adapters trained: not the base alone
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        logits = model(**saved["batch"]).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(**saved["batch"]).logits
    assert (logits - saved["logits"])[scored].abs().max() < TOLERANCE
    assert (merged - saved["logits"])[scored].abs().max() < TOLERANCE
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM", config["task_type"]


def _check_base_unchanged(family: str, head: str, run_dir, base) -> None:
    """base/'s weights equal the initial ones bit for bit (the tiny base is the transformers model initialised from
    the seed, as the run's loader made it): the frozen ones, and the modules to save as they were before training."""
    import yaml
    from transformers import AutoTokenizer

    from parallel_finetune.config import Config
    from parallel_finetune.families import get_family
    from parallel_finetune.model.load import seed_everything

    config = Config.from_flat(yaml.safe_load((run_dir / "config.yaml").read_text()))
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "adapter")
    fam = get_family(family)
    seed_everything(config.seed)
    initial = fam.hf_model(
        head,
        fam.config_for(
            model=config.model,
            head=head,
            max_length=config.max_length,
            tokenizer_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        ),
    ).state_dict()
    after = base.state_dict()
    changed = sorted(name for name in initial if not torch.equal(initial[name], after[name]))
    assert changed == [], changed


def test_planner_fits_gptj_6b_lora_on_one_a10g_and_one_a100():
    from parallel_finetune.tools.planner import Workload, plan

    a10g = plan("EleutherAI/gpt-j-6b", instance="ml.g5.2xlarge", workload=Workload(lora_rank=16))
    assert a10g.recommended is not None and a10g.recommended.layout.ac  # fits with activation checkpointing
    assert a10g.recommended.memory["optimizer"] < 0.3e9  # 33M trainable parameters x 8 B
    assert plan("EleutherAI/gpt-j-6b", instance="ml.g5.2xlarge").recommended is None  # full fine-tuning does not
    a100 = plan("EleutherAI/gpt-j-6b", gpus=1, gpu_mem_gb=40, gpu="A100-40GB", workload=Workload(lora_rank=16))
    assert a100.recommended is not None and not a100.recommended.layout.ac
    print(a10g.table(limit=2))


@pytest.mark.parametrize("family_name", ["gptj", "gpt2", "bert"])
def test_lora_adds_no_collective_and_places_adapters_like_their_layer(family_name):
    """TP=2 in one process (torch's fake process group): the adapters' shards follow their layer (column-wise: B on
    its output dim; row-wise: A on its input dim), and a forward runs exactly the collectives it ran without
    LoRA; frozen weights go to the compute dtype, adapters and head stay fp32 and trainable."""
    from conftest import fake_tp_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from parallel_finetune.data.batch import padded_batch
    from parallel_finetune.families import get_family
    from parallel_finetune.families.base import tiny_vocab_size
    from parallel_finetune.loop.runner import model_inputs
    from parallel_finetune.model import lora
    from parallel_finetune.model.load import load_model
    from parallel_finetune.model.weights import local_tensor, materialize
    from parallel_finetune.parallel.tensor import apply_tp

    family = get_family(family_name)
    hf_config = family.hf_config(None, "tiny", tiny_vocab_size(512), 128, {})
    family.set_task(hf_config, "classification", pad_token_id=0)
    batch = model_inputs(padded_batch([[5, 6, 7, 8, 9], [10, 11, 12]], pad_id=0))
    settings = lora.LoraSettings(4, 8.0, 0.0, lora.ALL_LINEAR, family.lora_head)

    def collectives(model) -> dict:
        with CommDebugMode() as comms:
            model(**batch)
        return {str(op): count for op, count in comms.get_comm_counts().items()}

    with fake_tp_mesh(2, rank=0) as mesh:
        torch.manual_seed(0)
        model = load_model(family, "classification", hf_config, None, seed=0).model
        apply_tp(model, family, mesh["tp"])
        before = collectives(model)
        names = lora.apply_lora(model, family, settings, mesh["tp"])
        materialize(model, torch.device("cpu"))
        for name in names:
            local_tensor(model.get_parameter(name)).detach().normal_(0, 0.02)
        assert collectives(model) == before
        block = f"{family.block_path}.0."
        column, row = family.column_wise[0], family.row_wise[0]
        assert model.get_parameter(f"{block}{column}.lora_A.weight").placements == (Replicate(),)
        assert model.get_parameter(f"{block}{column}.lora_B.weight").placements == (Shard(0),)
        assert model.get_parameter(f"{block}{row}.lora_A.weight").placements == (Shard(1),)
        assert model.get_parameter(f"{block}{row}.lora_B.weight").placements == (Replicate(),)
        trainable = lora.trainable_names(model, names, settings)
        lora.freeze_base(model, trainable, torch.bfloat16)
        for name, param in model.named_parameters():
            assert param.requires_grad == (name in trainable), name
            assert param.dtype == (torch.float32 if name in trainable else torch.bfloat16), name
        assert any(name.startswith(family.lora_head) for name in trainable)


# ----------------------------------------------------------------- issue 26: LoRA names that match nothing, ranks
@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["lora_target_modules=[q_proj, q_prj]"],  # one good name does not excuse a bad one
            "lora_target_modules: 'q_prj' matches no Linear layer of a gptj block; its layers: attn.k_proj, ",
        ),
        (
            ["lora_modules_to_save=[head]"],  # the randomly initialised score head would stay frozen
            "lora_modules_to_save: 'head' names no module with parameters in this gptj model; modules outside the "
            "blocks: score, transformer.ln_f, transformer.wte",
        ),
        (
            ["lora_rank=129"],  # tiny GPT-J: the attention projections are 128 x 128
            "lora_rank=129 is larger than the layer it adapts: transformer.h.0.attn.k_proj has 128 inputs and 128 "
            "outputs; use lora_rank <= 128",
        ),
        (
            ["family=gpt2", "task=causal_lm", "lora_target_modules=default", "lora_modules_to_save=[lm_head]"],
            "lora_modules_to_save: 'lm_head' holds only weights tied to transformer.wte.weight",
        ),
    ],
    ids=["target", "modules_to_save", "rank", "tied_head"],
)
def test_lora_names_matching_nothing_and_ranks_wider_than_a_layer_are_refused_by_check(overrides, message, sst2):
    from parallel_finetune.errors import UserError
    from parallel_finetune.preflight import preflight
    from parallel_finetune.resolve import load_config

    config = load_config(lora_recipe("gptj"), ["size=tiny", f"data_dir={sst2}", *overrides])
    with pytest.raises(UserError) as error:
        preflight(config, 1)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "ok: " in preflight(load_config(lora_recipe("gptj"), ["size=tiny", f"data_dir={sst2}", "lora_rank=128"]), 1)


def test_lora_check_cli_refuses_a_head_that_matches_nothing(sst2):
    from conftest import check

    proc = check("size=tiny", f"data_dir={sst2}", "lora_modules_to_save=[classifier]", recipe=lora_recipe("gptj"))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: lora_modules_to_save: 'classifier' names no module"), lines[0]


def test_lora_never_leaves_a_new_head_frozen(sst2, tmp_path):
    """A pretrained causal LM fine-tuned for classification: its score head is new (random); frozen, it would stay
    random. --check reads the local checkpoint's names; the run refuses the same (model.load_model)."""
    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.errors import UserError
    from parallel_finetune.model import lora, synthetic
    from parallel_finetune.preflight import preflight
    from parallel_finetune.resolve import load_config

    sentences = column(read_glue_dir(sst2)["train"], "text")[:300]
    folder = synthetic.write_checkpoint(
        tmp_path / "gpt2", "gpt2", sentences, hidden=32, layers=1, heads=2, vocab_size=300
    )
    base = ["size=full", f"model={folder}", f"data_dir={sst2}", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(
        UserError,
        match=r"score\.weight not in the checkpoint .* would keep them frozen at random "
        r"values; add score to lora_modules_to_save",
    ):
        preflight(load_config(lora_recipe("gpt2"), [*base, "lora_modules_to_save=[transformer.ln_f]"]), 1)
    assert "ok: " in preflight(load_config(lora_recipe("gpt2"), base), 1)  # the default saves the head
    settings = lora.LoraSettings(8, 16.0, 0.0, ("c_attn",), ())
    with pytest.raises(UserError, match="score.weight not in the checkpoint"):
        lora.check_new_trained(["score.weight", "transformer.h.0.attn.c_attn.q.lora_A.weight"], settings, "a folder")


def test_dropout_on_a_cpu_tensor_parallel_mesh_warns_no_more():
    """LoRA's dropout on DTensors of a CPU mesh made torch warn that "DTensor random operators may not have complete
    support" on every rank; what it means (each rank's own generator, seeded alike) is said in apply_tp, once."""
    import warnings

    from conftest import fake_tp_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from parallel_finetune.families import get_family
    from parallel_finetune.families.base import tiny_vocab_size
    from parallel_finetune.parallel.tensor import apply_tp

    family = get_family("gptj")
    hf_config = family.hf_config(None, "tiny", tiny_vocab_size(512), 128, {})
    family.set_task(hf_config, "classification", pad_token_id=0)
    with fake_tp_mesh(2, 0) as mesh, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.device("meta"):
            model = family.build("classification", hf_config)
        apply_tp(model, family, mesh)
        torch.nn.functional.dropout(distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]), 0.5, training=True)
    assert not [w for w in caught if "DTensor random operators" in str(w.message)]
