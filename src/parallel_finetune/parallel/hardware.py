"""GPU types and SageMaker instances the layout planner knows: memory, 16-bit peak, links inside and between nodes.

Peaks are NVIDIA's dense (not 2:4 sparse) bf16/fp16 tensor-core figures for the SXM parts where both exist.
Links are nominal per-direction rates: NVLink where the instance has it, else PCIe 4.0 x16 (~32 GB/s).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

import torch

from ..errors import UserError

DEFAULT_INTERNODE_GBITS = 100  # per node, when the hardware is given as GPU count and memory


@dataclass(frozen=True)
class GPU:
    memory_gb: float
    tflops: float  # dense bf16/fp16 tensor-core peak
    link_gb_s: float  # GPU to GPU inside a node, per direction


GPUS = {
    "A100-40GB": GPU(40, 312, 300),
    "A100-80GB": GPU(80, 312, 300),
    "H100-80GB": GPU(80, 989, 450),
    "H200": GPU(141, 989, 450),
    "A10G-24GB": GPU(24, 70, 32),  # AWS's A10 variant trades tensor throughput (the A10 has 125) for CUDA cores
    "V100-16GB": GPU(16, 125, 150),
    "V100-32GB": GPU(32, 125, 150),  # fp16 only: Volta has no bf16
    "L4": GPU(24, 121, 32),
    "L40S": GPU(48, 362, 32),
}
# SageMaker instance -> (GPU, GPUs per node, network between nodes in Gbit/s)
INSTANCES = {
    "ml.p4d.24xlarge": ("A100-40GB", 8, 400),
    "ml.p4de.24xlarge": ("A100-80GB", 8, 400),
    "ml.p5.48xlarge": ("H100-80GB", 8, 3200),
    "ml.p5e.48xlarge": ("H200", 8, 3200),
    "ml.g5.2xlarge": ("A10G-24GB", 1, 10),  # one A10G: what LoRA makes enough for GPT-J 6B
    "ml.g5.12xlarge": ("A10G-24GB", 4, 40),
    "ml.g5.48xlarge": ("A10G-24GB", 8, 100),
    "ml.p3.16xlarge": ("V100-16GB", 8, 25),
    "ml.p3dn.24xlarge": ("V100-32GB", 8, 100),
    "ml.g6.48xlarge": ("L4", 8, 100),
}


@dataclass(frozen=True)
class Hardware:
    gpu: str
    memory_gb: float  # per GPU, as sold (1 GB = 1e9 bytes)
    gpus_per_node: int
    nodes: int
    internode_gbits: float  # per node
    instance: str | None = None
    note: str = ""  # what was assumed rather than given

    world = property(lambda self: self.gpus_per_node * self.nodes)
    spec = property(lambda self: GPUS[self.gpu])


def positive_int(name: str, value: object) -> int:
    try:
        number = int(str(value))
    except ValueError:
        number = 0
    if number < 1:
        raise UserError(f"{name}={value!r} is not valid; expected a positive integer")
    return number


def positive_number(name: str, value: object, example: str) -> float:
    try:
        number = float(str(value))
    except ValueError:
        number = 0.0
    if not number > 0:
        raise UserError(f"{name}={value!r} is not valid; expected a positive number (e.g. {example})")
    return number


def hardware_for(
    gpus: int | str | None, gpu_mem_gb: float | str | None, instance: str | None, gpu: str | None, nodes: int | str = 1
) -> Hardware:
    """An instance (its GPUs; `gpus` may use fewer of them), or GPUs per node with their memory and optional type."""
    nodes = positive_int("nodes", nodes)
    memory = None if gpu_mem_gb in (None, "") else positive_number("gpu_mem_gb", gpu_mem_gb, "40")
    count = None if gpus in (None, "") else positive_int("gpus", gpus)
    if instance is not None:
        if instance not in INSTANCES:
            raise UserError(f"instance={instance!r} is not known; known: {', '.join(INSTANCES)}")
        if gpu is not None:
            raise UserError(f"gpu={gpu!r} and instance={instance!r}: give one (the instance names its GPU)")
        gpu, per_node, gbits = INSTANCES[instance]
        if count is not None and count > per_node:
            raise UserError(f"gpus={count} exceeds the {per_node} GPUs of {instance}; use nodes=N for more")
        return Hardware(gpu, memory or GPUS[gpu].memory_gb, count or per_node, nodes, gbits, instance)
    if count is None:
        raise UserError(
            f"gpus is missing; give GPUS (per node) and GPU_MEM_GB, or INSTANCE (one of {', '.join(INSTANCES)})"
        )
    if gpu is not None and gpu not in GPUS:
        raise UserError(f"gpu={gpu!r} is not known; known: {', '.join(GPUS)}")
    if memory is None and gpu is None:
        raise UserError(
            f"gpu_mem_gb is missing; with gpus={count} give GPU_MEM_GB (e.g. 40) or INSTANCE "
            f"(one of {', '.join(INSTANCES)})"
        )
    note = f"; {DEFAULT_INTERNODE_GBITS} Gbit/s between nodes assumed" if nodes > 1 else ""
    if gpu is None:  # the type only sets the speed: guess it from the memory, and say so
        gpu = next((name for name, spec in GPUS.items() if spec.memory_gb == memory), "A100-80GB")
        note += f"; speed of {gpu} assumed (--gpu TYPE to choose)"
    return Hardware(gpu, memory or GPUS[gpu].memory_gb, count, nodes, DEFAULT_INTERNODE_GBITS, None, note)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB: peak RSS
