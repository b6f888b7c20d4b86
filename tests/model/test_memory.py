"""Activation checkpointing, measured: peak activation bytes fall, the loss and gradients stay identical.

In-process (no torchrun): PyTorch's MemTracker counts tensors, so the figures are exact on a CPU too."""

from __future__ import annotations

import pytest
import torch

from parallel_finetune.families import get_family
from parallel_finetune.model.load import load_model
from parallel_finetune.parallel.memory import apply_activation_checkpointing, peak_activation_bytes


def train_step_under_tracker(family_name: str, every: bool | int) -> tuple[int, float, dict[str, torch.Tensor]]:
    family = get_family(family_name)
    torch.manual_seed(0)
    config = family.tiny_config(vocab_size=8192, max_positions=128)
    config.num_hidden_layers = 4
    config.use_cache = False
    family.set_task(config, "classification", pad_token_id=0)
    model = load_model(family, "classification", config, None, seed=0).model
    apply_activation_checkpointing(family.blocks(model), every)
    input_ids = torch.randint(1, 8192, (16, 64), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(2))
    losses = []

    def forward_backward():
        loss = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels).loss
        loss.backward()
        losses.append(loss.item())

    peak = peak_activation_bytes(model, forward_backward)
    return peak, losses[0], {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["gptj", "bert"])
def test_activation_checkpointing_lowers_peak_activations_and_keeps_the_loss(family):
    peak_off, loss_off, grads_off = train_step_under_tracker(family, False)
    peak_half, loss_half, _ = train_step_under_tracker(family, 2)
    peak_all, loss_all, grads_all = train_step_under_tracker(family, True)
    print(f"{family}: peak activation bytes off {peak_off}, every 2nd block {peak_half}, every block {peak_all}")
    assert peak_all < peak_half < peak_off
    assert peak_all < 0.6 * peak_off
    assert loss_all == loss_half == loss_off
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_all[name], grad, rtol=0, atol=1e-6, msg=name)
