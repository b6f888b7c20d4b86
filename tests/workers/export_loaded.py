"""A normal run that also exports the weights as loaded into its shards: from the first step's after-backward hook
(every rank still holds the pretrained values, no update yet) into `loaded/`. tests/test_full_size.py compares that
folder with the checkpoint file and the losses with one process."""

import sys

from parallel_finetune.resolve import load_config
from parallel_finetune.selftest import export_as_loaded
from parallel_finetune.trainer import run


def export_loaded(trainer, step: int) -> None:
    if step == 1:
        export_as_loaded(trainer)


if __name__ == "__main__":
    run(load_config(sys.argv[1], sys.argv[2:]), after_backward=export_loaded)
