"""Llama (meta-llama/Llama-3.1-8B and the 3.x family): made from transformers' own parallel plans (plans.py);
grouped-query attention (8 k/v heads for 32 query heads), untied embeddings (3.1 8B) or tied (3.2 1B and 3B)."""

from __future__ import annotations

from transformers import LlamaConfig

from . import register
from .plans import PlanFamily


def _sizes(hidden, inner, layers, heads, kv_heads, tied, positions=131072, vocab=128256):
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=positions,
        tie_word_embeddings=tied,
    )


register(
    PlanFamily(
        LlamaConfig,
        name="llama",
        default_model="meta-llama/Llama-3.1-8B",
        published={
            "meta-llama/Llama-3.1-8B": _sizes(4096, 14336, 32, 32, 8, tied=False),
            "meta-llama/Llama-3.1-70B": _sizes(8192, 28672, 80, 64, 8, tied=False),  # QLoRA plans (issue 37)
            "meta-llama/Llama-3.2-1B": _sizes(2048, 8192, 16, 32, 8, tied=True),
            "meta-llama/Llama-3.2-3B": _sizes(3072, 8192, 28, 24, 8, tied=True),
            # the instruction-tuned releases (recipes/llama/sft*.yaml): the same shapes
            "meta-llama/Llama-3.1-8B-Instruct": _sizes(4096, 14336, 32, 32, 8, tied=False),
            "meta-llama/Llama-3.2-1B-Instruct": _sizes(2048, 8192, 16, 32, 8, tied=True),
            "meta-llama/Llama-3.2-3B-Instruct": _sizes(3072, 8192, 28, 24, 8, tied=True),
        },
    )
)
