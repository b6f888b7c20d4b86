"""What a rank sees: writes rank{RANK}.json (environment, threads, signal handlers, argv, the sum of all ranks
over a gloo group) into output_dir, then misbehaves if asked to. For tests/test_harness.py.

... rank_probe.py RECIPE key=value ... output_dir=DIR (env PROBE_RANK and PROBE_DOES=fail|hang|sigkill: what
that rank does then; PROBE_PEERS=hang: the other ranks hang)"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    output_dir = Path(next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("output_dir=")))
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    output_dir.mkdir(parents=True, exist_ok=True)
    seen = {
        "env": dict(os.environ),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "sigint_raises": signal.getsignal(signal.SIGINT) == signal.default_int_handler,
        "rank_sum": int(total),
    }
    (output_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    if os.environ.get("PROBE_RANK") == os.environ["RANK"]:
        misbehave(os.environ["PROBE_DOES"])
    elif os.environ.get("PROBE_PEERS") == "hang":
        time.sleep(3600)


def misbehave(does: str) -> None:
    print(f"rank {os.environ['RANK']} will {does}", flush=True)
    if does == "fail":
        raise RuntimeError("the probe's planted failure")
    if does == "hang":
        time.sleep(3600)
    if does == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
