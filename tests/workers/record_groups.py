"""Trains like scripts/train.py; after the first backward each rank writes GROUPS_DIR/rank{RANK}.json: its node
(torchrun's GROUP_RANK: which agent started it) and the global ranks of its tensor- and data-parallel groups.

torchrun ... record_groups.py RECIPE key=value ... (env GROUPS_DIR)"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from parallel_finetune.errors import UserError
from parallel_finetune.loop.run import run
from parallel_finetune.resolve import load_config
from parallel_finetune.train import report


def record(built, step: int) -> None:
    if step == 1:
        layout = built.trainer.layout
        groups = {
            "node": int(os.environ["GROUP_RANK"]),
            "tp": dist.get_process_group_ranks(layout.tp_mesh.get_group()),
            "dp": dist.get_process_group_ranks(layout.dp_group),
        }
        Path(os.environ["GROUPS_DIR"], f"rank{layout.rank}.json").write_text(json.dumps(groups))


if __name__ == "__main__":
    try:
        run(load_config(sys.argv[1], sys.argv[2:]), after_backward=record)
    except UserError as exc:  # as scripts/train.py ends
        sys.exit(report(exc))
