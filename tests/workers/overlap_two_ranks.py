"""Two data-parallel ranks: a stack of linear layers whose gradients `OverlappedGradientSum` sums in small buckets
while the backward runs, under torch.profiler. Rank 0 prints how many all-reduces were launched, and how many
transfers had started, before the backward ended (profiler events and perf_counter), and whether the sums equal
a plain all-reduce after the backward bit for bit. Run by tests/loop/test_units.py; `OVERLAP_TRACE=path` also writes
the Chrome trace."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from parallel_finetune.parallel.gradients import all_reduce_flat
from parallel_finetune.parallel.overlap import OverlappedGradientSum


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)])
    params = list(model.parameters())
    overlap = OverlappedGradientSum(params, dist.group.WORLD, bucket_mib=0.3)  # ~1 layer a bucket
    torch.manual_seed(1 + rank)
    data = torch.randn(512, 256)

    model(data).square().mean().backward()  # unarmed: local gradients only, nothing sent
    expected = [p.grad.clone() for p in params]
    all_reduce_flat(expected, dist.group.WORLD)
    for p in params:
        p.grad = None

    overlap.arm()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("backward"):
            loss = model(data).square().mean()
            loss.backward()
        backward_end = time.perf_counter()
        with record_function("finish"):
            overlap.finish()
    if os.environ.get("OVERLAP_TRACE") and rank == 0:
        prof.export_chrome_trace(os.environ["OVERLAP_TRACE"])
    events = prof.events()
    backward = max(e.time_range.end for e in events if e.name == "backward")
    # c10d::allreduce_: the launch (this thread); gloo:all_reduce: the transfer itself, on gloo's worker threads
    launched = [e.time_range.start for e in events if e.name == "c10d::allreduce_"]
    transfers = [e.time_range.start for e in events if e.name == "gloo:all_reduce"]
    equal = all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    if rank == 0:
        print(
            json.dumps(
                {
                    "buckets": len(overlap.buckets),
                    "launches": len(overlap.launch_times),
                    "launched_before_backward_end": sum(t < backward_end for t in overlap.launch_times),
                    "profiled_launches": len(launched),
                    "profiled_launches_before_backward_end": sum(start < backward for start in launched),
                    "transfers": len(transfers),
                    "transfers_started_before_backward_end": sum(start < backward for start in transfers),
                    "equal": equal,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
