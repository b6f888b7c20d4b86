"""Two data-parallel ranks, each with half of every batch, run `WholeModel` + `TorchUpdates` for three steps; rank 0
also trains the same model on whole batches with plain torch (mean loss, clip_grad_norm_, AdamW) and prints how
far apart the two are. Also checks `reduce_norm_and_loss`'s replica counting. Run by tests/loop/test_units.py."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "loop")]
from test_units import STEPS, batches, config, reference_training, tiny_classifier, torch_updates  # noqa: E402

from parallel_finetune.data.batch import Batch  # noqa: E402
from parallel_finetune.loop.loss import CLASS_OBJECTIVE  # noqa: E402
from parallel_finetune.loop.runner import WholeModel  # noqa: E402
from parallel_finetune.parallel.gradients import reduce_norm_and_loss  # noqa: E402
from parallel_finetune.parallel.layout import init_distributed  # noqa: E402
from parallel_finetune.tasks.task import HeadKind  # noqa: E402


def main() -> None:
    layout = init_distributed("cpu", 1)
    rank = layout.rank
    model = tiny_classifier()
    updates = torch_updates(model, layout, config())
    runner = WholeModel(
        model, HeadKind.CLASSIFICATION, CLASS_OBJECTIVE, contextlib.nullcontext, updates.backward, False, layout.device
    )
    losses = []
    for batch in batches():
        half = Batch(
            *(getattr(batch, name).chunk(2)[rank] for name in ("input_ids", "attention_mask", "positions", "labels"))
        )
        local, _ = runner.train(half, count=len(batch.labels), last=True)
        losses.append(updates.step(local, False, lambda *_: False).loss)

    # A piece every rank holds (2 copies) counts once; a piece only this rank holds counts fully.
    shared = torch.full((4,), 3.0)
    own = torch.full((4,), float(rank + 1))
    norm, loss, stop = reduce_norm_and_loss([(shared, 2), (own, 1)], torch.tensor(float(rank)), 1, 2, rank == 1)
    expected_norm = (shared.pow(2).sum() + 4 * 1.0 + 4 * 4.0).sqrt().item()

    if rank == 0:
        reference_model, reference_losses = reference_training()
        weights = dict(model.named_parameters())
        difference = max((weights[n] - p).abs().max().item() for n, p in reference_model.named_parameters())
        print(
            json.dumps(
                {
                    "steps": STEPS,
                    "losses": losses,
                    "reference_losses": reference_losses,
                    "weight_difference": difference,
                    "norm": norm,
                    "expected_norm": expected_norm,
                    "loss": loss,
                    "stop": stop,
                }
            )
        )


if __name__ == "__main__":
    main()
