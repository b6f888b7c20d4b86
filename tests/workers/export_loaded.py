"""A normal run that also exports the weights as loaded into its shards: from the first step's after-backward hook
(every rank still holds the pretrained values, no update yet) into `loaded/`, and writes each rank's memory as
its load began and when its model was ready (`load-memory-rank{N}.json`). tests/test_full_size.py compares that
folder with the checkpoint file, the losses with one process and the load's memory with the planner."""

import json
import sys

from parallel_finetune.loop.run import run
from parallel_finetune.resolve import load_config
from parallel_finetune.selftest import export_as_loaded


def export_loaded(built, step: int) -> None:
    if step == 1:
        ready, rank = built.ready, built.trainer.layout.rank
        memory = {"before_mib": ready.memory_before_load_mib, "peak_mib": ready.load_peak_mib}
        (built.output_dir / f"load-memory-rank{rank}.json").write_text(json.dumps(memory))
        export_as_loaded(built, CONFIG)


if __name__ == "__main__":
    CONFIG = load_config(sys.argv[1], sys.argv[2:])
    run(CONFIG, after_backward=export_loaded)
