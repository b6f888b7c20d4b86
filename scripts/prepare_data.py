#!/usr/bin/env python
"""Tokenize and cache SST-2 for a recipe: python scripts/prepare_data.py RECIPE.yaml [data_dir=PATH key=value ...]

Training does this itself when the cache is missing; run it ahead of time to pay the cost once (e.g. before
uploading the data to S3). Prints the cache folder.
"""

import logging
import sys

from parallel_finetune.config import parse_config
from parallel_finetune.errors import UserError


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        # the recipe and its key=value checked by the config package first: a typo is one line before torch is imported
        parse_config(argv[0], argv[1:])
        from parallel_finetune.loop.builder import prepare_data
        from parallel_finetune.resolve import load_config

        config = load_config(argv[0], argv[1:])
        prepared = prepare_data(config)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{prepared.cache_path}  ({prepared.source.description}; "
        + ", ".join(f"{k} {len(v):,} rows" for k, v in prepared.splits.items())
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
