"""Strict CPU stand-ins for the CUDA-only kernels this project calls, so that the CUDA branches run on a CPU in the
tests and in `make bench-gpu`'s dry run (bench/gpu.py --dry-run) exactly as training runs them.

A stand-in is not a permissive imitation: it enforces the real kernel's documented contract and refuses, with the
error the kernel would raise, every call the kernel would refuse; only then does it compute the result (in fp32,
cast to the inputs' dtype, as the kernel accumulates). Today that is one kernel:

`torch.nn.attention.varlen.varlen_attn` (flash attention over variable-length sequences; CUDA, torch 2.10+):
  - query, key, value: 3-D (tokens, heads, head dim), one dtype for all three, fp16 or bf16 only (flash takes no
    fp32; autocast does not cast a custom op's inputs), the last dimension contiguous, the same head dimension,
    at most 256 and a multiple of 8; key and value the same shape;
  - as many key/value heads as query heads, unless `enable_gqa` (torch 2.12+) and they divide the query heads;
  - cu_seq_q, cu_seq_k: 1-D int32, contiguous, starting at 0, never decreasing, ending at the token count;
  - max_q, max_k: Python ints at least the longest sequence (a smaller one reads past the kernel's blocks);
  - no dropout (it has none); the backward takes a gradient in the output's dtype;
  - the signature of each release: 2.10 `is_causal` and no `scale`; 2.11 `scale` and `window_size`; 2.12 on also
    `enable_gqa` (`SIGNATURES`). A keyword the release lacks is a TypeError, as it would be.
It is a `torch.library` custom op with a fake implementation and an autograd formula, as the real one is, so
autocast, torch.compile and activation checkpointing treat it as they treat the kernel.

`install()` puts it in place of the kernel for the torch release named (default: the installed one) and lets
model/attention.py's device check accept the CPU: the CUDA branch then runs here, stand-in and all.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch
import torch.nn.functional as F

# What each torch release's varlen_attn takes besides (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k).
SIGNATURES: dict[str, frozenset[str]] = {
    "2.10": frozenset({"is_causal", "return_aux"}),
    "2.11": frozenset({"return_aux", "scale", "window_size"}),
    "2.12": frozenset({"return_aux", "scale", "window_size", "enable_gqa"}),
}
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


class KernelContractError(RuntimeError):
    """A call the real kernel would refuse (its message is the precondition that failed)."""


def release_of(version: str) -> str:
    """The SIGNATURES entry for a torch version string ("2.13.0+cpu" -> "2.12": the newest at or below it)."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    known = sorted(SIGNATURES, key=lambda name: tuple(int(p) for p in name.split(".")))
    at_or_below = [name for name in known if tuple(int(p) for p in name.split(".")) <= (major, minor)]
    if not at_or_below:
        raise KernelContractError(f"torch {version} has no torch.nn.attention.varlen (it came in 2.10)")
    return at_or_below[-1]


def check_varlen_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa: bool) -> None:
    """The flash kernel's preconditions (torch's flash_api and varlen_attn), or KernelContractError."""
    tensors = {"query": query, "key": key, "value": value}
    for name, tensor in tensors.items():
        if tensor.dim() != 3:
            shape = tuple(tensor.shape)
            raise KernelContractError(f"varlen_attn: {name} must be (tokens, heads, head dim), got {shape}")
        if tensor.dtype not in FLASH_DTYPES:
            raise KernelContractError(f"FlashAttention only supports fp16 and bf16 data type, {name} is {tensor.dtype}")
        if tensor.stride(-1) != 1:
            raise KernelContractError(f"varlen_attn: {name} must have a contiguous last dimension")
    if not (query.dtype == key.dtype == value.dtype):
        raise KernelContractError(
            f"query and key must have the same dtype: query {query.dtype}, key {key.dtype}, value {value.dtype}"
        )
    if key.shape != value.shape:
        raise KernelContractError(f"varlen_attn: key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    dim = query.shape[-1]
    if key.shape[-1] != dim:
        raise KernelContractError(f"varlen_attn: query head dim {dim}, key head dim {key.shape[-1]}")
    if dim > FLASH_MAX_HEAD_DIM or dim % 8:
        raise KernelContractError(f"FlashAttention takes a head dimension <= 256 and a multiple of 8, got {dim}")
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads != kv_heads and not (enable_gqa and heads % kv_heads == 0):
        raise KernelContractError(f"varlen_attn: {heads} query heads and {kv_heads} key/value heads without enable_gqa")
    sides = (("cu_seq_q", cu_seq_q, query.shape[0], max_q), ("cu_seq_k", cu_seq_k, key.shape[0], max_k))
    for name, cu, tokens, longest in sides:
        if cu.dtype != torch.int32 or cu.dim() != 1 or not cu.is_contiguous():
            raise KernelContractError(f"{name} must be a contiguous 1-D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
        if not isinstance(longest, int):
            raise KernelContractError(f"varlen_attn: max length for {name} must be a Python int, got {type(longest)}")
        starts = cu.tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        if not starts or starts[0] != 0 or starts[-1] != tokens or min(lengths, default=0) < 0:
            raise KernelContractError(f"{name} must run from 0 to the {tokens} tokens, never decreasing, got {starts}")
        if lengths and max(lengths) > longest:
            raise KernelContractError(f"varlen_attn: max length {longest} below the longest sequence ({max(lengths)})")


def _reference(query, key, value, cu_seq, scale, causal):
    """Each sequence's attention, in fp32: (tokens, heads, dim)."""
    out = []
    bounds = cu_seq.tolist()
    groups = query.shape[1] // key.shape[1]
    for start, end in zip(bounds, bounds[1:]):
        q, k, v = (t[start:end].float().transpose(0, 1) for t in (query, key, value))
        if groups > 1:
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        part = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, is_causal=causal)
        out.append(part[0].transpose(0, 1))
    return torch.cat(out) if out else query.float().new_zeros(query.shape)


@torch.library.custom_op("parallel_finetune_standin::varlen_attn", mutates_args=())
def _standin_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_lengths: list[int],
    scale: float,
    is_causal: bool,
) -> torch.Tensor:
    """The kernel's forward: its contract checked where the kernel checks it, at run time (a compiled graph holds
    the op opaque, as it holds flash's); grouped heads were allowed by the wrapper (enable_gqa)."""
    max_q, max_k = max_lengths
    check_varlen_call(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa=True)
    return _reference(query, key, value, cu_seq_q, scale, is_causal).to(query.dtype)


