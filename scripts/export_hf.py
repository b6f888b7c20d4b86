#!/usr/bin/env python
"""Write a Hugging Face model folder from a training checkpoint of any layout (one process, no GPU needed).

python scripts/export_hf.py CHECKPOINT OUT [--dtype float32|bfloat16|float16]
CHECKPOINT: a step-… folder (or a checkpoint folder: its newest checkpoint that verifies). OUT: a new or empty
folder, not a file, a run folder or a folder inside a checkpoint;
`AutoModelForSequenceClassification.from_pretrained(OUT)` (or ForCausalLM) loads it. The checkpoint is
verified against its manifest (sizes and sha256) before anything is read.
"""

import argparse
import sys
from pathlib import Path

from parallel_finetune.errors import OneLineArgumentParser, UserError


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    # after the arguments: --help and a bad one are answered before torch is imported
    from parallel_finetune.outputs.convert import export_checkpoint

    try:
        print(export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
