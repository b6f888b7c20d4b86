"""Packed attention without a dense mask (model/attention.py): the varlen path's plumbing, on the CPU with a
stand-in for CUDA's kernel. The stand-in attends within each sequence that `cu_seq` delimits (SDPA per sequence),
so the test holds what this project adds: the packed rows found from the positions, the tokens flattened and
handed over with grouped-query heads, the mask left out, ordinary batches still on SDPA. The kernel itself (flash
attention) is a GPU check: `make bench-gpu` compares its logits with the dense mask's."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F

from parallel_finetune.data.batch import PackedBatcher, TokenizedSplit
from parallel_finetune.data.packing import PackedShape
from parallel_finetune.families import get_family
from parallel_finetune.loop.loss import token_loss
from parallel_finetune.loop.runner import WholeModel
from parallel_finetune.model import attention
from parallel_finetune.tasks.task import HeadKind

ROWS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]


def stand_in(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """What varlen_attn computes, one sequence at a time: (tokens, heads, dim) in, the same out."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    out = torch.empty_like(query)
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
        part = F.scaled_dot_product_attention(
            q, k, v, scale=scale, is_causal=window_size == (-1, 0), enable_gqa=enable_gqa
        )
        out[start:end] = part[0].transpose(0, 1)
    return out


def tiny_llama(implementation: str):
    family = get_family("llama")
    config = family.sized_config(120, 64, 32, 2, 4)
    config.num_key_value_heads = 2  # grouped-query attention: 4 query heads share 2 key/value heads
    family.set_task(config, HeadKind.CAUSAL_LM, 0)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    return family, family.hf_model(HeadKind.CAUSAL_LM, config).eval()


def test_varlen_packed_logits_equal_the_dense_masks(monkeypatch):
    import torch.nn.attention.varlen as varlen

    calls = []

    @functools.wraps(stand_in)  # the kernel's signature: the wrapper asks it which options it takes
    def counted(*args, **kwargs):
        calls.append(kwargs)
        return stand_in(*args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", counted)
    attention.register()
    split = TokenizedSplit(HeadKind.CAUSAL_LM, ROWS, [len(r) for r in ROWS], [len(r) - 1 for r in ROWS])
    batch = PackedBatcher(split, pad_id=0, shape=PackedShape(capacity=12), device=torch.device("cpu")).batch(range(4))
    assert batch.rows < len(ROWS)  # rows share sequences
    logits = []
    for implementation in ("sdpa", attention.NAME):
        family, model = tiny_llama(implementation)
        runner = WholeModel(
            model,
            HeadKind.CAUSAL_LM,
            token_loss,
            contextlib.nullcontext,
            None,
            False,
            torch.device("cpu"),
            packing=family,
        )
        with torch.no_grad():
            logits.append(runner.forward(batch))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 and calls[0]["enable_gqa"]  # both blocks went through varlen, with grouped heads
    rows = attention.PackedRows.of_positions(batch.positions)
    starts = (batch.positions.reshape(-1) == 0).nonzero().squeeze(1).tolist()
    assert rows.cumulative.tolist() == [*starts, batch.positions.numel()]


def test_an_ordinary_batch_on_the_varlen_model_is_sdpas():
    """Without packed rows set, `packed_varlen` is SDPA with the mask (evaluation and generation batches)."""
    attention.register()
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    outputs = []
    for implementation in ("sdpa", attention.NAME):
        _, model = tiny_llama(implementation)
        with torch.no_grad():
            outputs.append(model(input_ids=ids, attention_mask=mask).logits)
    torch.testing.assert_close(outputs[1], outputs[0])


@pytest.mark.parametrize("device,pipeline,why", [("cpu", False, "CUDA's"), ("cuda", True, "pipeline stages")])
def test_the_dense_mask_stays_where_varlen_cannot_run(device, pipeline, why):
    _, model = tiny_llama("sdpa")
    assert why in attention.varlen_unavailable(model.config, torch.device(device), pipeline)
