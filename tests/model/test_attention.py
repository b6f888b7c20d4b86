"""Packed attention without a dense mask (model/attention.py): the CUDA branch run on the CPU against the strict
stand-in of the flash kernel (model/standins.py), the way training runs it: bf16 autocast over fp32 weights, train
mode with the model's dropout, activation checkpointing whose backward runs on another thread (as CUDA's autograd
device thread does), compiled blocks; every family whose attention class goes through transformers' interface,
and the refusals (one logged reason) wherever a precondition of the kernel does not hold. TP=2, FSDP and packed
DPO pairs run end to end in tests/loop/test_varlen_runs.py.

Tolerance: the varlen branch and the dense mask compute the same attention from the same bf16 q, k and v (the
stand-in in fp32 then rounded to bf16, as flash accumulates; SDPA's CPU kernel the same), so the losses agree to
bf16's resolution: 1e-2 relative for losses and gradients covers one bf16 rounding (2^-8 = 3.9e-3) of the
attention output propagated through two blocks."""

from __future__ import annotations

import threading

import pytest
import torch

from parallel_finetune.data.batch import PackedBatcher, TokenizedSplit
from parallel_finetune.data.packing import PackedShape
from parallel_finetune.families import get_family
from parallel_finetune.families.plans import PlanFamily, mask_kind
from parallel_finetune.loop.loss import CLASS_OBJECTIVE, TOKEN_OBJECTIVE
from parallel_finetune.loop.runner import WholeModel, model_inputs
from parallel_finetune.model import attention, standins
from parallel_finetune.parallel.memory import apply_activation_checkpointing
from parallel_finetune.tasks.task import HeadKind

CPU = torch.device("cpu")
ROWS = [
    [int(t) for t in torch.randint(1, 200, (n,), generator=torch.Generator().manual_seed(n))] for n in (5, 9, 3, 7, 2)
]
LABELS = [0, 1, 1, 0, 1]
BF16 = 1e-2


def bf16_autocast():
    return torch.autocast("cpu", torch.bfloat16)


# ----------------------------------------------------------------------------------------------- the stand-in
def _inputs(tokens=10, heads=4, kv_heads=4, dim=16, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    return q, k, v, torch.tensor([0, 4, 10], dtype=torch.int32)


def _call(release="2.12", q=None, k=None, v=None, cu=None, longest=6, **options):
    base = _inputs()
    q, k, v, cu = (a if a is not None else b for a, b in zip((q, k, v, cu), base))
    return standins.varlen_attn_for(release)(q, k, v, cu, cu, longest, longest, **options)


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(q=_inputs()[0].float(), k=_inputs()[1].float()), "only supports fp16 and bf16"),  # fp32 q and k
        (dict(q=_inputs()[0].float()), "only supports fp16 and bf16"),  # RoPE's fp32 q beside a bf16 v
        (dict(v=_inputs()[2].half()), "same dtype"),
        (dict(cu=torch.tensor([0, 4, 10])), "int32"),
        (dict(cu=torch.tensor([0, 4, 9], dtype=torch.int32)), "run from 0 to the 10 tokens"),
        (dict(cu=torch.tensor([0, 7, 4, 10], dtype=torch.int32)), "never decreasing"),
        (dict(longest=5), "below the longest sequence"),
        (dict(q=_inputs(dim=12)[0], k=_inputs(dim=12)[1], v=_inputs(dim=12)[2]), "multiple of 8"),
        (dict(q=_inputs(dim=264)[0], k=_inputs(dim=264)[1], v=_inputs(dim=264)[2]), "<= 256"),
        (dict(q=_inputs()[0].transpose(0, 2).contiguous().transpose(0, 2)), "contiguous last dimension"),
    ],
)
def test_the_stand_in_refuses_what_the_kernel_refuses(change, error):
    with pytest.raises(standins.KernelContractError, match=error):
        _call(**change)


def test_the_stand_in_takes_each_releases_signature():
    kv = _inputs(kv_heads=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):  # the wrapper's own check
        _call(k=kv[1], v=kv[2])
    with pytest.raises(TypeError, match="enable_gqa"):  # 2.11 has no enable_gqa
        _call("2.11", k=kv[1], v=kv[2], enable_gqa=True)
    with pytest.raises(TypeError, match="scale"):  # 2.10 has no scale
        _call("2.10", scale=0.5)
    with pytest.raises(TypeError, match="window_size"):
        _call("2.10", window_size=(-1, 0))
    assert standins.release_of("2.13.0+cpu") == "2.12" and standins.release_of("2.11.0+cu130") == "2.11"
    out = _call(window_size=(-1, 0))
    assert out.dtype == torch.bfloat16 and out.shape == (10, 4, 16)


