#!/usr/bin/env python
"""torchrun --nproc_per_node N scripts/train.py recipes/gptj/tp.yaml [key=value ...]"""

import sys

from parallel_finetune.train import main

if __name__ == "__main__":
    sys.exit(main())
