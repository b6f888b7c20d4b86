"""What one multi-rank test launch costs: the test harness (ranks forked from a pre-warmed zygote) vs torchrun.

python bench/launch_cost.py [--data-dir ../shared/data/sst2] [--repeats 5]

The same tiny 2-process run each time (GPT-J tiny, TP=2, 6 fp32 steps, dev evaluation, no export: what a parity
row launches), alternating harness and torchrun so that both see the same machine load. Per launch: wall seconds,
and the part of them spent outside the run's own phases (summary.json "seconds": setup, data, model, train, eval),
i.e. process start-up and imports. The zygote's own start-up, paid once per pytest process, is printed apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import find_sst2, launch, tiny_overrides  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=find_sst2())
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="launch-cost-"))
    overrides = tiny_overrides(args.data_dir, work / "cache") + ["tensor_parallel_degree=2"]
    started = time.perf_counter()
    launch(2, overrides, work / "warm-up")  # starts the zygote and fills the tokenized-data cache
    print(f"zygote start + first run: {time.perf_counter() - started:.1f} s")
    walls: dict[str, list[float]] = {"harness": [], "torchrun": []}
    outside: dict[str, list[float]] = {"harness": [], "torchrun": []}
    for repeat in range(args.repeats):
        for name in walls:
            started = time.perf_counter()
            run = launch(2, overrides, work / f"{name}-{repeat}", torchrun=name == "torchrun")
            walls[name].append(time.perf_counter() - started)
            outside[name].append(walls[name][-1] - sum(run.summary["seconds"].values()))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; median of {args.repeats}:")
    for name in walls:
        print(
            f"  {name:8s} {statistics.median(walls[name]):5.1f} s per launch, of which "
            f"{statistics.median(outside[name]):4.1f} s outside the run's phases "
            f"(all: {', '.join(f'{w:.1f}' for w in walls[name])})"
        )


if __name__ == "__main__":
    main()
