"""Trains with an inf planted in one rank's gradient at one step; every rank writes what it decided.

torchrun ... inject_overflow.py RECIPE key=value ... (env INJECT_RANK, INJECT_STEP)"""

import json
import os
import sys
from pathlib import Path

import torch

from parallel_finetune.config import load_config
from parallel_finetune.parallel.gradients import local
from parallel_finetune.trainer import Trainer

INJECT_RANK = int(os.environ["INJECT_RANK"])
INJECT_STEP = int(os.environ["INJECT_STEP"])


def plant_inf(trainer: Trainer, step: int) -> None:
    # A replicated (plain) LayerNorm weight: nothing but the explicit agreement would carry this inf to
    # the other tensor-parallel rank.
    if step == INJECT_STEP and trainer.layout.rank == INJECT_RANK:
        local(trainer.model.transformer.ln_f.weight.grad)[0] = float("inf")


def main() -> None:
    config = load_config(sys.argv[1], sys.argv[2:])
    trainer = Trainer(config, after_backward=plant_inf)
    trainer.setup()
    before = None
    history = []
    for global_batch in trainer.batches.epoch(0)[: trainer.total_steps]:
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
