"""Packed batches without a dense mask on GPUs: PyTorch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, CUDA) fed with each packed sequence's row boundaries.

It is registered in transformers' attention interface as `packed_varlen`. A model set to it runs SDPA for ordinary
batches (their padding mask as always) and varlen attention for a packed batch, whose row boundaries travel in the
forward's own keyword arguments (`varlen_inputs`: transformers' flash-attention names `cu_seq_lens_q`, ...), which
every model whose class routes attention through that interface hands down to it. Arguments, not a context
variable: activation checkpointing recomputes a block with the arguments it saved, on whatever thread autograd runs
it (CUDA's backward runs on a device thread of its own), and a compiled block reads no state from outside its
graph. Each row (and the padding tail) is a sequence of its own, causal within it (bidirectional for BERT); no
(length x length) mask is made: the packed batch's 2-D mask is all ones, for which SDPA's mask function makes none.

The flash kernel's contract decides where it runs (`varlen_unavailable`, said once by the run): CUDA from sm80,
fp16 or bf16 compute (under autocast q and k leave RoPE in fp32 while v is 16-bit: they are cast to the autocast
dtype, since autocast does not cast a custom op's inputs), a head dimension flash takes, no attention dropout, a
family whose attention class goes through the interface (not GPT-J's or GPT-Neo's), no pipeline stages (their
micro-batches split the rows). Elsewhere the dense 4-D mask (`families.base.packed_attention_mask`) stays the path.
The tests run this branch on the CPU against a strict stand-in of the kernel (model/standins.py).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

NAME = "packed_varlen"
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The config keys of attention dropout across transformers' families (Llama, Qwen 3, Mistral, GPT-Neo: the first;
# GPT-2, GPT-J: the second; BERT: the third): varlen attention has no dropout, so a model with any keeps the mask.
ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


# transformers' names for a packed batch's sequences (its flash-attention keyword arguments), handed down by every
# model whose attention goes through the interface
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def varlen_inputs(positions: torch.Tensor) -> dict:
    """The keyword arguments that carry a packed batch's sequences to `packed_varlen_attention`, from its
    positions (rows, length), which restart at 0 at every row and at the padding tail: the sequences' starts over
    the flattened tokens and the end (cumulative, int32, as the kernel takes them), and a bound on their length.
    The bound is the packed length, not the longest row: an upper bound is what the kernel needs, and one that is
    the same for every batch of a shape keeps a compiled block from recompiling per batch."""
    flat = positions.reshape(-1)
    starts = torch.nonzero(flat == 0).squeeze(1)
    cumulative = torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    length = positions.shape[-1]
    return dict(zip(VARLEN_KEYS, (cumulative, cumulative, length, length)))


_ACCEPTED: dict = {}


def _accepted(kernel) -> frozenset[str]:
    """The keyword arguments this release's varlen_attn takes: asked once per kernel (register() asks before any
    block runs, so a compiled block finds it in the dict and traces no signature inspection)."""
    found = _ACCEPTED.get(kernel)
    if found is None:
        found = _ACCEPTED[kernel] = frozenset(inspect.signature(kernel).parameters)
    return found


def _varlen(query, key, value, cumulative, longest: int, scale, causal: bool):
    from torch.nn.attention import varlen

    kernel = varlen.varlen_attn
    accepted = _accepted(kernel)
    options = {}
    if "scale" in accepted:
        options["scale"] = scale
    elif scale is not None:  # torch 2.10 scales by 1/sqrt(head dim) only: fold the model's scale into the query
        query = query * (scale * math.sqrt(query.shape[-1]))
    if "window_size" in accepted:
        options["window_size"] = (-1, 0) if causal else (-1, -1)
    else:  # torch 2.10: a flag
        options["is_causal"] = causal
    if key.shape[1] != query.shape[1]:  # grouped-query attention
        if "enable_gqa" in accepted:
            options["enable_gqa"] = True
        else:  # before torch 2.12 the kernel takes as many key/value heads as query heads
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    return kernel(query, key, value, cumulative, cumulative, longest, longest, **options)


def kernel_dtype(query: torch.Tensor) -> torch.dtype:
    """What the flash kernel computes in: autocast's dtype where autocast is on (it does not cast a custom op's
    inputs), else the inputs' own; fp32 is refused before training (varlen_unavailable)."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    if dtype not in FLASH_DTYPES:
        raise RuntimeError(f"packed_varlen attention needs fp16 or bf16 compute, got {dtype} (varlen_unavailable)")
    return dtype


