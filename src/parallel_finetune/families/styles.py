"""Tensor-parallel styles that transformers' plans name and torch does not ship, for the families that use them
(plans.py); parallel/tensor.py applies them like torch's own."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class ReplicatedWithGradAllReduce(ParallelStyle):
    """transformers' `replicated_with_grad_allreduce`: a module between a column-wise and a row-wise layer that
    works on this rank's heads only (Qwen 3's per-head q_norm/k_norm). Its weights are replicated; each rank's
    gradient covers its own heads, so the gradients are summed over the TP ranks.

    In DTensor terms: the weights become Replicate DTensors and the module's input, the local heads, is viewed as
    sharded along dimension 0. Any dimension but the normalised last one would do: the module's math is
    elementwise plus reductions over that last dimension, so the view changes no value. The weight's gradient,
    summed over the sharded dimension, is then Partial, and `keep_gradients_sharded` all-reduces it to Replicate."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(_name, inner: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(inner.named_parameters(recurse=False)):
                replicated = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), param.requires_grad)
                inner.register_parameter(name, replicated)

        def as_sharded(_module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False) for x in inputs)

        def as_local(_module, output, _mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, replicate, as_sharded, as_local)