@_standin_op.register_fake
def _(query, key, value, cu_seq_q, cu_seq_k, max_lengths, scale, is_causal):
    return torch.empty_like(query)


@torch.library.custom_op("parallel_finetune_standin::varlen_attn_backward", mutates_args=())
def _standin_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's backward, an op of its own as flash's is (compiled graphs hold it opaque, as they hold that):
    softmax attention's gradients written out (an op's body runs below autograd), in fp32, per sequence."""
    grads = [torch.zeros(t.shape, dtype=torch.float32) for t in (query, key, value)]
    bounds = cu_seq_q.tolist()
    groups = query.shape[1] // key.shape[1]
    for start, end in zip(bounds, bounds[1:]):
        q, k, v, d_out = (t[start:end].float().transpose(0, 1) for t in (query, key, value, grad))
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        scores = scale * q @ k.transpose(1, 2)
        if is_causal:
            n = end - start
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = scores.softmax(-1)
        d_v = p.transpose(1, 2) @ d_out
        d_p = d_out @ v.transpose(1, 2)
        d_s = p * (d_p - (d_p * p).sum(-1, keepdim=True))
        d_q, d_k = scale * d_s @ k, scale * d_s.transpose(1, 2) @ q
        for total, part in zip(grads, (d_q, d_k, d_v)):
            heads = total.shape[1]
            total[start:end] = part.unflatten(0, (heads, -1)).sum(1).transpose(0, 1)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (query, key, value)))


@_standin_backward_op.register_fake
def _(grad, query, key, value, cu_seq_q, is_causal, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup(ctx, inputs, output):
    query, key, value, cu_seq_q, _, _, scale, is_causal = inputs
    ctx.save_for_backward(query, key, value, cu_seq_q)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad):
    query, key, value, cu_seq_q = ctx.saved_tensors
    grads = _standin_backward_op(grad, query, key, value, cu_seq_q, ctx.is_causal, ctx.scale)
    return (*grads, None, None, None, None, None)


_standin_op.register_autograd(_backward, setup_context=_setup)


def varlen_attn_for(release: str):
    """A stand-in with `release`'s signature (SIGNATURES): what torch.nn.attention.varlen.varlen_attn is there."""
    accepted = SIGNATURES[release]

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **options):
        unknown = set(options) - accepted
        if unknown:
            name = sorted(unknown)[0]
            raise TypeError(f"varlen_attn() got an unexpected keyword argument {name!r} (torch {release})")
        if options.get("return_aux") is not None:
            raise KernelContractError("the stand-in does not return auxiliary outputs; nothing of ours asks for them")
        window = tuple(options.get("window_size", (-1, -1)))
        if window not in ((-1, -1), (-1, 0)):
            raise KernelContractError(f"the stand-in takes full or causal windows, got {window}")
        causal = bool(options.get("is_causal", False)) or window == (-1, 0)
        if query.shape[1] != key.shape[1] and not options.get(
            "enable_gqa", False
        ):  # the wrapper's own check, a ValueError
            raise ValueError(
                f"Expect query and key/value to have the same number of heads but got Hq={query.shape[1]} and "
                f"Hkv={key.shape[1]}. Try setting enable_gqa=True for GQA."
            )
        scale = options.get("scale")
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        return _standin_op(query, key, value, cu_seq_q, cu_seq_k, [max_q, max_k], scale, causal)

    positional = ["query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k"]
    parameters = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in positional]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if "is_causal" in accepted else inspect.Parameter.KEYWORD_ONLY
    parameters += [inspect.Parameter(name, kind, default=None) for name in sorted(accepted)]
    varlen_attn.__signature__ = inspect.Signature(parameters)  # what callers inspecting the kernel see
    varlen_attn.release = release
    return varlen_attn


@contextlib.contextmanager
def install(release: str | None = None):
    """For the duration, varlen_attn is the stand-in of `release` (default: the installed torch's) and
    model/attention.py's device check takes this machine's device as a CUDA device of compute capability 9.0."""
    import torch.nn.attention.varlen as varlen

    from . import attention

    release = release or release_of(torch.__version__)
    saved = varlen.varlen_attn, attention.device_refusal
    varlen.varlen_attn = varlen_attn_for(release)
    attention.device_refusal = lambda device: None
    attention.register()
    try:
        yield varlen.varlen_attn
    finally:
        varlen.varlen_attn, attention.device_refusal = saved
