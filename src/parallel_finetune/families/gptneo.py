"""GPT-Neo (EleutherAI/gpt-neo-2.7B): alternating global and local (windowed) attention, tied embeddings."""

from __future__ import annotations

from torch import nn
from transformers import GPTNeoConfig, GPTNeoForCausalLM, GPTNeoForSequenceClassification

from ..errors import UserError
from . import register
from .base import DecoderFamily, localize_heads


class GPTNeo(DecoderFamily):
    name = "gptneo"
    default_model = "EleutherAI/gpt-neo-2.7B"
    config_class = GPTNeoConfig
    model_classes = {"classification": GPTNeoForSequenceClassification, "causal_lm": GPTNeoForCausalLM}
    published = {
        name: dict(
            vocab_size=50257,
            max_position_embeddings=2048,
            window_size=256,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            intermediate_size=4 * hidden,
            attention_types=[[["global", "local"], layers // 2]],
        )
        for name, hidden, layers, heads in (
            ("EleutherAI/gpt-neo-125m", 768, 12, 12),
            ("EleutherAI/gpt-neo-1.3B", 2048, 24, 16),
            ("EleutherAI/gpt-neo-2.7B", 2560, 32, 20),
        )
    }
    dropout_keys = ("embed_dropout", "attention_dropout", "resid_dropout")

    def sized_config(self, vocab_size, max_positions, hidden, layers, heads) -> GPTNeoConfig:
        # A window shorter than SST-2 sentences, so the local layers really differ from the global ones.
        return GPTNeoConfig(
            vocab_size=vocab_size,
            max_position_embeddings=max_positions,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            attention_types=[[["global", "local"], layers // 2]],
            window_size=8,
            bos_token_id=0,
            eos_token_id=0,
        )

    def tp_dimensions(self, hf_config: GPTNeoConfig) -> dict[str, int]:
        return {
            "num_heads": hf_config.num_heads,
            "hidden_size": hf_config.hidden_size,
            "intermediate_size": hf_config.intermediate_size or 4 * hf_config.hidden_size,
        }

    # The token embedding is tied to lm_head: both stay replicated so the tie (one Parameter) survives.
    # The window mask is a per-position buffer, identical for every head, so local layers need no change.
    block_path = "transformer.h"
    column_wise = ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj", "mlp.c_fc")
    row_wise = ("attn.attention.out_proj", "mlp.c_proj")
    lora_targets = ("q_proj", "v_proj")

    def localize_attention(self, model: nn.Module, tp: int) -> None:
        for block in self.blocks(model):
            localize_heads(block.attn.attention, tp, head_attrs=("num_heads",), width_attrs=("embed_dim",))

    def pipeline_block(self, block, hidden, mask, position_ids):
        return block(hidden, attention_mask=mask)[0]

    def hf_config(self, *args, **kwargs):
        config = super().hf_config(*args, **kwargs)
        # transformers expands attention_types into one entry per layer only when the config is built
        config.attention_layers = GPTNeoConfig.expand_attention_types_params(config.attention_types)
        if len(config.attention_layers) != config.num_layers:
            raise UserError(
                f"model_config: num_layers={config.num_layers} but attention_types "
                f"{config.attention_types} describes {len(config.attention_layers)} layers; set "
                f'model_config.attention_types too, e.g. [[["global", "local"], '
                f"{config.num_layers // 2}]]"
            )
        return config


register(GPTNeo())
