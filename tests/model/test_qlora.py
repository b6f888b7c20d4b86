"""QLoRA (lora_base_quantization=nf4): the frozen base's block Linears in torchao's NF4, quantized shard by shard
so that every layout holds the one-process quantization bit for bit; training under tensor and pipeline
parallelism matches one process; checkpoints hold no NF4 tensor and resume exactly; the export loads with peft and
transformers.

fp32, tiny models (recipes/*/qlora.yaml's tiny blocks: 16 x 8), real SST-2, adapter dropout off."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import REPO, assert_trains_like, launch, tiny_overrides
from safetensors.torch import load_file

from parallel_finetune.errors import UserError
from parallel_finetune.model.quantize import NF4Settings, quantize_shard, quantize_sharded, torchao_nf4

TOLERANCE = 1e-5
WORKER = str(REPO / "tests" / "workers" / "qlora_shards.py")
LORA = ["lora_dropout=0", "lora_rank=8", "lora_alpha=16", "lora_target_modules=all-linear"]
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")


def qlora_recipe(family: str):
    return REPO / "recipes" / family / "qlora.yaml"


def qlora_overrides(sst2, cache_dir, family: str, *extra: str) -> list[str]:
    return tiny_overrides(sst2, cache_dir, "classification", family) + LORA + list(extra)


def qlora_run(nproc: int, family: str, name: str, layout: list[str], sst2, cache_dir, folder):
    return launch(
        nproc,
        qlora_overrides(sst2, cache_dir, family, *layout),
        folder / f"qlora-{family}-{name}",
        script=WORKER,
        recipe=qlora_recipe(family),
    )


@pytest.fixture(scope="module")
def references(sst2, cache_dir, tmp_path_factory):
    """One-process QLoRA runs, one per family, made on first use."""
    runs = {}

    def get(family: str):
        if family not in runs:
            runs[family] = qlora_run(1, family, "single", [], sst2, cache_dir, tmp_path_factory.mktemp("q"))
        return runs[family]

    return get


def whole_shards(run) -> dict[str, dict[str, torch.Tensor]]:
    """Every NF4 weight of the run, its shards' inner tensors (tensor-parallel ranks', or FSDP's data-parallel
    ranks') laid end to end in rank order: the whole matrix's, were the layout exact; replicas checked to agree."""
    pieces: dict[str, dict[int, dict]] = {}
    for file in sorted(run.output_dir.glob("nf4-rank*.pt")):
        saved = torch.load(file, weights_only=True)
        for name, inner in saved["shards"].items():
            held = pieces.setdefault(name, {}).setdefault(saved["where"]["part"], inner)
            assert all(torch.equal(held[key], inner[key]) for key in INNER), f"{name}: replicas differ"
    whole = {}
    for name, by_rank in pieces.items():
        shards = [by_rank[rank] for rank in sorted(by_rank)]
        whole[name] = {key: torch.cat([s[key] for s in shards]) for key in INNER[:3]}
        means = [s["scaler_mean"] for s in shards]
        assert all(torch.equal(mean, means[0]) for mean in means), f"{name}: scaler means differ across ranks"
        whole[name]["scaler_mean"] = means[0]
    return whole


def assert_same_quantized_base(run, reference) -> int:
    mine, theirs = whole_shards(run), whole_shards(reference)
    assert mine.keys() == theirs.keys() and mine
    for name in theirs:
        for key in INNER:
            assert torch.equal(mine[name][key], theirs[name][key]), f"{name}.{key} differs from one process"
    return len(theirs)


TP2 = ["tensor_parallel_degree=2"]
PP2 = ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]
CASES = [
    ("gptj", "tp2", 2, TP2 + ["checkpoint_every=3", "export=true", "lora_export_merged=true"]),
    ("gptj", "pp2_checkpointing", 2, PP2 + ["activation_checkpointing=true"]),
    ("gptj", "pp2_tp2", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
    ("llama", "tp2", 2, TP2),
    ("bert", "tp2", 2, TP2),
    ("gptj", "zero1_dp2", 2, ["tensor_parallel_degree=1", "sharding=optimizer"]),
    ("gptj", "fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full", "export=true"]),
    ("llama", "pp2", 2, PP2),
    ("llama", "fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"]),
    ("llama", "pp2_tp2", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
    ("bert", "pp2", 2, PP2),
    ("bert", "fsdp_dp2", 2, ["tensor_parallel_degree=1", "sharding=full"]),
    ("bert", "pp2_tp2", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
]
_runs: dict = {}


@pytest.mark.parametrize("family,name,nproc,layout", CASES, ids=[f"{f}-{n}" for f, n, _, _ in CASES])
def test_qlora_layout_matches_single_process_and_quantizes_bit_for_bit(
    family, name, nproc, layout, references, sst2, cache_dir, tmp_path_factory
):
    reference = references(family)
    run = qlora_run(nproc, family, name, layout, sst2, cache_dir, tmp_path_factory.mktemp("q"))
    _runs[(family, name)] = run
    difference = assert_trains_like(run, reference, "classification", TOLERANCE)
    weights = assert_same_quantized_base(run, reference)
    print(f"{family} {name}: largest loss difference {difference:.2e}; {weights} NF4 weights bit for bit")
    per_rank = run.summary["state_bytes_per_rank"]
    assert all(rank["optimizer"] > 0 for rank in per_rank)
    assert "held in NF4 (blocks of 16, scalers double-quantized in groups of 8)" in run.output


def test_qlora_resumes_exactly_from_a_checkpoint_without_the_base(references, sst2, cache_dir, tmp_path):
    """The TP=2 run's step-3 checkpoint holds adapters and head only (no NF4 tensor, no base weight); resumed, the
    base is read and quantized again and the losses continue bit for bit."""
    run = _runs.get(("gptj", "tp2")) or qlora_run(2, "gptj", "tp2", CASES[0][3], sst2, cache_dir, tmp_path)
    step3 = run.output_dir / "checkpoints" / "step-00000003"
    written = json.loads((step3 / "trainer_state.json").read_text())["lora"]["written"]
    assert written and all(".lora_" in name or name.startswith("score.") for name in written)
    resumed = launch(
        2,
        qlora_overrides(sst2, cache_dir, "gptj", *TP2, f"resume={step3}"),
        tmp_path / "resumed",
        recipe=qlora_recipe("gptj"),
    )
    assert resumed.losses == run.losses[3:]
    assert resumed.summary["accuracy"] == run.summary["accuracy"]


def test_qlora_export_adapter_loads_with_peft_and_merged_with_transformers(references, sst2, cache_dir, tmp_path):
    """adapter/ onto base/ (the tiny base as trained: NF4 dequantized) gives the trained TP=2 model's logits; so
    does the merged hf/, whose weights are the dequantized base + alpha/r * B·A."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    run = _runs.get(("gptj", "tp2")) or qlora_run(2, "gptj", "tp2", CASES[0][3], sst2, cache_dir, tmp_path)
    out = run.output_dir
    saved = torch.load(out / "trained_logits.pt", weights_only=True)
    base = AutoModelForSequenceClassification.from_pretrained(out / "base").eval()
    model = PeftModel.from_pretrained(base, out / "adapter").eval()
    merged = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        assert (model(**saved["batch"]).logits - saved["logits"]).abs().max() < TOLERANCE
        assert (merged(**saved["batch"]).logits - saved["logits"]).abs().max() < TOLERANCE
    # the base exported is the one-process quantization, dequantized: 16 NF4 levels x one scale per block
    q_proj = load_file(out / "base" / "model.safetensors")["transformer.h.0.attn.q_proj.weight"]
    assert all(len(block.unique()) <= 16 for block in q_proj.flatten().split(16))
    merged_q = load_file(out / "hf" / "model.safetensors")["transformer.h.0.attn.q_proj.weight"]
    assert not torch.equal(merged_q, q_proj)  # B·A merged in
    # export_hf.py from the QLoRA checkpoint (adapters + head only): the base read and quantized again in one
    # process (the same bits), dequantized, B·A merged in: the run's merged export
    from parallel_finetune.outputs.convert import export_checkpoint

    export_checkpoint(out / "checkpoints" / "step-00000006", tmp_path / "from-checkpoint")
    again = load_file(tmp_path / "from-checkpoint" / "model.safetensors")
    merged_weights = load_file(out / "hf" / "model.safetensors")
    assert again.keys() == merged_weights.keys()
    assert all(torch.allclose(again[k], merged_weights[k], atol=1e-6) for k in again)
    # FSDP's export gathers its NF4 shards and dequantizes them: the same base, bit for bit
    layout = next(case[3] for case in CASES if case[:2] == ("gptj", "fsdp_dp2"))
    fsdp = _runs.get(("gptj", "fsdp_dp2")) or qlora_run(2, "gptj", "fsdp_dp2", layout, sst2, cache_dir, tmp_path)
    sharded_base = load_file(fsdp.output_dir / "base" / "model.safetensors")
    tp_base = load_file(out / "base" / "model.safetensors")
    frozen = [name for name in tp_base if ".h." in name]
    assert frozen and all(torch.equal(sharded_base[name], tp_base[name]) for name in frozen)
    _predict_says_when_the_base_is_not_the_trained_one(out, tmp_path)


