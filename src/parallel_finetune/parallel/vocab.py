"""A language model's head and cross-entropy computed together, in chunks of tokens, without ever holding the
logits of every token over the whole vocabulary; under tensor parallelism each rank computes only its own
vocabulary shard's logits (vocabulary-parallel), and the log-sum-exp and the target's logit are reduced across
the tensor-parallel group.

    token_nll(hidden, head, labels, chunk_tokens) -> each token's -log p(label) (fp32), differentiable

Forward: for each chunk of `chunk_tokens` rows of `hidden` (already only the positions that have a label), the
logits of this rank's vocabulary shard are made in the compute dtype (autocast's, else the weight's), taken to
fp32, and reduced to each row's log-sum-exp and the label's logit (max, then sum of exponentials, over the group);
the logits are dropped before the next chunk. Only the log-sum-exp per row is kept for the backward, which makes
each chunk's logits again and turns them into the gradients of the hidden states (summed over the group: every
rank's shard contributes), of the weight shard and of its bias. Peak memory of the logits: one chunk's of one
shard (chunk_tokens x vocabulary / tp), instead of every token's over the whole vocabulary, in fp32 and again for
the softmax and its gradient. Beside them the backward holds the weight shard's gradient in fp32 (vocabulary / tp x
hidden) and, per chunk, that chunk's contribution in the compute dtype and again in fp32 before it is added: at a
128k vocabulary and width 2048 on one rank about 1 GB + 0.5 GB + 1 GB of temporaries, whatever the token count.

Liger-Kernel's fused linear cross-entropy and torchtitan's chunked loss do the same for one device; Megatron's
vocab-parallel cross-entropy reduces over the group the same way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2 and 3's final logit soft-capping (their config's final_logit_softcapping), or the logits as they are."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


@dataclass(frozen=True)
class _Shard:
    """How token_nll runs over one rank's vocabulary shard: the shard's first id, the group holding the others
    (None: this rank holds every row), the chunk, the compute dtype, the logit soft-capping and the factor the
    capped logits are multiplied by (1 / a sampling temperature: task=grpo's, TRL's)."""

    vocab_start: int
    group: object
    chunk_tokens: int
    dtype: torch.dtype
    softcap: float | None
    scale: float = 1.0


class _ChunkedVocabNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, shard: _Shard):
        vocab_start, group, chunk_tokens, dtype, softcap, scale = vars(shard).values()  # (astuple copies the group)
        rows, vocab = hidden.shape[0], weight.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        nll = torch.empty_like(lse)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for start in range(0, rows, chunk_tokens):
                part = slice(start, start + chunk_tokens)
                logits = _capped(F.linear(hidden[part].to(dtype), w, b).float(), softcap)
                if scale != 1.0:
                    logits *= scale
                peak = logits.max(-1).values
                if group is not None:
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
                target = labels[part] - vocab_start
                mine = (target >= 0) & (target < vocab)
                picked = logits.gather(1, target.clamp(0, vocab - 1)[:, None]).squeeze(1) * mine
                # one fp32 temporary beside the logits: the shifted values, exponentiated in place
                sums = torch.stack([torch.sub(logits, peak[:, None]).exp_().sum(-1), picked])
                del logits
                if group is not None:
                    dist.all_reduce(sums, group=group)
                lse[part] = sums[0].log() + peak
                nll[part] = lse[part] - sums[1]
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.vocab_start, ctx.group, ctx.chunk_tokens, ctx.dtype = vocab_start, group, chunk_tokens, dtype
        ctx.softcap, ctx.scale = softcap, scale
        return nll

    @staticmethod
    def backward(ctx, grad_nll):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        dtype, vocab = ctx.dtype, weight.shape[0]
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) if want_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), bias.to(dtype) if bias is not None else None
            for start in range(0, hidden.shape[0], ctx.chunk_tokens):
                part = slice(start, start + ctx.chunk_tokens)
                h = hidden[part].to(dtype)
                # d nll / d logits = softmax - one-hot(label), for this shard's columns
                raw = F.linear(h, w, b).float()
                # the softmax made in place (in the raw logits themselves when nothing caps them)
                grad = _capped(raw, ctx.softcap)
                if ctx.scale != 1.0:  # (in raw itself only when nothing caps, and raw is then not read again)
                    grad.mul_(ctx.scale)
                grad.sub_(lse[part, None]).exp_()
                target = labels[part] - ctx.vocab_start
                mine = (target >= 0) & (target < vocab)
                # minus one at each row's label where this shard holds it: a scatter, no host sync for the rows
                grad.scatter_add_(1, target.clamp(0, vocab - 1)[:, None], -mine.to(grad.dtype)[:, None])
                grad *= grad_nll[part, None] if ctx.scale == 1.0 else grad_nll[part, None] * ctx.scale
                if ctx.softcap is not None:  # through cap * tanh(raw / cap)
                    grad *= 1 - torch.tanh(raw / ctx.softcap).square()
                del raw
                if want_hidden:
                    grad_hidden[part] = (grad.to(dtype) @ w).float()
                if want_weight:
                    grad_weight += (grad.to(dtype).T @ h).float()
                if want_bias:
                    grad_bias += grad.sum(0)
                del grad
        if want_hidden and ctx.group is not None:  # every shard's columns contribute to each hidden state's gradient
            dist.all_reduce(grad_hidden, group=ctx.group)
        return (
            grad_hidden.to(hidden.dtype) if want_hidden else None,
            grad_weight.to(weight.dtype) if want_weight else None,
            grad_bias.to(bias.dtype) if want_bias else None,
            None,
            None,
        )


def _local(tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, int, object]:
    """A head parameter as this rank's tensor, the first vocabulary id of its rows, and the group that holds the
    other rows (None: this rank holds every row)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0, None
    sharded = [dim for dim, placement in enumerate(tensor.placements) if isinstance(placement, Shard)]
    if not sharded:
        return tensor.to_local(), 0, None
    if len(sharded) > 1 or tensor.placements[sharded[0]].dim != 0:
        raise ValueError(f"a head sharded as {tensor.placements} is not vocabulary-parallel")
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), offset[0], tensor.device_mesh.get_group(sharded[0])


def token_nll(
    hidden: torch.Tensor,
    head: nn.Linear,
    labels: torch.Tensor,
    chunk_tokens: int,
    softcap: float | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """Each row's -log p(label) (fp32) under `head` (an nn.Linear over the vocabulary, whole, or sharded over its
    rows by tensor parallelism), from `hidden` (rows, hidden size) and `labels` (rows,), `chunk_tokens` rows at a
    time; `softcap`: the model's final logit soft-capping; `scale`: what the capped logits are multiplied by (1 /
    temperature: the tempered distribution). Every rank of a tensor-parallel group calls it with the same rows."""
    if isinstance(hidden, DTensor):  # a replicated activation: every rank holds it whole
        hidden = hidden.to_local()
    weight, vocab_start, group = _local(head.weight)
    bias = _local(head.bias)[0] if head.bias is not None else None
    dtype = _compute_dtype(weight)
    shard = _Shard(vocab_start, group, max(1, chunk_tokens), dtype, softcap, scale)
    return _ChunkedVocabNLL.apply(hidden, weight, bias, labels, shard)


@contextlib.contextmanager
def head_replaced(model: nn.Module, module: nn.Module):
    """`model`'s output embeddings are `module` for the duration (the original stays the model's: in its state
    dict, its FSDP and tensor-parallel hooks; it is what token_nll computes with)."""
    original = model.get_output_embeddings()
    model.set_output_embeddings(module)
    try:
        yield original
    finally:
        model.set_output_embeddings(original)
