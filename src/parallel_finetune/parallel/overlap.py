"""Data-parallel gradient sums that overlap the backward (DDP's bucketing, on plain and DTensor parameters).

Parameters are laid into buckets of about `bucket_mib` MiB in reverse order of registration: roughly the order in
which the backward produces their gradients (the head's first, the embeddings' last). A hook on each parameter
(`register_post_accumulate_grad_hook`, run by autograd once the gradient is accumulated into `.grad`) counts the
bucket down; when a bucket is complete, its gradients are copied into one flat fp32 tensor and all-reduced
asynchronously over the data-parallel group, while the backward goes on with the blocks below. Buckets are
launched in index order on every rank (a complete bucket waits for the ones before it), so the ranks issue the
same collectives in the same order. `finish()` (after the backward) launches what is left (parameters that got
no gradient), waits, and writes the sums back into `.grad`.

Only the step's last backward is armed (`arm()`): earlier accumulation slices only accumulate locally, as DDP's
`no_sync`. A sum is a sum: the result is bit-identical to summing after the backward.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from .gradients import local


class OverlappedGradientSum:
    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, bucket_mib: float):
        self.group = group
        limit = max(1, int(bucket_mib * 2**20 / 4))  # fp32 elements
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for param in reversed([p for p in params if p.requires_grad]):
            numel = local(param).numel()
            if not self.buckets or size + numel > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += numel
        self.bucket_of = {param: index for index, bucket in enumerate(self.buckets) for param in bucket}
        self.handles = [param.register_post_accumulate_grad_hook(self._ready) for param in self.bucket_of]
        self.armed = False
        self.launch_times: list[float] = []  # perf_counter of each launch in the last armed backward (tests)
        self._reset()

    def _reset(self) -> None:
        self.pending = [len(bucket) for bucket in self.buckets]
        self.next = 0
        self.works: list[tuple[int, torch.Tensor, list[torch.Tensor], dist.Work]] = []

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they complete."""
        self._reset()
        self.launch_times = []
        self.armed = True

    def _ready(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        index = self.bucket_of[param]
        self.pending[index] -= 1
        if self.pending[index] < 0:  # a second accumulation after the bucket was sent would be lost
            raise RuntimeError(f"gradient overlap: {tuple(param.shape)} accumulated twice in one backward")
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)

    def _launch(self, index: int) -> None:
        grads = [local(p.grad) for p in self.buckets[index] if p.grad is not None]
        self.next = index + 1
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.launch_times.append(time.perf_counter())
        self.works.append((index, flat, grads, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """Launch the buckets not yet launched, wait for all, write the sums into the gradients."""
        while self.next < len(self.buckets):
            self._launch(self.next)
        for _, flat, grads, work in self.works:
            work.wait()
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._reset()
        self.armed = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
