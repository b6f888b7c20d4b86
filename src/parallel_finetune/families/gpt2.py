"""GPT-2 (gpt2-xl): Conv1D layers and a fused q|k|v projection, tied embeddings.

Surgery, applied in every layout so that the math and parameter names never depend on it:
- every `Conv1D` (weight stored [in, out]) becomes an `nn.Linear` (weight [out, in]), which DTensor's
  column/row-wise styles understand;
- the fused `c_attn` (one [in, 3*hidden] weight: all of q, then k, then v) becomes `FusedQKV`, three Linear
  layers whose outputs are concatenated. Sharding q, k and v column-wise gives every rank whole heads of each;
  a naive column split of the fused weight would give rank 0 all of q.
`to_hf_state_dict` undoes both for export, so `hf/` is a plain transformers GPT-2.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel
from transformers.pytorch_utils import Conv1D

from .base import DecoderFamily, localize_heads


class FusedQKV(nn.Module):
    """Drop-in for GPT-2's c_attn: returns [q | k | v] like the fused Conv1D, from three separate Linears."""

    def __init__(self, fused: Conv1D):
        super().__init__()
        hidden = fused.weight.shape[0]
        self.q, self.k, self.v = (linear_from_conv1d(fused, part * hidden, (part + 1) * hidden) for part in range(3))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)], dim=-1)


def linear_from_conv1d(conv: Conv1D, start: int = 0, stop: int | None = None) -> nn.Linear:
    """Output columns [start, stop) of a Conv1D as an nn.Linear with the same values."""
    weight = conv.weight[:, start:stop]
    linear = nn.Linear(weight.shape[0], weight.shape[1], device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        linear.bias.copy_(conv.bias[start:stop])
    return linear


CONV1D_NAMES = ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2(DecoderFamily):
    name = "gpt2"
    default_model = "gpt2-xl"
    config_class = GPT2Config
    model_classes = {"classification": GPT2ForSequenceClassification, "causal_lm": GPT2LMHeadModel}

    def tiny_config(self, vocab_size: int, max_positions: int) -> GPT2Config:
        return GPT2Config(vocab_size=vocab_size, n_positions=max_positions, n_embd=128, n_layer=2, n_head=4,
                          bos_token_id=0, eos_token_id=0)

    def tp_dimensions(self, hf_config: GPT2Config) -> dict[str, int]:
        return {"n_head": hf_config.n_head, "n_embd": hf_config.n_embd,
                "n_inner": hf_config.n_inner or 4 * hf_config.n_embd}

    def build(self, task, hf_config, model, size, tokenizer) -> nn.Module:
        built = super().build(task, hf_config, model, size, tokenizer)
        for block in self.blocks(built):
            block.attn.c_attn = FusedQKV(block.attn.c_attn)
            for name in CONV1D_NAMES:
                parent, attr = name.split(".")
                setattr(getattr(block, parent), attr, linear_from_conv1d(getattr(getattr(block, parent), attr)))
        return built

    def to_hf_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            if ".attn.c_attn." in key:
                prefix, part, kind = key.rsplit(".", 2)  # ...c_attn, q|k|v, weight|bias
                if part != "q":
                    continue
                pieces = [state[f"{prefix}.{p}.{kind}"] for p in "qkv"]
                out[f"{prefix}.{kind}"] = torch.cat([p.t() if kind == "weight" else p for p in pieces], dim=-1)
            elif key.endswith(".weight") and any(f".{name}." in key for name in CONV1D_NAMES):
                out[key] = tensor.t().contiguous()
            else:
                out[key] = tensor
        return {k: v.contiguous() for k, v in out.items()}

    # wte is tied to lm_head (one Parameter): both stay replicated so the tie survives; wpe too.
    block_path = "transformer.h"
    column_wise = ("attn.c_attn.q", "attn.c_attn.k", "attn.c_attn.v", "mlp.c_fc")
    row_wise = ("attn.c_proj", "mlp.c_proj")

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        for block in self.blocks(model):
            localize_heads(block.attn, tp, head_attrs=("num_heads",), width_attrs=("embed_dim", "split_size"))

    def pipeline_block(self, block, hidden, mask, position_ids):
        return block(hidden, None, mask, position_ids=position_ids)
