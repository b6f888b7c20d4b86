"""GPT-J (EleutherAI/gpt-j-6b): parallel attention + MLP blocks, rotary positions, untied LM head."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import GPTJConfig, GPTJForCausalLM, GPTJForSequenceClassification

from . import register
from .base import DecoderFamily, localize_heads


class GPTJ(DecoderFamily):
    name = "gptj"
    default_model = "EleutherAI/gpt-j-6b"
    config_class = GPTJConfig
    model_classes = {"classification": GPTJForSequenceClassification, "causal_lm": GPTJForCausalLM}
    published = {
        "EleutherAI/gpt-j-6b": dict(
            vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, n_inner=16384, rotary_dim=64
        ),
    }
    dropout_keys = ("resid_pdrop", "embd_pdrop", "attn_pdrop")

    def sized_config(self, vocab_size, max_positions, hidden, layers, heads) -> GPTJConfig:
        return GPTJConfig(
            vocab_size=vocab_size,
            n_positions=max_positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            rotary_dim=hidden // heads // 2,
            bos_token_id=0,
            eos_token_id=0,
        )

    def tp_dimensions(self, hf_config: GPTJConfig) -> dict[str, int]:
        return {
            "n_head": hf_config.n_head,
            "n_embd": hf_config.n_embd,
            "n_inner": hf_config.n_inner or 4 * hf_config.n_embd,
            "vocab_size": hf_config.vocab_size,
        }

    block_path = "transformer.h"
    column_wise = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.fc_in")
    row_wise = ("attn.out_proj", "mlp.fc_out")
    lora_targets = ("q_proj", "v_proj")

    def extra_tp_plan(self, model: nn.Module) -> dict[str, ParallelStyle]:
        # Vocabulary-sharded embedding: each rank holds vocab/tp rows; the lookup result is all-reduced.
        plan: dict[str, ParallelStyle] = {
            "transformer.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        }
        if hasattr(model, "lm_head"):
            plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        # The 2-way classification `score` head and the LayerNorms stay replicated: too small to shard.
        return plan

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        for block in self.blocks(model):
            localize_heads(block.attn, tp, head_attrs=("num_attention_heads",), width_attrs=("embed_dim",))

    def pipeline_block(self, block, hidden, mask, position_ids):
        return block(hidden, attention_mask=mask, position_ids=position_ids)[0]


register(GPTJ())
