"""Qwen 3 (Qwen/Qwen3-4B and the dense family): made from transformers' own parallel plans (plans.py); per-head
q/k RMSNorms (`replicated_with_grad_allreduce` in the plan), grouped-query attention, head_dim 128 independent of
the width, tied embeddings up to 4B (the tiny model is tied too, so TP and PP are tested with the tie)."""

from __future__ import annotations

from transformers import Qwen3Config

from . import register
from .plans import PlanFamily


def _sizes(hidden, inner, layers, heads, tied):
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inner,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
    )


register(
    PlanFamily(
        Qwen3Config,
        name="qwen3",
        default_model="Qwen/Qwen3-4B",
        published={
            "Qwen/Qwen3-0.6B": _sizes(1024, 3072, 28, 16, tied=True),
            "Qwen/Qwen3-1.7B": _sizes(2048, 6144, 28, 16, tied=True),
            "Qwen/Qwen3-4B": _sizes(2560, 9728, 36, 32, tied=True),
            "Qwen/Qwen3-8B": _sizes(4096, 12288, 36, 32, tied=False),
        },
        tie_tiny=True,
    )
)
