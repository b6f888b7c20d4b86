"""The planner's activation and logits terms for instruction tuning, against the same step measured on this CPU.

`python bench/planner_lm.py`: a Llama (hidden 256, 4 blocks, 8 heads, a 32,000-token vocabulary), one fp32
forward and backward of 16 chat-like rows (lengths drawn like issue 47's conversations, scaled to max_length
512) through the run's own runner, padded to the longest row or packed into max_length sequences, with the loss
from whole logits (loss_chunk_tokens=0) or in chunks of 256 tokens. Measured: peak bytes of activations and
backward temporaries (PyTorch's MemTracker, as bench/memory.py and tests/model/test_memory.py count them).
Planned: tools/planner.memory_per_gpu's activations + logits for the same shape (fp32: compute_bytes=4), the
rows' real mean length as tokens_per_row, their longest as the padded length.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rows(count: int = 16, longest: int = 512, seed: int = 0) -> list[list[int]]:
    draw = random.Random(seed)
    return [
        [draw.randrange(10, 30000) for _ in range(min(longest, int(draw.lognormvariate(5.2, 0.6))))]
        for _ in range(count)
    ]


def measured(batch_rows, packing: bool, chunk: int) -> int:
    from parallel_finetune.data.batch import PackedBatcher, PaddedBatcher, TokenizedSplit
    from parallel_finetune.data.packing import PackedShape
    from parallel_finetune.families import get_family
    from parallel_finetune.loop.loss import TOKEN_OBJECTIVE, HiddenTokenLoss
    from parallel_finetune.loop.runner import WholeModel
    from parallel_finetune.parallel.memory import peak_activation_bytes
    from parallel_finetune.tasks.task import HeadKind

    family = get_family("llama")
    config = family.sized_config(32000, 512, 256, 4, 8)
    family.set_task(config, HeadKind.CAUSAL_LM, 0)
    torch.manual_seed(0)
    model = family.hf_model(HeadKind.CAUSAL_LM, config)
    split = TokenizedSplit(
        HeadKind.CAUSAL_LM, batch_rows, [len(r) for r in batch_rows], [len(r) - 1 for r in batch_rows]
    )
    cpu = torch.device("cpu")
    if packing:
        batcher = PackedBatcher(split, pad_id=0, shape=PackedShape(capacity=512), device=cpu)
    else:
        batcher = PaddedBatcher(split, pad_id=0, padding_side="right", pad_multiple=1, device=cpu)
    batch = batcher.batch(list(range(len(batch_rows))))
    loss = HiddenTokenLoss(model.get_output_embeddings(), chunk) if chunk else TOKEN_OBJECTIVE
    runner = WholeModel(
        model, HeadKind.CAUSAL_LM, loss, contextlib.nullcontext, None, False, cpu, packing=family if packing else None
    )
    return peak_activation_bytes(model, lambda: runner.summed_loss(batch)[0].backward()), batch


def planned(batch_rows, packing: bool, chunk: int, batch) -> float:
    from parallel_finetune.families import get_family
    from parallel_finetune.tasks.task import HeadKind
    from parallel_finetune.tools.planner import Candidate, Workload, memory_per_gpu

    config = get_family("llama").sized_config(32000, 512, 256, 4, 8)
    shape = model_shape_of(config)
    mean = sum(map(len, batch_rows)) / len(batch_rows)
    length = 512 if packing else batch.length
    workload = Workload(head=HeadKind.CAUSAL_LM, seq_len=length, batch_size=len(batch_rows), packing=packing,
                        tokens_per_row=mean, loss_chunk_tokens=chunk)  # fmt: skip
    memory = memory_per_gpu(
        shape, Candidate(1, 1, 1, "none", False, 1), length, len(batch_rows), compute_bytes=4, workload=workload
    )
    return memory["activations"] + memory["logits"]


def model_shape_of(config):
    """The planner's shape of the measured model (a folder written for it, as a user's would be)."""
    import tempfile

    from parallel_finetune.tasks.task import HeadKind
    from parallel_finetune.tools.planner import model_shape

    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    return model_shape(str(folder), HeadKind.CAUSAL_LM)


def main() -> int:
    batch_rows = rows()
    table = []
    for packing in (False, True):
        for chunk in (0, 256):
            peak, batch = measured(batch_rows, packing, chunk)
            plan = planned(batch_rows, packing, chunk, batch)
            table.append({"packing": packing, "loss_chunk_tokens": chunk, "measured_mib": peak / 2**20,
                          "planned_mib": plan / 2**20, "planned_over_measured": plan / peak})  # fmt: skip
            row = table[-1]
            print(f"{'packed' if packing else 'padded':<7} chunk {chunk:>4}: measured {row['measured_mib']:8.1f} MiB, "
                  f"planned {row['planned_mib']:8.1f} MiB ({row['planned_over_measured']:.2f}x)")  # fmt: skip
    out = REPO / "runs" / "bench" / "planner_lm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
