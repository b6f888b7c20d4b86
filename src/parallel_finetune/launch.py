"""`python -m parallel_finetune.launch ARGS` is `torchrun ARGS` without torchrun's failure wall.

When a rank fails, torchrun logs the failure and the SIGTERM it sends the other ranks, then ends in a Python
traceback holding a box of per-rank reports: ~40 lines after the rank's own message. A rank that stops on bad
input has already said why in one `error:` line and exits 2; through this launcher that line is all that shows,
and the exit status is the rank's. Any other failure (a crash with its own traceback, a signal) adds one line
naming the rank and how it ended. The arguments are torchrun's (--nproc_per_node, --max-restarts, ...).
"""

from __future__ import annotations

import logging
import signal
import sys

USER_ERROR = 2  # what a rank exits with after printing its UserError (train.main)


def torchrun_command(nproc: int, *arguments: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node nproc ARGUMENTS` with this interpreter (benchmarks, selftest, tests)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *arguments]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # the agent's "failed (exitcode: 2)" and "Sending process … closing signal SIGTERM" lines
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code == USER_ERROR:
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
