"""WholeModel: the `interfaces.Runner` (forward and backward of an accumulation slice) for the model this rank holds,
whole or tensor-parallel or FSDP-sharded. The other Runner is `parallel/pipeline.py`'s Pipeline: this rank's
stages, run by a pipeline schedule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from ..data.batch import Batch
from ..families.base import Family
from ..interfaces import Objective, Stats
from ..model import attention
from ..parallel.memory import offload_context
from ..tasks.task import HeadKind
from .loss import hidden_loss_forward


def model_inputs(batch: Batch, family: Family | None = None, model: nn.Module | None = None) -> dict:
    """What the model's forward takes for `batch`: its positions (a left-padded row sees the positions of its
    unpadded self; transformers would number the padding too), and a packed batch takes the 4-D mask `family`
    builds from them for `model`'s attention implementation (none under flash attention: the positions say where
    rows start), so that no token attends to another row. Under varlen attention (model/attention.py) the rows'
    boundaries travel as keyword arguments of the forward instead, with an all-ones mask (SDPA's mask function
    makes none for it)."""
    mask, rows = batch.attention_mask, {}
    if batch.packed and model.config._attn_implementation == attention.NAME:
        mask, rows = torch.ones_like(batch.attention_mask), attention.varlen_inputs(batch.positions)
    elif batch.packed:
        mask = family.packed_mask(model.config, batch.positions, next(model.parameters()).dtype)
    inputs = {"input_ids": batch.input_ids, "attention_mask": mask, "position_ids": batch.positions, "use_cache": False}
    inputs.update(rows)
    if batch.token_type_ids is not None:  # sentence pairs of a family with token types (BERT)
        inputs["token_type_ids"] = batch.token_type_ids
    return inputs


class WholeModel:
    pad_multiple = 1  # batches' lengths are padded to a multiple of it (the model stage sets data.pad_to_multiple_of)

    def __init__(
        self,
        model: nn.Module,
        head: HeadKind,  # the head (resolve.Resolved.head): a packed classifier reads every position's logits
        objective: Objective,  # the head's (loss.objective_for), or a pair objective
        autocast: Callable,
        backward: Callable[[torch.Tensor, bool], None],
        offload_activations: bool,
        device: torch.device,
        packing: Family | None = None,
    ):
        """`packing`: the family, when training batches are packed (its masks and per-position logits)."""
        self.model, self.head, self.objective, self.autocast, self.backward = model, head, objective, autocast, backward
        self.offload_activations, self.device, self.family = offload_activations, device, packing
        if packing is not None:
            packing.prepare_packing(model)

    def train(self, batch: Batch, count: int, last: bool) -> tuple[torch.Tensor, Stats]:
        if isinstance(self.model, FSDPModule):  # FSDP reduce-scatters in every backward unless told not to
            self.model.set_requires_gradient_sync(last)
        with offload_context(self.offload_activations, self.device):
            loss, stats = self.summed_loss(batch)
            loss = loss / count
        self.backward(loss, last)
        return loss.detach(), stats

    def summed_loss(self, batch: Batch) -> tuple[torch.Tensor, Stats]:
        """The batch's loss, summed, and the objective's statistics: a language model's from its hidden states
        and head (no logits; see loss.hidden_loss_forward), any other from its logits."""
        if self.objective.takes_hidden:
            with self.autocast():
                return hidden_loss_forward(
                    self.model, model_inputs(batch, self.family, self.model), batch.loss_target(), self.objective
                )
        return self.objective(self.forward(batch), batch.loss_target())

    @torch.no_grad()
    def loss(self, batch: Batch) -> tuple[torch.Tensor, Stats]:
        """The summed loss without gradients (evaluation), and its statistics."""
        return self.summed_loss(batch)

    @torch.no_grad()
    def last_logits(self, batch: Batch) -> torch.Tensor:
        """Each row's logits at its last real token (rows, vocabulary): a language model's next token, the head
        applied to that position only (generation)."""
        last = batch.last_positions()[:, None]
        with self.autocast():
            return self.model(**model_inputs(batch, self.family, self.model), logits_to_keep=last).logits[:, -1]

    def forward(self, batch: Batch) -> torch.Tensor:
        if batch.packed and self.head is HeadKind.CLASSIFICATION:
            return self.position_logits(batch)
        with self.autocast():
            return self.model(**model_inputs(batch, self.family, self.model)).logits

    def position_logits(self, batch: Batch) -> torch.Tensor:
        """A packed batch's classifier logits at every position (rows, length, labels), taken inside the model's
        own forward (its pooled logits, one per packed sequence, mean nothing)."""
        logits: list[torch.Tensor] = []
        handle = self.family.position_logits_hook(self.model, logits.append)
        try:
            with self.autocast():
                self.model(**model_inputs(batch, self.family, self.model))
        finally:
            handle.remove()
        return logits[-1]
