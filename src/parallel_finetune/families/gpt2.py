"""GPT-2 (gpt2-xl): Conv1D layers and a fused q|k|v projection, tied embeddings.

Surgery, applied in every layout so that the math and parameter names never depend on it:
- every `Conv1D` (weight stored [in, out]) becomes an `nn.Linear` (weight [out, in]), which DTensor's
  column/row-wise styles understand;
- the fused `c_attn` (one [in, 3*hidden] weight: all of q, then k, then v) becomes `FusedQKV`, three Linear
  layers whose outputs are concatenated. Sharding q, k and v column-wise gives every rank whole heads of each;
  a naive column split of the fused weight would give rank 0 all of q.
`hf_source` says where each new parameter sits in the original layout: loading reads it from there (a rank reads
only the columns of its heads) and export (`to_hf_state_dict`) puts it back, so `hf/` is a plain transformers GPT-2.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

from . import register
from .base import DecoderFamily, HFSource, localize_heads


class FusedQKV(nn.Module):
    """Drop-in for GPT-2's c_attn: returns [q | k | v] like the fused Conv1D, from three separate Linears."""

    def __init__(self, hidden: int):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)], dim=-1)


CONV1D_NAMES = ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
QKV = "qkv"


class GPT2(DecoderFamily):
    name = "gpt2"
    default_model = "gpt2-xl"
    config_class = GPT2Config
    model_classes = {"classification": GPT2ForSequenceClassification, "causal_lm": GPT2LMHeadModel}
    published = {
        name: dict(vocab_size=50257, n_positions=1024, n_embd=hidden, n_layer=layers, n_head=heads, n_inner=4 * hidden)
        for name, hidden, layers, heads in (
            ("gpt2", 768, 12, 12),
            ("gpt2-medium", 1024, 24, 16),
            ("gpt2-large", 1280, 36, 20),
            ("gpt2-xl", 1600, 48, 25),
        )
    }
    dropout_keys = ("resid_pdrop", "embd_pdrop", "attn_pdrop")

    def sized_config(self, vocab_size, max_positions, hidden, layers, heads) -> GPT2Config:
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            bos_token_id=0,
            eos_token_id=0,
        )

    def tp_dimensions(self, hf_config: GPT2Config) -> dict[str, int]:
        return {
            "n_head": hf_config.n_head,
            "n_embd": hf_config.n_embd,
            "n_inner": hf_config.n_inner or 4 * hf_config.n_embd,
        }

    def surgery(self, model: nn.Module) -> None:
        for block in self.blocks(model):
            block.attn.c_attn = FusedQKV(model.config.n_embd)
            for name in CONV1D_NAMES:
                parent, attr = name.split(".")
                conv = getattr(getattr(block, parent), attr)
                fan_in, fan_out = conv.weight.shape
                setattr(getattr(block, parent), attr, nn.Linear(fan_in, fan_out))

    def hf_source(self, name: str, hf_config: GPT2Config) -> HFSource:
        if ".attn.c_attn." in name:  # ...c_attn.{q,k,v}.{weight,bias}: a third of the fused output columns
            prefix, part, kind = name.rsplit(".", 2)
            return HFSource(
                f"{prefix}.{kind}",
                transpose=kind == "weight",
                dim=1 if kind == "weight" else 0,
                start=QKV.index(part) * hf_config.n_embd,
            )
        if name.endswith(".weight") and any(f".{conv}." in name for conv in CONV1D_NAMES):
            return HFSource(name, transpose=True)
        return HFSource(name)

    hf_conv1d = True

    def hf_out_features(self, path: str, rows: int, hf_config: GPT2Config) -> int:
        return 3 * hf_config.n_embd if ".c_attn." in path else rows

    # wte is tied to lm_head (one Parameter): both stay replicated so the tie survives; wpe too.
    block_path = "transformer.h"
    column_wise = ("attn.c_attn.q", "attn.c_attn.k", "attn.c_attn.v", "mlp.c_fc")
    row_wise = ("attn.c_proj", "mlp.c_proj")
    lora_targets = ("c_attn",)  # q, k and v (peft's default for GPT-2: the fused c_attn)

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        for block in self.blocks(model):
            localize_heads(block.attn, tp, head_attrs=("num_heads",), width_attrs=("embed_dim", "split_size"))

    def pipeline_block(self, block, hidden, mask, position_ids):
        return block(hidden, None, mask, position_ids=position_ids)


register(GPT2())
