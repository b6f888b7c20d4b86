#!/usr/bin/env python
"""Classify a file of new texts with an exported model (hf/ or a LoRA run's adapter/).

python scripts/predict.py runs/RUN/hf new.csv [--batch-size 32] [--text-column C] [--text-pair-column C]
    [--output predictions.tsv]
Prints index<TAB>label<TAB>score per row (regression: index<TAB>value); see docs/data.md.
"""

import sys

# inference.py imports torch and transformers only once the arguments are good (--help is instant)
from parallel_finetune.tools.inference import main

if __name__ == "__main__":
    sys.exit(main())