def _predict_says_when_the_base_is_not_the_trained_one(out, tmp_path) -> None:
    """predict.py on adapter/ over base/ (the base as trained, NF4 dequantized) says nothing; over another copy of
    the base (a 16-bit checkpoint, as a Hub name gives) it says the base differs from the one trained."""
    import contextlib
    import io
    import shutil

    from parallel_finetune.tools.inference import main as predict_main

    texts = tmp_path / "new.tsv"
    texts.write_text("sentence\na gorgeous , witty , seductive movie .\nthe story is bland\n")
    run = tmp_path / "copied-run"
    shutil.copytree(out / "adapter", run / "adapter")
    for name in ("config.yaml", "labels.json"):
        shutil.copy(out / name, run / name)
    shutil.copytree(out / "base", tmp_path / "sixteen-bit")
    for base, note in ((out / "base", ""), (tmp_path / "sixteen-bit", "note: ")):
        settings = json.loads((run / "adapter" / "adapter_config.json").read_text())
        settings["base_model_name_or_path"] = str(base)
        (run / "adapter" / "adapter_config.json").write_text(json.dumps(settings))
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            assert predict_main([str(run / "adapter"), str(texts)]) == 0
        assert said.getvalue().startswith(note) and ("note:" in said.getvalue()) == bool(note), said.getvalue()
    assert f"and {tmp_path / 'sixteen-bit'} is that base unquantized, so the scores differ" in said.getvalue()