def packed_varlen_attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query (batch, heads, length, head dim), key and value (batch, kv heads,
    length, head dim) -> (batch, length, heads, head dim), None. A packed batch (`varlen_inputs` among the keyword
    arguments) runs varlen; any other batch SDPA with its mask."""
    rows = {name: kwargs.pop(name, None) for name in VARLEN_KEYS}
    if rows["cu_seq_lens_q"] is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout:  # varlen_unavailable keeps models with attention dropout on the mask; never drop it silently
        raise RuntimeError(f"packed_varlen attention has no dropout, and this layer asks for {dropout}")
    batch, heads, length, dim = query.shape
    dtype = kernel_dtype(query)

    def flat(tensor):
        return tensor.transpose(1, 2).reshape(batch * length, tensor.shape[1], dim).to(dtype)

    causal = getattr(module, "is_causal", True)
    out = _varlen(flat(query), flat(key), flat(value), rows["cu_seq_lens_q"], rows["max_length_q"], scaling, causal)
    return out.reshape(batch, length, heads, dim), None


def register() -> None:
    """`packed_varlen` in transformers' attention interface, and SDPA's mask function under its name: ordinary
    batches get SDPA's mask, a packed batch's all-ones mask none."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, packed_varlen_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    try:
        from torch.nn.attention import varlen
    except ImportError:  # varlen_unavailable says so; nothing will call the kernel
        return
    _accepted(varlen.varlen_attn)


def device_refusal(device: torch.device) -> str | None:
    """Why this device cannot run the flash kernel (None: it can). The stand-ins (model/standins.py) replace it
    to run the CUDA branch on a CPU."""
    if device.type != "cuda":
        return "varlen attention is CUDA's"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flash attention needs compute capability 8.0 or newer, this GPU has {major}.{minor}"
    return None


def head_dim(hf_config) -> int:
    """Each attention head's width: the config's own (Qwen 3) or the hidden width over the heads."""
    explicit = getattr(hf_config, "head_dim", None)
    return explicit or hf_config.hidden_size // hf_config.num_attention_heads


def varlen_unavailable(
    hf_config, model_class: type, device: torch.device, pipeline: bool, compute_dtype: torch.dtype
) -> str | None:
    """Why a packed run keeps the dense mask (None: it can take varlen attention): every precondition of the flash
    kernel and of handing it the rows, checked before the model is built."""
    why = device_refusal(device)
    if why:
        return why
    if pipeline:
        return "pipeline stages split a packed batch's rows into micro-batches"
    if (hf_config._attn_implementation or "sdpa") != "sdpa":
        return f"attn_implementation={hf_config._attn_implementation}"
    if not getattr(model_class, "_supports_attention_backend", False):
        return f"{model_class.__name__}'s attention does not go through transformers' attention interface"
    if compute_dtype not in FLASH_DTYPES:
        return f"the flash kernel computes in fp16 or bf16, this run in {str(compute_dtype).removeprefix('torch.')}"
    for key in ATTENTION_DROPOUT_KEYS:
        if getattr(hf_config, key, 0.0):
            return f"attention dropout ({key}={getattr(hf_config, key)}; varlen attention has none)"
    if getattr(hf_config, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    dim = head_dim(hf_config)
    if dim > 256 or dim % 8:
        return f"head dimension {dim} (flash takes at most 256, a multiple of 8)"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None
