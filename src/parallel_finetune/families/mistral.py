"""Mistral (mistralai/Mistral-7B-v0.3): made from transformers' own parallel plans (plans.py); grouped-query
attention (8 k/v heads for 32), untied embeddings; a config with `sliding_window` set (v0.1, and MistralConfig's
default, which the tiny model keeps) takes sliding-window masks on every stage."""

from __future__ import annotations

from transformers import MistralConfig

from . import register
from .plans import PlanFamily

register(
    PlanFamily(
        MistralConfig,
        name="mistral",
        default_model="mistralai/Mistral-7B-v0.3",
        published={
            # the instruction-tuned release (recipes/mistral/sft*.yaml) has the base model's shapes
            name: dict(
                vocab_size=32768,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=32768,
                sliding_window=None,
                tie_word_embeddings=False,
            )
            for name in ("mistralai/Mistral-7B-v0.3", "mistralai/Mistral-7B-Instruct-v0.3")
        },
    )
)