# ----------------------------------------------------------------------------------------------- units
SETTINGS = NF4Settings(16, 8)


def test_shards_quantize_to_the_whole_matrix_bit_for_bit():
    """A matrix quantized whole equals torchao's to_nf4 bit for bit; two row shards (column-wise TP, FSDP) and two
    column shards of a row-wise layer (stored transposed: row shards again), each given the whole matrix's
    scaler mean, are the same codes, scalers, factors and mean as the whole."""
    nf4 = torchao_nf4()
    torch.manual_seed(0)
    weight = torch.randn(64, 48)
    whole = quantize_shard(weight, SETTINGS)
    reference = nf4.to_nf4(weight, SETTINGS.block_size, SETTINGS.scaler_block_size)
    for key in INNER:
        assert torch.equal(getattr(whole, key), getattr(reference, key)), key
    assert torch.equal(whole.get_original_weight(), reference.get_original_weight())
    for stored, shards in (
        (weight, weight.chunk(2, dim=0)),  # column-wise: rows of out x in
        (weight.t(), [s.t() for s in weight.chunk(2, dim=1)]),  # row-wise: input columns, stored in x out
    ):
        mean = nf4.get_block_absmax(stored.contiguous().flatten(), SETTINGS.block_size).mean()
        parts = [quantize_shard(shard, SETTINGS, mean) for shard in shards]
        whole = nf4.to_nf4(stored.contiguous(), SETTINGS.block_size, SETTINGS.scaler_block_size)
        for key in INNER[:3]:
            assert torch.equal(torch.cat([getattr(p, key) for p in parts]), getattr(whole, key)), key
        assert all(torch.equal(p.scaler_mean, whole.scaler_mean) for p in parts)
        dequantized = torch.cat([p.get_original_weight() for p in parts])
        assert torch.equal(dequantized, whole.get_original_weight())
    # a shard quantized alone (torchao's from_tensor on it) centres its scalers on its own mean: not the same bits
    alone = nf4.to_nf4(weight[:32].contiguous(), SETTINGS.block_size, SETTINGS.scaler_block_size)
    assert not torch.equal(alone.scaler_mean, quantize_sharded(weight, SETTINGS, None).scaler_mean)


