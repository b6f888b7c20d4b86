"""Packed batches without a dense mask on GPUs: PyTorch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, CUDA) fed with each packed sequence's row boundaries.

It is registered in transformers' attention interface as `packed_varlen`, so every family whose attention goes
through that interface (SDPA's users: GPT-2, GPT-Neo, GPT-J's eager attention aside, Llama, Qwen 3, Mistral and
the other families made from plans) takes it: a model set to it runs SDPA for ordinary batches (the mask as
always) and, while `packed_rows(...)` holds a packed batch's boundaries, varlen attention over the flattened
tokens, each row (and the padding tail) a sequence of its own, causal within it. No (length x length) mask is
made. The runner sets the boundaries once per forward (`loop/runner.py`); the dense 4-D mask
(`families.base.packed_attention_mask`) stays the path on CPUs, under pipeline stages (whose micro-batches split
the rows) and wherever `varlen_unavailable` says why not, which the run logs once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

NAME = "packed_varlen"


@dataclass(frozen=True)
class PackedRows:
    """A packed batch's sequences over its flattened tokens: their starts and the end (cumulative, int32), and the
    longest one's length."""

    cumulative: torch.Tensor
    longest: int

    @classmethod
    def of_positions(cls, positions: torch.Tensor) -> PackedRows:
        """From a packed batch's positions (rows, length), restarting at 0 at every row and the padding tail."""
        flat = positions.reshape(-1)
        starts = torch.nonzero(flat == 0).squeeze(1)
        ends = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)])
        return cls(ends.to(torch.int32), int((ends[1:] - ends[:-1]).max()))


_ROWS: contextvars.ContextVar[PackedRows | None] = contextvars.ContextVar("packed_rows", default=None)


@contextlib.contextmanager
def packed_rows(rows: PackedRows | None):
    """For the duration, attention set to `packed_varlen` runs varlen over `rows` (None: ordinary batches)."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


@functools.cache
def _accepted(kernel) -> frozenset[str]:
    """The keyword arguments this release's varlen_attn takes (asked once, not in every layer's call)."""
    return frozenset(inspect.signature(kernel).parameters)


def _varlen(query, key, value, rows: PackedRows, scale, causal: bool):
    from torch.nn.attention.varlen import varlen_attn

    accepted = _accepted(varlen_attn)
    options = {"scale": scale}
    if "window_size" in accepted:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    else:  # earlier releases: a flag
        options["is_causal"] = causal
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        if "enable_gqa" in accepted:
            options["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    cu = rows.cumulative
    return varlen_attn(query, key, value, cu, cu, rows.longest, rows.longest, **options)


def packed_varlen_attention(
    module: nn.Module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs
):
    """transformers' attention interface: query (batch, heads, length, head dim), key and value (batch, kv heads,
    length, head dim) -> (batch, length, heads, head dim), None."""
    rows = _ROWS.get()
    if rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    batch, heads, length, dim = query.shape

    def flat(tensor):
        return tensor.transpose(1, 2).reshape(batch * length, tensor.shape[1], dim)

    out = _varlen(flat(query), flat(key), flat(value), rows, scaling, getattr(module, "is_causal", True))
    return out.reshape(batch, length, heads, dim), None


def _packed_varlen_mask(*args, **kwargs):
    """No mask while a packed batch's rows are set (varlen keeps the rows apart); SDPA's otherwise."""
    if _ROWS.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """`packed_varlen` in transformers' attention and mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, packed_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _packed_varlen_mask)


def varlen_unavailable(hf_config, device: torch.device, pipeline: bool) -> str | None:
    """Why a packed run keeps the dense mask (None: it can take varlen attention)."""
    if device.type != "cuda":
        return "varlen attention is CUDA's"
    if pipeline:
        return "pipeline stages split a packed batch's rows into micro-batches"
    if (hf_config._attn_implementation or "sdpa") != "sdpa":
        return f"attn_implementation={hf_config._attn_implementation}"
    if getattr(hf_config, "attention_dropout", 0.0) or getattr(hf_config, "attn_pdrop", 0.0):
        return "attention dropout (varlen has none)"
    if getattr(hf_config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None
