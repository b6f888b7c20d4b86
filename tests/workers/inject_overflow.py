"""Trains with an inf planted in one rank's gradient at one step; every rank writes what it decided.

torchrun ... inject_overflow.py RECIPE key=value ... (env INJECT_RANK, INJECT_STEP; INJECT_DURING_BACKWARD=1 plants
it from a gradient hook, before the overlapped data-parallel buckets read the gradient, instead of after the
backward)"""

import json
import os
import sys
from pathlib import Path

import torch

from parallel_finetune.loop.builder import RunBuilder
from parallel_finetune.loop.trainer import Trainer
from parallel_finetune.parallel.gradients import local
from parallel_finetune.resolve import load_config

INJECT_RANK = int(os.environ["INJECT_RANK"])
INJECT_STEP = int(os.environ["INJECT_STEP"])
DURING_BACKWARD = os.environ.get("INJECT_DURING_BACKWARD") == "1"


def plant_inf(trainer: Trainer, step: int) -> None:
    # A replicated (plain) LayerNorm weight: nothing but the explicit agreement would carry this inf to
    # the other tensor-parallel rank.
    if step == INJECT_STEP and trainer.layout.rank == INJECT_RANK:
        local(trainer.model.transformer.ln_f.weight.grad)[0] = float("inf")


def plant_inf_in_backward(trainer: Trainer) -> None:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if trainer.step + 1 != INJECT_STEP:
            return grad
        grad = grad.clone()
        grad[0] = float("inf")
        return grad

    if trainer.layout.rank == INJECT_RANK:
        trainer.model.transformer.ln_f.weight.register_hook(hook)  # runs before the gradient is accumulated


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    trainer = RunBuilder(config).build().trainer
    trainer.after_backward = None if DURING_BACKWARD else plant_inf
    if DURING_BACKWARD:
        plant_inf_in_backward(trainer)
    before = None
    history = []
    for global_batch in trainer.sampler.epoch(0)[: trainer.steps.total]:
        if trainer.step + 1 == INJECT_STEP:
            before = {n: local(p.detach()).clone() for n, p in trainer.model.named_parameters()}
        record = trainer.train_step(global_batch)
        history.append(record)
        if record["step"] == INJECT_STEP:
            unchanged = all(torch.equal(local(p.detach()), before[n]) for n, p in trainer.model.named_parameters())
    out = Path(config.output_dir) / f"rank{trainer.layout.rank}.json"
    out.write_text(
        json.dumps(
            {
                "history": history,
                "params_unchanged_at_injected_step": unchanged,
                "final_scale": trainer.updates.loss_scale,
            }
        )
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
