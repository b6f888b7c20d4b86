"""WholeModel: the `interfaces.Runner` (forward and backward of an accumulation slice) for the model this rank holds,
whole or tensor-parallel or FSDP-sharded. The other Runner is `parallel/pipeline.py`'s Pipeline: this rank's
stages, run by a pipeline schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .loss import summed_loss, targets
from .parallel.memory import offload_context
from .tasks.task import HeadKind


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Positions count real tokens only, so a left-padded row sees the positions of its unpadded self
    (transformers would number the padding too); with right padding this equals 0, 1, 2, ..."""
    mask = batch["attention_mask"]
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "use_cache": False,
    }
    if "token_type_ids" in batch:  # sentence pairs of a family with token types (BERT)
        inputs["token_type_ids"] = batch["token_type_ids"]
    return inputs


class WholeModel:
    pad_multiple = 1

    def __init__(
        self,
        model: nn.Module,
        task: HeadKind,  # the head (resolve.Resolved.head): what the logits are compared with
        autocast: Callable,
        backward: Callable[[torch.Tensor, bool], None],
        offload_activations: bool,
        device: torch.device,
    ):
        self.model, self.task, self.autocast, self.backward = model, task, autocast, backward
        self.offload_activations, self.device = offload_activations, device

    def train(self, batch: dict[str, torch.Tensor], count: int, last: bool) -> torch.Tensor:
        if isinstance(self.model, FSDPModule):  # FSDP reduce-scatters in every backward unless told not to
            self.model.set_requires_gradient_sync(last)
        with offload_context(self.offload_activations, self.device):
            loss = summed_loss(self.forward(batch), targets(batch, self.task)) / count
        self.backward(loss, last)
        return loss.detach()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.autocast():
            return self.model(**model_inputs(batch)).logits
