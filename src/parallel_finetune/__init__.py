"""Parallel fine-tuning recipes: GPT-J, GPT-2, BERT and GPT-Neo on GLUE SST-2 with PyTorch-native
tensor parallelism, data parallelism and mixed precision."""

import logging as _logging

__version__ = "0.1.0"

# peft and transformers import torchao whenever it is installed (their quantizers), and torchao then logs a
# WARNING for each CUDA extension it cannot load (every CPU, and GPUs it was not built for) and torch one about an
# Enum it registers: lines about kernels no run here uses, in every rank's log. QLoRA's NF4 (quantize.py) is plain
# PyTorch.
for _name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