@pytest.mark.parametrize("release", sorted(standins.SIGNATURES))
def test_our_call_gives_the_same_attention_on_every_release(release, monkeypatch):
    """Grouped heads (repeated before 2.12), a model's own scale (folded into the query on 2.10), causal."""
    import torch.nn.attention.varlen as varlen

    q, k, v, cu = _inputs(kv_heads=2)
    expected = standins._reference(q, k, v, cu, 0.3, True).to(torch.bfloat16)
    monkeypatch.setattr(varlen, "varlen_attn", standins.varlen_attn_for(release))
    got = attention._varlen(q, k, v, cu, 6, 0.3, causal=True)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_the_stand_ins_gradients_are_in_the_inputs_dtypes():
    q, k, v, cu = (t.requires_grad_() if t.is_floating_point() else t for t in _inputs())
    out = standins.varlen_attn_for("2.12")(q, k, v, cu, cu, 6, 6, window_size=(-1, 0))
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert {g.dtype for g in grads} == {torch.bfloat16}
    reference = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(standins._reference(*reference, cu, None, True).square().sum(), reference)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


# ----------------------------------------------------------------------------------------------- training, in-process
def tiny(family_name: str, head: HeadKind, implementation: str, dropout: float):
    """A tiny model of the family with its hidden dropout at `dropout` and no attention dropout (varlen has none)."""
    family = get_family(family_name)
    config = family.sized_config(200, 128, 32, 2, 2)
    if family_name in ("llama", "qwen3", "mistral"):
        config.num_attention_heads, config.num_key_value_heads = 4, 2  # grouped heads, head dim 8
        config.head_dim = 8
    for key in family.dropout_keys:
        setattr(config, key, 0.0 if key in attention.ATTENTION_DROPOUT_KEYS else dropout)
    family.set_task(config, head, 0)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    model = family.hf_model(head, config)
    family.surgery(model)
    if isinstance(family, PlanFamily):
        for number, block in enumerate(family.blocks(model)):
            block.attention_kind = mask_kind(config, number)
    return family, model.train()


def packed_batch(family, head: HeadKind, rows=ROWS):
    lengths = [len(row) for row in rows]
    targets = [1] * len(rows) if head is HeadKind.CLASSIFICATION else [n - 1 for n in lengths]
    labels = LABELS[: len(rows)] if head is HeadKind.CLASSIFICATION else None
    split = TokenizedSplit(head, rows, lengths, targets, labels, False)
    shape = PackedShape(capacity=12, pooled=family.pooled_token)
    return PackedBatcher(split, pad_id=0, shape=shape, device=CPU).batch(list(range(len(rows))))


def train_step(family_name: str, head: HeadKind, implementation: str):
    """One bf16-autocast step over fp32 weights with dropout and checkpointing, the backward on another thread:
    (loss, gradients by name)."""
    family, model = tiny(family_name, head, implementation, dropout=0.1)
    apply_activation_checkpointing(family.blocks(model), True)
    loss_function = CLASS_OBJECTIVE if head is HeadKind.CLASSIFICATION else TOKEN_OBJECTIVE
    runner = WholeModel(model, head, loss_function, bf16_autocast, None, False, CPU, packing=family)
    batch = packed_batch(family, head)
    assert batch.rows < len(ROWS)  # rows share sequences
    torch.manual_seed(1)
    loss, _ = runner.summed_loss(batch)
    failures = []

    def backward():
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - reported below, on the test's thread
            failures.append(exc)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# every family whose model class routes attention through transformers' interface (the others keep the mask)
VARLEN_FAMILIES = [
    ("gpt2", HeadKind.CAUSAL_LM),
    ("gpt2", HeadKind.CLASSIFICATION),
    ("bert", HeadKind.CLASSIFICATION),
    ("llama", HeadKind.CAUSAL_LM),
    ("qwen3", HeadKind.CAUSAL_LM),
    ("mistral", HeadKind.CAUSAL_LM),
]


@pytest.mark.parametrize("family_name,head", VARLEN_FAMILIES, ids=[f"{f}-{h}" for f, h in VARLEN_FAMILIES])
def test_the_varlen_branch_trains_like_the_dense_mask(family_name, head):
    with standins.install():
        calls = []
        kernel = torch.nn.attention.varlen.varlen_attn

        def counted(*args, **kwargs):
            calls.append(args[0].dtype)
            return kernel(*args, **kwargs)

        counted.__signature__ = kernel.__signature__
        torch.nn.attention.varlen.varlen_attn = counted
        attention.register()
        dense_loss, dense_grads = train_step(family_name, head, "sdpa")
        assert not calls
        loss, grads = train_step(family_name, head, attention.NAME)
    # 2 blocks x (forward + its recompute in the backward), every call in bf16
    assert len(calls) == 4 and set(calls) == {torch.bfloat16}
    assert loss == pytest.approx(dense_loss, rel=BF16)
    assert grads.keys() == dense_grads.keys()
    # a gradient's difference against the largest gradient of the model: a key bias's gradient is zero in exact
    # arithmetic (softmax ignores a shift of every key), so its own size is no scale to hold rounding to
    largest = max(g.abs().max() for g in dense_grads.values())
    worst = max((grad - dense_grads[name]).abs().max() / largest for name, grad in grads.items())
    print(f"{family_name} {head}: loss {loss:.6g} vs {dense_loss:.6g}, largest gradient difference {worst:.2e}")
    assert worst < BF16


