"""Export a (tensor-parallel) model as a plain Hugging Face folder: safetensors + config + tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def gather_full_state_dict(model: nn.Module, dtype: torch.dtype, keep: bool) -> dict[str, torch.Tensor]:
    """Every rank takes part in gathering the shards (one tensor at a time, to bound memory); `keep` ranks
    return the CPU copies, the others an empty dict. Names are those of the unsplit model."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            full = full.detach().to("cpu")
            state[name] = full.to(dtype) if full.is_floating_point() else full
    return state


def save_hf(model: nn.Module, state: dict[str, torch.Tensor], tokenizer, out: Path) -> None:
    """Write a folder that `from_pretrained` loads, built from a fresh, unsharded copy of the model."""
    with torch.device("meta"):
        clean = type(model)(model.config)
    clean.load_state_dict(state, assign=True, strict=True)
    clean.tie_weights()  # assign=True replaced tied parameters one by one; tie them again (GPT-2, GPT-Neo)
    clean.config.dtype = next(iter(state.values())).dtype
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)
