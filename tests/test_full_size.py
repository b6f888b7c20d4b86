"""Full-size models: built on `meta`, split, then each rank allocates and loads only its own shards.

The checkpoints are written here (synthetic.write_checkpoint: random weights, a tokenizer learned from SST-2,
safetensors in fp32 and fp16), once per session, and loaded with size=full model=FOLDER under each layout. A
worker exports the weights as loaded (before the first update); the test compares them with the file, bit for bit.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import pytest
import torch
from conftest import HUB_CACHE, REPO, check, fake_tp_mesh, launch, recipe, sst2_head
from safetensors.torch import load_file, save_file

from parallel_finetune.data.prepare import column, read_glue_dir
from parallel_finetune.errors import UserError
from parallel_finetune.families import get_family
from parallel_finetune.model import synthetic
from parallel_finetune.model.load import load_model
from parallel_finetune.model.weights import Checkpoint, NewWeights, load_weights, plan_load
from parallel_finetune.resolve import load_config
from parallel_finetune.tools.planner import Candidate, memory_per_gpu, model_shape

WORKER = str(REPO / "tests" / "workers" / "export_loaded.py")
TASK = {
    "gptj": "classification",
    "gpt2": "causal_lm",
    "gptneo": "causal_lm",
    "bert": "classification",
    "llama": "classification",
    "qwen3": "causal_lm",  # tied embeddings: the file holds the embedding only
    "mistral": "causal_lm",  # untied: the LM head sharded by columns under TP
}
# GPT-J ~100M parameters (400 MB in fp32): big enough that its bytes dominate a process's memory, for the rows that
# measure memory at load (one process, TP=2, PP=2: test_load_peak_memory_per_rank); the others small.
SIZES = {
    "gptj": dict(hidden=1024, layers=8, heads=16),
    "gpt2": dict(hidden=256, layers=4, heads=8),
    "gptneo": dict(hidden=256, layers=4, heads=8),
    "bert": dict(hidden=256, layers=4, heads=8),
    # families made from transformers' plans: grouped-query attention, 8 query heads for 2 key/value heads
    "llama": dict(hidden=128, layers=4, heads=8),
    "qwen3": dict(hidden=128, layers=4, heads=8),
    "mistral": dict(hidden=128, layers=4, heads=8),
}
LAYOUTS = {
    "one": (1, []),
    "tp2": (2, ["tensor_parallel_degree=2"]),
    "pp2": (2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]),
    "fsdp2": (2, ["tensor_parallel_degree=1", "sharding=full"]),
    "pp2_tp2": (4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"]),
    "zero3": (2, ["tensor_parallel_degree=1", "engine=deepspeed", "zero_stage=3"]),
}
# (family, layout, file dtype). Every family loads fp16 and fp32 files (BERT bf16 too); runs compared with one
# process load fp32 files.
CASES = [
    ("gptj", "tp2", "float32"),
    ("gptj", "pp2", "float16"),
    ("gptj", "fsdp2", "float16"),
    ("gptj", "pp2_tp2", "float32"),
    ("gptj", "zero3", "float32"),
    ("gpt2", "tp2", "float16"),
    ("gpt2", "pp2", "float32"),
    ("gpt2", "fsdp2", "float16"),
    ("gpt2", "pp2_tp2", "float32"),
    ("gptneo", "tp2", "float16"),
    ("gptneo", "pp2", "float16"),
    ("gptneo", "fsdp2", "float16"),
    ("gptneo", "pp2_tp2", "float32"),
    ("bert", "tp2", "float16"),
    ("bert", "pp2", "bfloat16"),
    ("bert", "fsdp2", "float16"),
    ("bert", "pp2_tp2", "float32"),
    ("llama", "tp2", "float16"),
    ("llama", "pp2", "float32"),
    ("qwen3", "tp2", "float32"),
    ("qwen3", "pp2", "float16"),
    ("mistral", "tp2", "float32"),
    ("mistral", "pp2", "float16"),
]
# GPT-J rows whose point is the shards, not the memory: a small GPT-J (a 100M one costs ~20 s of CPU per row).
SMALL = {("gptj", "fsdp2"), ("gptj", "pp2_tp2"), ("gptj", "zero3")}
SMALL_GPTJ = dict(hidden=256, layers=4, heads=8)
COMPARED_WITH_ONE_PROCESS = {("gptj", "tp2"), ("gptj", "pp2_tp2"), ("gpt2", "pp2"), ("gpt2", "pp2_tp2")}
CACHE = REPO / ".cache" / "test-checkpoints-v1"


@pytest.fixture(scope="module")
def small_sst2(sst2, tmp_path_factory) -> Path:
    """The first rows of the real SST-2: the checkpoint's size is what these runs prove (memory at load), not the
    number of rows they train on or score, and a 100M model on a CPU core costs seconds per step."""
    return sst2_head(sst2, tmp_path_factory.mktemp("sst2-head"), 256, 16)


@pytest.fixture(scope="module")
def checkpoint(sst2):
    """family, dtype -> a model folder (written on first use, reused by later sessions)."""
    sentences = column(read_glue_dir(sst2)["train"], "text")

    def get(family: str, dtype: str, small: bool = False) -> Path:
        folder = CACHE / f"{family}{'-small' if small else ''}-{dtype}"
        if not (folder / "config.json").is_file():
            size = SMALL_GPTJ if small else SIZES[family]
            synthetic.write_checkpoint(folder, family, sentences, dtype=dtype, **size)
        return folder

    return get


def overrides(family: str, folder: Path, data: Path, cache_dir: Path, **extra) -> list[str]:
    values = {
        "size": "full",
        "model": folder,
        "task": TASK[family],
        "data_dir": data,
        "cache_dir": cache_dir,
        "precision": "fp32",
        "max_steps": 1,  # the weights are exported before the first update: one step proves the load
        "batch_size": 4,  # one row per microbatch under PP=2 (4 microbatches), two per replica under DP=2
        "max_length": 32,
        "eval_batch_size": 16,
        "lr": 1e-4,
        "warmup_ratio": 0,
        "log_every": 1,
        "export": "false",
        "peak_tflops": 0.1,
        **extra,
    }
    return [f"{key}={value}" for key, value in values.items()]


@pytest.fixture(scope="module")
def runs(checkpoint, small_sst2, cache_dir, tmp_path_factory):
    """(family, layout, dtype, size, small) -> the finished run (launched on first use)."""
    done = {}

    def get(family: str, layout: str, dtype: str = "float32", size: str = "full", small: bool = False):
        key = (family, layout, dtype, size, small)
        if key not in done:
            nproc, layout_overrides = LAYOUTS[layout]
            folder = checkpoint(family, dtype, small)
            # "model=" is null (the recipe's default, unread at tiny size); "model=None" would name a folder None
            extra = {"size": "tiny", "model": ""} if size == "tiny" else {}
            if layout == "one" or (family, layout) in COMPARED_WITH_ONE_PROCESS:
                extra["max_steps"] = 3  # losses compared step by step
            out = tmp_path_factory.mktemp(f"{family}-{layout}-{dtype}-{size}")
            done[key] = launch(
                nproc,
                overrides(family, folder, small_sst2, cache_dir, **extra) + layout_overrides,
                out,
                script=WORKER,  # tiny runs too: the load-memory files
                recipe=recipe(family),
            )
        return done[key]

    return get


def compare_with_file(exported: dict[str, torch.Tensor], folder: Path, prefix: str) -> set[str]:
    """Every checkpoint tensor the model has equals the exported one exactly; returns the exported names that
    the checkpoint lacked (new weights)."""
    source = load_file(folder / "model.safetensors")
    matched = set()
    for key, tensor in source.items():
        name = key if key in exported else f"{prefix}.{key}"
        if name not in exported:
            continue  # unused by this task, e.g. GPT-J's lm_head when classifying
        assert torch.equal(exported[name], tensor.float()), f"{name} differs from the file's {key}"
        matched.add(name)
    return set(exported) - matched


@pytest.mark.parametrize("family,layout,dtype", CASES, ids=["-".join(case) for case in CASES])
def test_loaded_shards_equal_the_checkpoint(family, layout, dtype, runs, checkpoint):
    small = (family, layout) in SMALL
    run = runs(family, layout, dtype, small=small)
    exported = load_file(run.output_dir / "loaded" / "model.safetensors")
    prefix = get_family(family).model_classes[TASK[family]].base_model_prefix
    new = compare_with_file(exported, checkpoint(family, dtype, small), prefix)
    expected_new = {
        "classification": {
            "gptj": {"score.weight"},
            "bert": {"classifier.weight", "classifier.bias"},
            "llama": {"score.weight"},
        }
    }
    assert new == expected_new.get(TASK[family], {}).get(family, set())
    if new:
        assert "new (not in the checkpoint), initialised from seed 42: " + ", ".join(sorted(new)) in run.output
        # Same seed, same values, whatever the layout: one process's are the reference.
        single = load_file(runs(family, "one", "float32", small=small).output_dir / "loaded" / "model.safetensors")
        for name in new:
            assert torch.equal(exported[name], single[name]), name
    if (family, layout) in COMPARED_WITH_ONE_PROCESS:
        reference = runs(family, "one", "float32", small=small)
        differences = [abs(a - b) for a, b in zip(run.losses, reference.losses)]
        assert len(run.losses) == 3 and max(differences) < 1e-5, differences
        assert reference.losses[0] != reference.losses[-1]
        assert run.summary["eval_loss"] == pytest.approx(reference.summary["eval_loss"], abs=1e-5)
    if layout == "zero3":  # built partitioned: each rank holds half of one process's parameter bytes
        single = runs(family, "one", "float32", small=small).summary["state_bytes_per_rank"][0]["params"]
        assert max(rank["params"] for rank in run.summary["state_bytes_per_rank"]) <= 0.55 * single


def model_bytes(folder: Path, task: str) -> int:
    return 4 * model_shape(str(folder), task).total


def load_window_mib(run, ranks: int) -> list[float]:
    """Each rank's load: its peak RSS when the model was ready above its peak as the load began. What came before
    (data read and tokenized, a first run's cache writes, tracker start-up) varies with the order tests run in and
    is not the load's."""
    windows = []
    for rank in range(ranks):
        memory = json.loads((run.output_dir / f"load-memory-rank{rank}.json").read_text())
        windows.append(memory["peak_mib"] - memory["before_mib"])
    return windows


@pytest.mark.parametrize("layout", ["one", "tp2", "pp2"])
def test_load_peak_memory_per_rank(layout, runs, checkpoint):
    """Measured from the operating system (peak RSS while the model loads): a rank's extra memory over a tiny
    run of the same layout is its shards plus one block, never the whole model; the planner predicts it."""
    dtype = "float16" if layout == "pp2" else "float32"
    run, tiny = runs("gptj", layout, dtype), runs("gptj", layout, "float32", size="tiny")
    folder = checkpoint("gptj", dtype)
    whole = model_bytes(folder, "classification")
    ranks = LAYOUTS[layout][0]
    extra = [(big - small) * 2**20 for big, small in zip(load_window_mib(run, ranks), load_window_mib(tiny, ranks))]
    assert len(extra) == ranks
    ratios = [e / whole for e in extra]
    print(
        f"gptj {layout} ({dtype} file, {whole / 2**20:.0f} MiB in fp32): extra per rank "
        f"{[round(e / 2**20) for e in extra]} MiB = {[round(r, 3) for r in ratios]} x the model; "
        f"load {run.summary['load_seconds']} s"
    )
    # The summary's figure is the same peak, from the process's start.
    assert [
        round(json.loads((run.output_dir / f"load-memory-rank{rank}.json").read_text())["peak_mib"], 1)
        for rank in range(ranks)
    ] == run.summary["load_peak_mib_per_rank"]
    if layout == "one":
        assert 0.9 <= ratios[0] <= 1.15, ratios  # no double copy
    else:  # half the blocks (PP) or half of each matrix (TP) plus one block read: never the whole model
        assert max(ratios) <= 0.65, ratios
    tp, pp = (2, 1) if layout == "tp2" else (1, 2) if layout == "pp2" else (1, 1)
    planned = memory_per_gpu(
        model_shape(str(folder), "classification"), Candidate(tp, pp, 1, "none", False, 1), 64, 16
    )["load"]
    assert max(extra) == pytest.approx(planned, rel=0.15), (max(extra), planned)


class _MetaBlocks(Checkpoint):
    """The tensors of a checkpoint by shape only (meta blocks): counts what a load reads and keeps alive."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], prefix: str):
        super().__init__({key: self for key in shapes}, prefix, "shapes")
        self.shapes, self.alive, self.most_alive, self.read_elements = shapes, 0, 0, []

    def shape(self, key):
        return self.shapes[key]

    def dtype(self, key):
        return torch.float16

    def read(self, key, box):
        block = torch.empty(box[1], dtype=torch.float16, device="meta")
        self.alive += 1
        self.most_alive = max(self.most_alive, self.alive)
        self.read_elements.append(block.numel())
        weakref.finalize(block, self._released)
        return block

    def _released(self):
        self.alive -= 1


def test_gptj_6b_tp8_load_plan_reads_only_the_shards(fake_world_of_eight):
    """The real GPT-J 6B config on the meta device, TP=8, rank 3 of a fake world: every parameter is read as exactly
    its local shard, at most one block is alive at a time, and nothing is ever allocated."""
    from parallel_finetune.parallel.tensor import apply_tp

    family = get_family("gptj")
    hf_config = family.published_config("EleutherAI/gpt-j-6b")
    family.set_task(hf_config, "classification", pad_token_id=50256)
    model = family.build("classification", hf_config)
    whole = sum(p.numel() for p in model.parameters())
    new = NewWeights(model, ["score.weight"], seed=42)
    causal = family.build("causal_lm", family.published_config("EleutherAI/gpt-j-6b"))
    source = _MetaBlocks({name: tuple(p.shape) for name, p in causal.named_parameters()}, "transformer")  # the Hub file
    apply_tp(model, family, fake_world_of_eight["tp"])
    plan = plan_load(model, family, source)
    local = {
        name: param.to_local().numel() if hasattr(param, "to_local") else param.numel()
        for name, param in model.named_parameters()
    }
    assert {read.name: read.numel for read in plan.reads} == {n: local[n] for n in local if n != "score.weight"}
    assert list(plan.new) == ["score.weight"] and plan.unused == ["lm_head.bias", "lm_head.weight"]
    load_weights(model, plan, source, new, write=lambda param, block: None)
    assert source.most_alive == 1
    mine = sum(local.values())
    print(
        f"GPT-J 6B TP=8 rank 3: holds {mine * 4 / 1e9:.2f} GB of {whole * 4 / 1e9:.1f} GB (fp32); largest block "
        f"{max(source.read_elements) * 2 / 1e6:.1f} MB (fp16)"
    )
    assert mine < 0.13 * whole  # 1/8 plus the replicated LayerNorms and score
    assert max(source.read_elements) == max(n for name, n in local.items() if name != "score.weight")


@pytest.fixture
def fake_world_of_eight():
    with fake_tp_mesh(8, rank=3) as mesh:
        yield mesh


def test_summary_reports_load_peak_and_time(runs):
    summary = runs("gpt2", "tp2", "float16").summary
    assert len(summary["load_peak_mib_per_rank"]) == 2 and all(m > 100 for m in summary["load_peak_mib_per_rank"])
    assert 0 < summary["load_seconds"] < 120
    json.dumps(summary)


def test_hub_name_and_revision_resolve_through_the_cache(checkpoint, small_sst2, cache_dir, tmp_path):
    """A Hub name with `revision=` is fetched by one process per node into the Hugging Face cache and read from
    there by all: here the cache is filled beforehand and the Hub is off, so the run can only succeed through it."""
    name = f"testorg/small-gpt2-{tmp_path.name}"  # the session's cache (conftest.HUB_CACHE), a repository of its own
    repo = HUB_CACHE / f"models--{name.replace('/', '--')}"
    for revision, dtype, commit in (("main", "float32", "a" * 40), ("float16", "float16", "b" * 40)):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in checkpoint("gpt2", dtype).iterdir():
            (snapshot / file.name).symlink_to(file)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    run = launch(
        2,
        overrides("gpt2", name, small_sst2, cache_dir, revision="float16") + LAYOUTS["tp2"][1],
        tmp_path / "run",
        script=WORKER,
        recipe=recipe("gpt2"),
    )
    assert "(float16)" in run.output and "b" * 40 in run.output
    compare_with_file(
        load_file(run.output_dir / "loaded" / "model.safetensors"), checkpoint("gpt2", "float16"), "transformer"
    )


def test_a_checkpoint_missing_a_weight_is_refused(checkpoint, small_sst2, cache_dir, tmp_path):
    """One dense tensor removed from a Llama checkpoint: `--check` and the run refuse it in one line naming it,
    instead of training that layer from random values. The new classification head alone may be missing."""
    folder = tmp_path / "llama-without-q"
    folder.mkdir()
    for file in checkpoint("llama", "float32").iterdir():
        if file.name != "model.safetensors":
            (folder / file.name).symlink_to(file)
    tensors = load_file(checkpoint("llama", "float32") / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    message = (
        f"{folder / 'model.safetensors'}: 1 of the model's parameters are not in the checkpoint: "
        f"model.layers.1.self_attn.q_proj.weight; a pretrained model takes every weight from its checkpoint"
    )
    for task in ("causal_lm", "classification"):
        args = overrides("llama", folder, small_sst2, cache_dir, task=task)
        checked = check(*args, f"output_dir={tmp_path / task}", nproc=1, recipe=recipe("llama"))
        assert checked.returncode == 2 and checked.stderr.startswith(f"error: {message}"), checked.stderr
        assert checked.stderr.count("\n") == 1, checked.stderr
        config = load_config(recipe("llama"), args)
        family = get_family("llama")
        hf_config = family.config_for(
            model=config.model, head=task, max_length=config.max_length, tokenizer_size=0, pad_token_id=0
        )
        with pytest.raises(UserError) as exc:
            load_model(family, task, hf_config, str(folder), seed=42)
        assert str(exc.value).startswith(message) and "\n" not in str(exc.value)
    assert "(only the new classification head, score, starts from the seed)" in str(exc.value)


@pytest.mark.parametrize("layout", ["pp2", "fsdp2"])
def test_mixture_of_experts_loads_each_ranks_experts(layout, small_sst2, cache_dir, tmp_path_factory):
    """A Mixtral checkpoint in the Hub's per-expert layout (save_pretrained writes it) under `family: auto`: each
    pipeline stage builds its own layers' fused experts, each FSDP rank its block of them, through transformers'
    conversion; the weights as loaded equal what transformers' from_pretrained loads from the file."""
    from transformers import AutoModelForCausalLM

    folder = CACHE / "mixtral-float32"
    if not (folder / "config.json").is_file():
        sentences = column(read_glue_dir(small_sst2)["train"], "text")
        synthetic.write_checkpoint(folder, "mixtral", sentences, hidden=64, layers=4, heads=4, vocab_size=1024)
    out = tmp_path_factory.mktemp(f"mixtral-{layout}")
    args = overrides("llama", folder, small_sst2, cache_dir, task="causal_lm") + ["family=auto"]
    run = launch(2, args + LAYOUTS[layout][1], out, script=WORKER, recipe=recipe("llama"))
    expected = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(run.output_dir / "loaded").state_dict()
    assert set(loaded) == set(expected) and any(name.endswith("experts.gate_up_proj") for name in expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert "new (not in the checkpoint)" not in run.output
