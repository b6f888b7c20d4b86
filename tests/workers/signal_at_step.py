"""Trains like scripts/train.py, but one rank signals itself at one step (after that step's backward).

torchrun ... signal_at_step.py RECIPE key=value ... (env SIGNAL_NAME=SIGTERM|SIGINT|SIGKILL|SIGSTOP, SIGNAL_RANK,
SIGNAL_STEP; SIGKILL only in torchrun's first attempt, so a restarted run goes through; in a restarted attempt rank
LATE_RANK starts LATE_BY_S seconds late, so its peers look for it in the store first)"""

import os
import signal
import sys
import time

from parallel_finetune import train
from parallel_finetune.errors import UserError
from parallel_finetune.loop.run import run
from parallel_finetune.resolve import load_config

SIGNAL = getattr(signal, os.environ["SIGNAL_NAME"])
RANK, STEP = int(os.environ["SIGNAL_RANK"]), int(os.environ["SIGNAL_STEP"])
FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def send(built, step: int) -> None:
    if step == STEP and built.trainer.layout.rank == RANK and (SIGNAL != signal.SIGKILL or FIRST_ATTEMPT):
        os.kill(os.getpid(), SIGNAL)


if __name__ == "__main__":
    if not FIRST_ATTEMPT and os.environ["RANK"] == os.environ.get("LATE_RANK"):
        time.sleep(float(os.environ["LATE_BY_S"]))
    try:
        run(load_config(sys.argv[1], sys.argv[2:]), after_backward=send)
    except UserError as exc:  # as scripts/train.py ends
        sys.exit(train.report(exc))
    except KeyboardInterrupt as exc:
        sys.exit(train.interrupted(exc))
