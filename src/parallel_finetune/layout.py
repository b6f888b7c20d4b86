"""The process layout: how many ranks do data parallelism (dp) and tensor parallelism (tp), and their mesh.

Ranks are laid out dp-major, tp-minor, so a tensor-parallel group is a run of consecutive ranks: on GPUs these
share a node and its fast links, while data parallelism crosses nodes.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import UserError


@dataclass
class Layout:
    world_size: int
    rank: int
    local_rank: int
    dp: int
    tp: int
    device: torch.device
    mesh: DeviceMesh  # dims ("dp", "tp")

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        return {"world_size": self.world_size, "data_parallel": self.dp, "tensor_parallel": self.tp,
                "device": self.device.type, "backend": dist.get_backend()}


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("device='cuda' but no CUDA device is visible; use device=cpu or device=auto")
    return choice


def resolve_tp_degree(requested: int | str, world_size: int, local_world_size: int) -> int:
    tp = local_world_size if requested == "auto" else int(requested)
    if world_size % tp:
        raise UserError(f"tensor_parallel_degree={tp} does not divide the {world_size} processes; "
                        f"use a divisor of {world_size} (the rest become data-parallel replicas)")
    return tp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_choice: str, tp_requested: int | str) -> Layout:
    """Start (or join) the process group; a plain `python train.py` becomes a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    world_size = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device_type = resolve_device(device_choice)
    tp = resolve_tp_degree(tp_requested, world_size, local_world)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cpu:gloo,cuda:nccl"  # gloo for the few CPU-side object collectives
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30),
                                device_id=device if device_type == "cuda" else None)
    mesh = init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    return Layout(world_size, rank, local_rank, world_size // tp, tp, device, mesh)


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()  # without it, a fast rank tearing down can abort a slow one mid-collective
        dist.destroy_process_group()
