"""Parallel fine-tuning recipes: GPT-J, GPT-2, BERT and GPT-Neo on GLUE SST-2 with PyTorch-native
tensor parallelism, data parallelism and mixed precision."""

import logging as _logging

__version__ = "0.1.0"

# peft imports torchao whenever it is installed (peft.lora_base_quantization=nf4 needs it). Where its CUDA kernels
# cannot load (no GPU, or another CUDA), torchao's import logs one warning per kernel file, and torch logs that a
# call torchao makes is deprecated: none of it concerns NF4, which is plain PyTorch, and it would reach every
# run's and test's output. Errors still show.
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)