def test_qlora_forward_and_backward_dequantize_without_keeping_the_weight():
    """NF4Linear: the output and the input gradient are those of F.linear with the dequantized weight (stored
    either way), and the weight gets no gradient."""
    from torch import nn

    from parallel_finetune.model.quantize import NF4Linear

    torch.manual_seed(0)
    for transposed in (False, True):
        layer = nn.Linear(32, 16)
        weight = layer.weight.detach()
        nf4 = quantize_shard(weight.t() if transposed else weight, SETTINGS)
        dequantized = nf4.get_original_weight()
        dequantized = dequantized.t() if transposed else dequantized
        del layer._parameters["weight"]
        layer.register_buffer("weight", nf4, persistent=False)
        layer.__class__ = NF4Linear
        layer.nf4_transposed, layer.nf4_style = transposed, "none"
        x = torch.randn(3, 32, requires_grad=True)
        y = layer(x)
        y.square().sum().backward()
        x2 = x.detach().clone().requires_grad_(True)
        expected = torch.nn.functional.linear(x2, dequantized, layer.bias.detach())
        expected.square().sum().backward()
        assert torch.allclose(y, expected, atol=1e-6)
        assert torch.allclose(x.grad, x2.grad, atol=1e-5)
        assert list(layer.state_dict()) == ["bias"]  # the NF4 weight never reaches a checkpoint


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["peft=none"],
            "lora_base_quantization='nf4' quantizes the frozen base of peft=lora (QLoRA); set peft=lora",
        ),
        (["sharding=hybrid", "tensor_parallel_degree=1"], "sharding='hybrid' with lora_base_quantization=nf4 is not"),
        (["nf4_block_size=7"], "nf4_block_size=7 must be even and at least 2"),
    ],
    ids=["needs_lora", "hybrid", "odd_block"],
)
def test_qlora_keys_are_refused_in_one_line(overrides, message, sst2):
    from parallel_finetune.resolve import load_config

    with pytest.raises(UserError) as error:
        load_config(qlora_recipe("gptj"), ["size=tiny", f"data_dir={sst2}", *overrides])
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_qlora_refuses_shards_that_cannot_be_blocked_and_blocks_without_linears(sst2):
    """A shard that is not whole scaler groups names the layer, its shard shape and a block size that fits (the
    run, and --check); a model whose blocks hold no Linear is refused."""
    from torch import nn

    from parallel_finetune.families import get_family
    from parallel_finetune.families.base import tiny_vocab_size
    from parallel_finetune.model.quantize import check_quantizable, prepare

    family = get_family("gptj")
    hf_config = family.hf_config(None, "tiny", tiny_vocab_size(512), 128, {})
    family.set_task(hf_config, "classification", pad_token_id=0)
    with torch.device("meta"):
        model = family.build("classification", hf_config)
    with pytest.raises(UserError) as error:
        prepare(model, family, NF4Settings(64, 512))
    text = str(error.value)
    assert "transformer.h.0.attn.k_proj's shard on this rank is [128, 128] (16384 elements)" in text, text
    assert "64 x 512 = 32768; e.g. nf4_block_size=64, nf4_scaler_block_size=256" in text and "\n" not in text

    # --check says the same before any process starts: the layout's shards, from the recipe and the process count
    from parallel_finetune.preflight import preflight
    from parallel_finetune.resolve import load_config

    sizes = ["nf4_block_size=64", "nf4_scaler_block_size=256"]
    config = load_config(qlora_recipe("gptj"), ["size=tiny", f"data_dir={sst2}", *sizes])  # TP=2: 64 x 128 shards
    with pytest.raises(UserError, match=r"k_proj's shard on this rank is \[64, 128\] \(8192 elements\)"):
        preflight(config, 2)
    assert "ok: " in preflight(load_config(qlora_recipe("gptj"), ["size=tiny", f"data_dir={sst2}"]), 2)

    class NoLinear:
        name, block_path = "stub", "h"

        def blocks(self, model):
            return model.h

        def block_numbers(self, model):
            return [0]

    stub = nn.Module()
    stub.h = nn.ModuleList([nn.LayerNorm(8)])
    with pytest.raises(UserError, match="quantizes the Linear layers of the stub blocks, and they have none"):
        check_quantizable(stub, NoLinear())


