"""Pretrained-style checkpoints with random weights: how the full-size path is proven where no real GPT-family
checkpoint exists (tests, `make selftest`, `make bench-load`). A folder exactly as `save_pretrained` writes it
(config.json, safetensors, a tokenizer learned from SST-2), in fp32, fp16 or bf16, of any size.

Every tensor gets distinct random values (biases and LayerNorms too), so a weight loaded into the wrong place, or
not at all, cannot pass an equality check by accident. Dropout is off in the written config, so runs that load it
can be compared step by step with one process."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoConfig,
    GPTNeoForCausalLM,
)

from .families import get_family
from .precision import DTYPES


def model_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int, positions: int = 256):
    """The saved class and its config: a causal LM for the decoders (GPT-2 and GPT-Neo tie their head to the
    embedding), a bare encoder for BERT (a base-model checkpoint without the `bert.` prefix, as MiniLM's)."""
    if family == "gptj":
        return GPTJForCausalLM, GPTJConfig(
            vocab_size=vocab_size,
            n_positions=positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            rotary_dim=hidden // heads // 2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    if family == "gpt2":
        return GPT2LMHeadModel, GPT2Config(
            vocab_size=vocab_size,
            n_positions=positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    if family == "gptneo":
        return GPTNeoForCausalLM, GPTNeoConfig(
            vocab_size=vocab_size,
            max_position_embeddings=positions,
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            attention_types=[[["global", "local"], layers // 2]],
            window_size=8,
            embed_dropout=0.0,
            attention_dropout=0.0,
            resid_dropout=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    return BertModel, BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=positions,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def write_checkpoint(
    folder: Path,
    family: str,
    sentences: list[str],
    *,
    hidden: int,
    layers: int,
    heads: int,
    dtype: str = "float32",
    vocab_size: int = 4096,
    seed: int = 0,
) -> Path:
    """A model folder at `folder` (written to a temporary sibling, then renamed: complete or absent)."""
    from .data import train_tokenizer

    folder = Path(folder)
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = train_tokenizer(get_family(family).tiny_tokenizer, sentences, vocab_size, partial / "tokenizer")
    cls, config = model_config(family, -(-len(tokenizer) // 64) * 64, hidden, layers, heads)
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02, generator=generator)
            if "norm" in name.lower() and name.endswith("weight"):
                param.add_(1.0)  # LayerNorm scales near 1, as trained models have them
    model.tie_weights()
    model.to(DTYPES[dtype]).save_pretrained(partial)
    for file in (partial / "tokenizer").iterdir():
        file.rename(partial / file.name)
    (partial / "tokenizer").rmdir()
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
