"""The process layout: degrees of pipeline, data (replicated x sharded) and tensor parallelism, the sharding mode,
and their mesh.

Ranks are laid out (pp, dp_replicate, dp_shard, tp), tp fastest: a tensor-parallel group is a run of consecutive
ranks (one node, its fast links), a shard group the next level out, replication further out, and pipeline
stages outermost (a stage boundary sends one activation per micro-batch: the cheapest link to cross nodes). The
data-parallel degree is dp_replicate x dp_shard; `sharding` decides how it splits:
none and optimizer -> all replicate (optimizer sharding shards across the whole data-parallel group),
full -> all shard, hybrid -> shard inside groups of `shard_group_size`, replicate across them.

`ParallelDims` holds the degrees and the mode together, resolved once from the config; the rest of the code asks
its named queries (`fsdp`, `zero1`, `hybrid`, `pp_enabled`, ...), never the config's strings.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class Engine(str, Enum):
    """What turns gradients into updates: the config's `engine`, as a type (resolved once, Resolved.engine)."""

    TORCH = "torch"  # our AdamW, ZeRO-1 and FSDP2 (updates.TorchUpdates)
    DEEPSPEED = "deepspeed"  # DeepSpeed's ZeRO stages (parallel/deepspeed_engine.py)

    def __str__(self) -> str:
        return self.value


class Sharding(str, Enum):
    """How the data-parallel ranks hold the training state: the config's `sharding`, as a type."""

    NONE = "none"  # every rank a full copy; gradients summed after the backward
    OPTIMIZER = "optimizer"  # ZeRO-1: AdamW state split over the data-parallel ranks (parallel/zero.py)
    FULL = "full"  # FSDP2 over every data-parallel rank: parameters, gradients and AdamW state (parallel/fsdp.py)
    HYBRID = "hybrid"  # FSDP2 inside groups of shard_group_size ranks, replicas across the groups

    def __str__(self) -> str:  # messages and f-strings show the value a recipe writes
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> Sharding:
        raise UserError(f"sharding={value!r} is not valid; expected {', '.join(m.value for m in cls)}")

    @property
    def sharded(self) -> bool:
        """Some training state (at least AdamW's) is split over the data-parallel ranks."""
        return self is not Sharding.NONE

    @property
    def zero1(self) -> bool:
        """ZeRO-1: parameters and gradients in flat buffers, each rank updating its slice."""
        return self is Sharding.OPTIMIZER

    @property
    def fsdp(self) -> bool:
        """FSDP2 holds the parameters (full or hybrid), even on a single data-parallel rank."""
        return self in (Sharding.FULL, Sharding.HYBRID)

    @property
    def hybrid(self) -> bool:
        """FSDP2 inside shard groups, replicated across them (HSDP)."""
        return self is Sharding.HYBRID