def test_qlora_refuses_a_module_to_save_that_it_quantizes(sst2):
    """A block Linear named in lora_modules_to_save would be held in NF4 and frozen while the log counts it as
    trained: --check and the run refuse it in one line; a module outside the blocks (the head) still trains."""
    from parallel_finetune.preflight import preflight
    from parallel_finetune.resolve import load_config

    base = ["size=tiny", f"data_dir={sst2}"]
    for saved, held in (
        ("transformer.h.0.mlp.fc_out", "transformer.h.0.mlp.fc_out"),
        ("transformer.h.1", "transformer.h.1.attn.k_proj and 5 more Linear layer(s)"),
    ):
        config = load_config(qlora_recipe("gptj"), [*base, f"lora_modules_to_save=[score,{saved}]"])
        with pytest.raises(UserError) as error:
            preflight(config, 2)
        said = str(error.value)
        assert said.startswith(f"lora_modules_to_save: {saved!r} holds {held}, which lora_base_quantization=nf4 ")
        assert "\n" not in said, said
    assert "ok: " in preflight(load_config(qlora_recipe("gptj"), [*base, "lora_modules_to_save=[score]"]), 2)


@pytest.mark.parametrize("block,scaler", [(48, 256), (64, 512), (6, 3), (1024, 1024)])
def test_the_block_size_hint_names_sizes_that_work(block, scaler):
    """Whatever sizes were chosen (48 is even, so the config takes it), the hint names a pair that blocks the
    shard: whole scaler groups of whole blocks."""
    import re

    from parallel_finetune.model.quantize import _check_blocks

    for stored in ((128, 128), (64, 128), (96, 128), (48, 32), (8, 6)):
        elements = stored[0] * stored[1]
        try:
            _check_blocks("layer", stored, NF4Settings(block, scaler))
            continue
        except UserError as error:
            said = str(error)
        hint = re.search(r"e\.g\. nf4_block_size=(\d+), nf4_scaler_block_size=(\d+)$", said)
        named = NF4Settings(int(hint[1]), int(hint[2]))
        assert named.block_size % 2 == 0 and elements % named.group == 0, (stored, said)
        _check_blocks("layer", stored, named)


