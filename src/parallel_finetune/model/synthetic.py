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

from ..families import get_family
from .precision import DTYPES
from .pretrained import save_model

WEIGHT_SEED = 0


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
) -> Path:
    """A model folder at `folder` (written to a temporary sibling, then renamed: complete or absent), saved from the
    family's `synthetic_checkpoint` class and config: a causal LM for the decoders, a bare encoder for BERT. The
    values are drawn from seed `WEIGHT_SEED`: the same arguments give the same folder."""
    from ..data.prepare import train_tokenizer

    model_family = get_family(family)  # an unknown family: one line, before anything is written
    folder = Path(folder)
    partial = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer = train_tokenizer(model_family.tiny_tokenizer, sentences, vocab_size, partial / "tokenizer")
    cls, config = model_family.synthetic_checkpoint(-(-len(tokenizer) // 64) * 64, 256, hidden, layers, heads)
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.02, generator=generator)
            if "norm" in name.lower() and name.endswith("weight"):
                param.add_(1.0)  # LayerNorm scales near 1, as trained models have them
    model.tie_weights()
    save_model(model.to(DTYPES[dtype]), partial)
    for file in (partial / "tokenizer").iterdir():
        file.rename(partial / file.name)
    (partial / "tokenizer").rmdir()
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