@dataclass(frozen=True)
class ParallelDims:
    """The degrees and the sharding mode, as one object with named queries (after torchtitan's ParallelDims)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    sharding: Sharding = Sharding.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding", Sharding(self.sharding))  # a config string becomes the type here

    @classmethod
    def split(cls, dp: int, tp: int, pp: int, sharding: Sharding | str, shard_group: int = 1) -> ParallelDims:
        """`dp` data-parallel ranks split as the mode says: replicas (none, optimizer), shards (full), or replicas of
        shard groups of `shard_group` ranks (hybrid)."""
        sharding = Sharding(sharding)
        if sharding.hybrid:
            return cls(dp // shard_group, shard_group, tp, pp, sharding)
        if sharding.fsdp:
            return cls(1, dp, tp, pp, sharding)
        return cls(dp, 1, tp, pp, sharding)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    # degrees
    dp_enabled = property(lambda self: self.dp > 1)
    dp_replicate_enabled = property(lambda self: self.dp_replicate > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    pp_enabled = property(lambda self: self.pp > 1)

    # the mode (see Sharding)
    sharded = property(lambda self: self.sharding.sharded)
    zero1 = property(lambda self: self.sharding.zero1)
    fsdp = property(lambda self: self.sharding.fsdp)
    hybrid = property(lambda self: self.sharding.hybrid)

    @property
    def optimizer_shards(self) -> int:
        """How many pieces AdamW's state is split into: every data-parallel rank's under ZeRO-1, the shard group's
        under FSDP, one without sharding."""
        return self.dp if self.zero1 else self.dp_shard


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_dims(
    world_size: int,
    local_world_size: int,
    tp_requested: int | str,
    sharding: Sharding | str,
    shard_group_size: int | None,
    pp: int = 1,
) -> ParallelDims:
    """The one place that turns the config's parallel keys and the process count into degrees and a mode."""
    sharding = Sharding(sharding)
    if world_size % pp:
        raise UserError(
            f"pipeline_parallel_degree={pp} does not divide the {world_size} processes; "
            f"valid: {', '.join(map(str, divisors(world_size)))}"
        )
    if tp_requested == "auto":  # the ranks of a node that its pipeline stages leave over
        nodes = max(1, world_size // local_world_size)
        stages_per_node = max(1, pp // nodes)
        tp = local_world_size // stages_per_node if local_world_size % stages_per_node == 0 else 1
    else:
        tp = int(tp_requested)
    if (world_size // pp) % tp:
        raise UserError(
            f"tensor_parallel_degree={tp} does not divide the {world_size // pp} processes of a "
            f"pipeline stage ({world_size} processes / pipeline_parallel_degree={pp}); use a divisor "
            f"of {world_size // pp} (the rest become data-parallel replicas)"
        )
    dp = world_size // (tp * pp)
    group = 1
    if sharding.hybrid:
        group = shard_group_size or max(1, local_world_size // tp)
        if dp % group:
            raise UserError(
                f"sharding=hybrid: shard_group_size={group} does not divide the data-parallel degree "
                f"{dp}; valid: {', '.join(map(str, divisors(dp)))}"
            )
    return ParallelDims.split(dp, tp, pp, sharding, group)


@dataclass
class Layout:
    world_size: int
    rank: int
    local_rank: int
    dims: ParallelDims
    device: torch.device
    mesh: DeviceMesh  # dims MESH_DIMS
    dp_mesh: DeviceMesh  # dp_replicate x dp_shard flattened: one group spanning all data-parallel ranks

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh["pp"].get_group()

    @property
    def stage_world_size(self) -> int:
        """Ranks that hold one pipeline stage (all of them without pipelining): what replica counts refer to."""
        return self.world_size // self.pp

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: 1-D (dp_shard) for full, 2-D (dp_replicate, dp_shard) for hybrid."""
        return self.mesh["dp_replicate", "dp_shard"] if self.dims.hybrid else self.mesh["dp_shard"]

    def size(self, dim: str) -> int:
        return getattr(self.dims, dim)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        return {
            "world_size": self.world_size,
            "pipeline_parallel": self.pp,
            "data_parallel": self.dp,
            "tensor_parallel": self.tp,
            "sharding": self.dims.sharding.value,
            "shard_group_size": self.dims.dp_shard,
            "device": self.device.type,
            "backend": dist.get_backend(),
        }


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("device='cuda' but no CUDA device is visible; use device=cpu or device=auto")
    return choice


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    device_choice: str,
    tp_requested: int | str,
    sharding: Sharding | str = Sharding.NONE,
    shard_group_size: int | None = None,
    pp: int = 1,
    timeout_s: float = 600.0,
) -> Layout:
    """Start (or join) the process group; a plain `python train.py` becomes a world of one."""
    alone = "RANK" not in os.environ
    if alone:  # what torchrun would set: DeepSpeed's init_distributed looks for all five, though this group's store
        # (an in-process HashStore, see _init_process_group) listens on no port
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device_type = resolve_device(device_choice)
    dims = resolve_dims(world_size, local_world, tp_requested, sharding, shard_group_size, pp)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # gloo for the few CPU-side object collectives
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        _init_process_group(backend, device if device_type == "cuda" else None, timeout_s, alone)
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=MESH_DIMS)
    dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return Layout(world_size, rank, local_rank, dims, device, mesh, dp_mesh)


def _init_process_group(backend: str, device_id: torch.device | None, timeout_s: float, alone: bool) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if alone:  # a world of one needs no TCP store, and a port picked for one could be taken before it listens
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0":
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
        return
    # torchrun keeps one store across restarts (--max-restarts) and process-group keys carry no attempt number, so a
    # restarted rank could read a dead peer's address and fail with "Connection refused": each attempt gets its own keys
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"attempt-{attempt}/", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )


def timed_out(exc: BaseException, timeout_s: float) -> str | None:
    """What to tell the user when `exc` is a collective that gave up waiting (gloo: "Timed out waiting ...ms"),
    or None for any other exception."""
    if not isinstance(exc, RuntimeError) or "timed out" not in str(exc).lower():
        return None
    return (
        f"rank {os.environ.get('RANK', '0')} waited collective_timeout_s={timeout_s:g} s in a collective for "
        "another rank that never came (stopped, hung or died: its own log says which); raise "
        "collective_timeout_s if a phase legitimately takes longer"
    )


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()  # without it, a fast rank tearing down can abort a slow one mid-collective
        dist.destroy_process_group()


def check_batch_split(batch_size: int, dp: int, accumulation: int) -> None:
    if batch_size % (dp * accumulation):
        raise UserError(
            f"batch_size={batch_size} must be divisible by data-parallel degree {dp} x "
            f"gradient_accumulation_steps={accumulation}"
        )


def rank0_decides(layout: Layout, decide: Callable[[], object]) -> object:
    """Run `decide` on rank 0 only and hand its result, or its UserError, to every rank."""
    box: list = [None]
    if layout.is_main:
        try:
            box[0] = ("ok", decide())
        except UserError as exc:
            box[0] = ("error", str(exc))
    if layout.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise UserError(value)
    return value


def pipeline_microbatches(microbatches: int | None, pp: int) -> int:
    """Micro-batches per accumulation slice: `microbatches`, else 2 per stage (the bubble under a fifth with 1F1B)."""
    return microbatches or 2 * pp