def test_qlora_without_torchao_is_one_line(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    with pytest.raises(UserError, match=r"lora_base_quantization=nf4 needs torchao .*pip install torchao==0.18.0"):
        torchao_nf4()


def test_the_functional_dequantization_is_torchaos_bit_for_bit():
    """quantize.dequantize_nf4 (compiled on CUDA, for speed) gives NF4Tensor.get_original_weight's values exactly,
    for block and scaler-block sizes the recipes use, in fp32 and bf16."""
    from parallel_finetune.model.quantize import original_weight

    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for block, scaler_block in ((64, 256), (32, 8)):
            nf4 = torchao_nf4().to_nf4(torch.randn(128, 256, dtype=dtype), block, scaler_block)
            assert torch.equal(original_weight(nf4), nf4.get_original_weight())


# ------------------------------------------------------------- the compiled (CUDA) dequantization, on this CPU
@pytest.fixture
def compiled_here(monkeypatch):
    """quantize.original_weight's CUDA branch run on this CPU: the dequantization compiled (Inductor's C++
    backend instead of Triton), its cache of compiled layouts empty; returns the module."""
    from parallel_finetune.model import quantize

    monkeypatch.setattr(quantize, "COMPILED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(quantize, "_COMPILED", {})
    with torch._inductor.config.patch(compile_threads=1):  # no pool of compile workers (one per core)
        yield quantize


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process (dynamo's own count)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def as_training_calls_it(original_weight, nf4) -> list[torch.Tensor]:
    """nf4 dequantized under each state it is called in: the forward's (bf16 autocast, gradients off: an autograd
    function's forward), the backward's and evaluation's (no autocast, gradients off) and gradients on."""
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        forward = original_weight(nf4)
    with torch.no_grad():
        evaluation = original_weight(nf4)
    return [forward, evaluation, original_weight(nf4)]


def test_compiled_dequantization_is_torchaos_bit_for_bit(compiled_here):
    """Compiled, the dequantization is NF4Tensor.get_original_weight's values exactly, in bf16, fp16 and fp32
    (Inductor's fused kernel, left to itself, keeps the 16-bit intermediates in fp32: a fifth of the bf16 values
    differed, by up to 0.031), under every state training calls it in."""
    torch.manual_seed(0)
    # (the bf16 shape is one of the next test's, the fp32 one a tiny GPT-J's attention: Inductor's cache of
    # compiled code serves the later tests)
    cases = [(torch.bfloat16, (16, 16), 16, 8), (torch.float16, (32, 64), 32, 4), (torch.float32, (128, 128), 16, 8)]
    for dtype, shape, block, scaler_block in cases:
        # spread over magnitudes, so that the scalers' int8 rounding and the 16-bit products all matter
        weight = (torch.randn(shape) * torch.logspace(-3, 1, shape[1])).to(dtype)
        nf4 = torchao_nf4().to_nf4(weight, block, scaler_block)
        for dequantized in as_training_calls_it(compiled_here.original_weight, nf4):
            assert torch.equal(dequantized, nf4.get_original_weight()), (dtype, shape)
    assert len(compiled_here._COMPILED) == len(cases)  # the compiled branch ran, not the eager one


def test_compiled_dequantization_is_one_graph_per_layout(compiled_here):
    """One graph per distinct layout, whatever the grad and autocast state of the call, and more layouts than
    dynamo's recompile limit all compiled: with the limit at 2 (8 by default; lowered so that the test compiles
    a few small graphs, not 9 or more), 3 weight shapes are 3 graphs."""
    torch.manual_seed(0)
    weights = [torchao_nf4().to_nf4(torch.randn(16 * rows, 16, dtype=torch.bfloat16), 16, 8) for rows in range(1, 4)]
    before = dynamo_graphs()
    with torch._dynamo.config.patch(recompile_limit=2):
        for _ in range(2):
            for nf4 in weights:
                for dequantized in as_training_calls_it(compiled_here.original_weight, nf4):
                    assert torch.equal(dequantized, nf4.get_original_weight())
    assert dynamo_graphs() - before == len(weights) == len(compiled_here._COMPILED)
    assert compiled_here.compiled_graphs() >= len(weights)  # what parallel.compiled_graphs leaves out


def test_qlora_compiles_its_dequantization_at_load_not_in_the_first_step(compiled_here, caplog):
    """load_model compiles each distinct layout of the model's NF4 weights (one graph each) before it returns, so
    the first training step (bf16 autocast forward, backward) and evaluation compile nothing."""
    from parallel_finetune.data.batch import padded_batch
    from parallel_finetune.families import get_family
    from parallel_finetune.families.base import tiny_vocab_size
    from parallel_finetune.loop.runner import model_inputs
    from parallel_finetune.model import lora
    from parallel_finetune.model.load import load_model

    family = get_family("gptj")
    hf_config = family.hf_config(None, "tiny", tiny_vocab_size(512), 128, {})
    family.set_task(hf_config, "classification", pad_token_id=0)
    settings = lora.LoraSettings(4, 8.0, 0.0, lora.ALL_LINEAR, family.lora_head, SETTINGS)
    before = dynamo_graphs()
    with caplog.at_level(logging.INFO, logger="parallel_finetune.model.load"):
        model = load_model(family, "classification", hf_config, None, seed=0, adapters=settings).model
    layouts = compiled_here.forward_layouts(model)
    assert f"qlora: dequantization compiled for {len(layouts)} NF4 weight layouts in " in caplog.text
    assert len(compiled_here.nf4_weights(model)) > len(layouts) > 1  # weights sharing a layout share its graph
    assert set(compiled_here._COMPILED) == layouts
    assert dynamo_graphs() - before == len(layouts)
    loaded = dynamo_graphs()
    batch = model_inputs(padded_batch([[5, 6, 7, 8, 9], [10, 11, 12]], pad_id=0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(**batch).logits
    logits.float().square().sum().backward()
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch).logits
    assert dynamo_graphs() == loaded
    compiled_here.COMPILED_DEVICES = frozenset()  # the eager dequantization: the same model, the same logits
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, evaluated)


def test_fsdp_weights_compile_at_load_as_their_forward_gathers_them(compiled_here):
    """Under FSDP2 the forward dequantizes the whole weight its all-gather makes, not this rank's shard: the
    warm-up compiles that layout (128 x 128 here, the shard 64 x 128), and the gathered weight's forward and
    backward compile nothing more (a fake process group of 2: the shapes are real, the collectives do nothing)."""
    from conftest import fake_tp_mesh
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from parallel_finetune.model.quantize import NF4Linear, meta_nf4
    from parallel_finetune.model.weights import materialize

    torch.manual_seed(0)
    with fake_tp_mesh(2, rank=0) as mesh:
        model = nn.Sequential(nn.Linear(128, 128, bias=False, device="meta"))
        layer = model[0]
        layer.__class__ = NF4Linear
        layer.nf4_transposed, layer.nf4_style = False, "none"
        layer.weight = nn.Parameter(meta_nf4((128, 128), torch.float32, SETTINGS), requires_grad=False)
        fully_shard(layer, mesh=mesh)
        materialize(model, torch.device("cpu"), leave=set())
        local, shard = layer.weight._local_tensor, quantize_shard(torch.randn(64, 128), SETTINGS)
        for key in INNER[:3]:  # as quantize.quantizing_writer fills FSDP's shard
            getattr(local, key).copy_(getattr(shard, key))
        local.scaler_mean, local.nf4 = shard.scaler_mean, shard.nf4
        before = dynamo_graphs()
        assert compiled_here.warm_up(model) == 1
        assert [layout.shape for layout, _ in compiled_here._COMPILED] == [(128, 128)]
        assert dynamo_graphs() - before == 1
        x = torch.randn(3, 128, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        y.float().sum().backward()
        assert y.shape == (3, 128) and x.grad is not None
        assert dynamo_graphs() - before == 1


def test_qlora_instruction_tuning_tp2_matches_single_process(single_process_run, sst2, cache_dir, tmp_path):
    """QLoRA with a language model's chunked, vocabulary-parallel loss: the chat sample's sft run of the tiny
    Llama under TP=2 (NF4 base, the head a vocabulary shard per rank) against one process, every step's loss and
    the eval loss within 1e-5."""
    from test_chat import sft_run_overrides

    overrides = sft_run_overrides(sst2, cache_dir, "llama") + LORA
    reference = single_process_run(qlora_recipe("llama"), overrides)
    run = launch(2, [*overrides, *TP2], tmp_path / "qlora-sft-tp2", recipe=qlora_recipe("llama"))
    difference = assert_trains_like(run, reference, "sft", TOLERANCE)
    print(f"llama tp2 sft QLoRA: largest loss difference {difference:.2e}")
    assert "held in NF4" in run.output
