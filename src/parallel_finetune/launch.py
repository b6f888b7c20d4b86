"""`python -m parallel_finetune.launch ARGS` is `torchrun ARGS` without torchrun's failure wall.

When a rank fails, torchrun logs the failure and the SIGTERM it sends the other ranks, then ends in a Python
traceback holding a box of per-rank reports: ~40 lines after the rank's own message. A rank that stops on bad
input has already said why in one `error:` line and exits 2; through this launcher that line is all that shows,
and the exit status is the rank's. Any other failure (a crash with its own traceback, a signal) adds one line
naming the rank and how it ended. The arguments are torchrun's (--nproc_per_node, --max-restarts, ...).

Signals to the launcher end as documented (docs/checkpoints.md), not in torchrun's SignalException traceback:
torchrun passes SIGTERM on to the ranks, which checkpoint and exit, and the launcher exits 0; Ctrl-C (SIGINT)
stops the ranks, rank 0 says so in one line, and the launcher exits 130. A launcher killed outright (SIGKILL)
passes nothing on: its ranks notice that it is gone (`end_with_launcher`) and stop as on SIGTERM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

USER_ERROR = 2  # what a rank exits with after printing its UserError (train.main)
INTERRUPTED = 128 + signal.SIGINT  # ... and after printing that Ctrl-C stopped it
PR_SET_PDEATHSIG = 1  # linux/prctl.h
log = logging.getLogger(__name__)


def torchrun_command(nproc: int, *arguments: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node nproc ARGUMENTS` with this interpreter (benchmarks, selftest, tests)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *arguments]


def end_with_launcher() -> None:
    """In a torchrun worker: stop as on SIGTERM (finish the step, checkpoint, exit) once the launcher is gone.

    A launcher killed with SIGKILL passes no signal on, and its workers would train on for hours, holding the run
    folder's lock and their GPUs. The kernel sends SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG, Linux);
    a thread watching the parent's pid covers other systems and a launcher that died just before the prctl. A
    process that torchrun did not start (plain python, the tests' forked ranks) has no launcher to follow."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    launcher = os.getppid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        if os.environ.get("RANK", "0") == "0":
            log.warning("torchrun's launcher (pid %d) is gone: checkpointing and stopping, as on SIGTERM", launcher)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="end-with-launcher", daemon=True).start()


class _RepeatedLines(logging.Filter):
    """The agent's lines that only repeat what the ranks said: "failed (exitcode: 2)", "Sending process …
    closing signal SIGTERM". Its warning that a rank did not stop in time and was killed stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("failed (exitcode", "Sending process", "Closing process"))


def main(argv: list[str] | None = None) -> int:
    try:
        return _launch(argv)
    except KeyboardInterrupt:  # before torchrun's own handlers were in place
        return INTERRUPTED


def _launch(argv: list[str] | None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_RepeatedLines())
    try:
        run(args)
    except SignalException as exc:
        # torchrun passed the signal on to the ranks and waited for them (--shutdown-timeout): on SIGTERM they
        # checkpointed and exited 0, on SIGINT rank 0 said so in one line
        return 0 if exc.sigval == signal.SIGTERM else 128 + exc.sigval
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code in (USER_ERROR, INTERRUPTED):
            return code
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            print(
                f"error: rank {rank} was ended by {name} (out of memory or killed from outside?); "
                "the other ranks were stopped",
                file=sys.stderr,
            )
            return 128 - code
        print(f"error: rank {rank} failed with exit code {code}; its output above says why", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
