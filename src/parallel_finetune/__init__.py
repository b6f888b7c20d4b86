"""Parallel fine-tuning recipes: GPT-J, GPT-2, BERT and GPT-Neo on GLUE SST-2 with PyTorch-native
tensor parallelism, data parallelism and mixed precision."""

__version__ = "0.1.0"