def test_compiled_blocks_trace_varlen_once_for_every_packing():
    """Compiled blocks (dynamic shapes, as compile_blocks makes them) take a packed batch of other boundaries and
    row count without recompiling and without a graph break in our attention function."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    with standins.install():
        family, model = tiny("llama", HeadKind.CAUSAL_LM, attention.NAME, dropout=0.0)
        apply_activation_checkpointing(family.blocks(model), True)
        for block in family.blocks(model):
            block.compile(dynamic=True, backend="aot_eager")
        runner = WholeModel(model, HeadKind.CAUSAL_LM, TOKEN_OBJECTIVE, bf16_autocast, None, False, CPU, packing=family)
        graphs = []
        for rows in (ROWS, [r + r[:2] for r in ROWS[1:]]):  # other boundaries, another row count
            runner.summed_loss(packed_batch(family, HeadKind.CAUSAL_LM, rows))[0].backward()
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs  # traced once, never again
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_an_ordinary_batch_on_the_varlen_model_is_sdpas():
    """Without row boundaries, `packed_varlen` is SDPA with the padding mask (evaluation, generation)."""
    attention.register()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    outputs = []
    for implementation in ("sdpa", attention.NAME):
        _, model = tiny("llama", HeadKind.CAUSAL_LM, implementation, dropout=0.0)
        with torch.no_grad():
            outputs.append(model.eval()(input_ids=ids, attention_mask=mask).logits)
    torch.testing.assert_close(outputs[1], outputs[0])


def test_a_packed_varlen_batch_hands_the_rows_and_no_mask():
    family, model = tiny("llama", HeadKind.CAUSAL_LM, attention.NAME, dropout=0.0)
    batch = packed_batch(family, HeadKind.CAUSAL_LM)
    inputs = model_inputs(batch, family, model)
    starts = (batch.positions.reshape(-1) == 0).nonzero().squeeze(1).tolist()
    assert inputs["cu_seq_lens_q"].tolist() == [*starts, batch.positions.numel()]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32 and inputs["max_length_q"] == batch.positions.shape[1]
    assert bool(inputs["attention_mask"].all())  # SDPA's mask function makes none for it


def test_dropout_never_reaches_the_kernel_silently():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="no dropout"):
        attention.packed_varlen_attention(torch.nn.Module(), q, q, q, None, dropout=0.1, cu_seq_lens_q=torch.zeros(2))


# ----------------------------------------------------------------------------------------------- where the mask stays
def _why(family_name, head=HeadKind.CAUSAL_LM, device="cuda", pipeline=False, dtype=torch.bfloat16, **config):
    family = get_family(family_name)
    hf_config = family.sized_config(200, 128, 32, 2, 2)
    for key, value in config.items():
        setattr(hf_config, key, value)
    with standins.install() if device == "cuda" else _nothing():
        return attention.varlen_unavailable(
            hf_config, family.model_classes[head], torch.device("cpu" if device == "cuda" else device), pipeline, dtype
        )


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    "family_name,head,options,why",
    [
        ("llama", HeadKind.CAUSAL_LM, dict(device="cpu"), "CUDA's"),
        ("llama", HeadKind.CAUSAL_LM, dict(pipeline=True), "pipeline stages"),
        ("gptj", HeadKind.CAUSAL_LM, {}, "GPTJForCausalLM's attention does not go through"),
        ("gptneo", HeadKind.CLASSIFICATION, {}, "GPTNeoForSequenceClassification's attention does not go through"),
        ("llama", HeadKind.CAUSAL_LM, dict(dtype=torch.float32), "fp16 or bf16, this run in float32"),
        ("bert", HeadKind.CLASSIFICATION, dict(attention_probs_dropout_prob=0.1), "attention_probs_dropout_prob=0.1"),
        ("gpt2", HeadKind.CAUSAL_LM, dict(attn_pdrop=0.1), "attn_pdrop=0.1"),
        ("llama", HeadKind.CAUSAL_LM, dict(attention_dropout=0.1), "attention_dropout=0.1"),
        ("llama", HeadKind.CAUSAL_LM, dict(head_dim=12), "head dimension 12"),
        ("llama", HeadKind.CAUSAL_LM, dict(head_dim=512), "head dimension 512"),
    ],
)
def test_the_dense_mask_stays_where_the_kernel_cannot_run(family_name, head, options, why):
    config = {k: v for k, v in options.items() if k not in ("device", "pipeline", "dtype")}
    settings = {k: v for k, v in options.items() if k in ("device", "pipeline", "dtype")}
    if family_name == "bert":
        config.setdefault("hidden_dropout_prob", 0.0)
    else:
        for key in get_family(family_name).dropout_keys:
            config.setdefault(key, 0.0)
    assert why in _why(family_name, head, **settings, **config)


def test_old_gpus_keep_the_mask(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "compute capability 8.0 or newer, this GPU has 7.5" in attention.device_refusal(torch.device("cuda"))


def test_every_varlen_family_passes_the_gate():
    for family_name, head in VARLEN_FAMILIES:
        family = get_family(family_name)
        config = {key: 0.0 for key in family.dropout_keys}
        assert _why(family_name, head, **config) is None, family_name
