"""sharding=full|hybrid: FSDP2 (`fully_shard`) per transformer block and at the root, over the layout's FSDP mesh
(the dp_shard dimension, or dp_replicate x dp_shard for hybrid). It reduce-scatters the gradients itself during the
backward; `adamw.DataParallelAdamW` updates the shards.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .layout import Layout


def apply_fsdp(model: nn.Module, blocks: nn.ModuleList, layout: Layout, compute_dtype: torch.dtype | None) -> None:
    """FSDP2 per block, then the root (embeddings, head, norms). Gradients are reduced in fp32 and summed."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for module in [*blocks, model]:
        fully_shard(module, mesh=layout.fsdp_mesh, mp_policy=policy)
        # A plain sum (no averaging), done with SUM collectives: gloo has no pre-multiplied sum.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
