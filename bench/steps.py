"""Timing whole training steps of the real trainer on fixed-length batches, under torchrun: shared by the
pipeline and speed benchmarks.

`measure(...)` launches `torchrun --nproc_per_node N bench/steps.py --worker ...`; the worker sets the trainer up
as a user run would (recipe + overrides), replaces each micro-batch with random token ids of exactly
`length` tokens (so every step does the same work), runs warm-up + timed steps, and rank 0 writes the records.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from parallel_finetune.launch import torchrun_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "gptj" / "tp.yaml"


def worker(argv: list[str]) -> None:
    import dataclasses

    import torch

    from parallel_finetune.data.batch import padded_batch
    from parallel_finetune.loop.builder import RunBuilder
    from parallel_finetune.resolve import load_config

    warmup, steps, length = (int(os.environ[k]) for k in ("BENCH_WARMUP", "BENCH_STEPS", "BENCH_LENGTH"))
    config = load_config(RECIPE, argv)

    class FixedLengthBatcher:
        """Random rows of `length` tokens, labelled at random: every step the same shapes."""

        packed = False

        def __init__(self, split, vocab: int, device):
            self.split = dataclasses.replace(split, lengths=[length] * len(split))  # what FLOPs and tokens/s count
            self.vocab, self.device = vocab, device

        def batch(self, indices):
            generator = torch.Generator().manual_seed(len(indices))
            rows = torch.randint(1, self.vocab, (len(indices), length), generator=generator).tolist()
            batch = padded_batch(rows, pad_id=0)
            batch.labels = torch.randint(0, 2, (len(indices),), generator=generator)
            return batch.to(self.device)

        def token_slots(self, global_batch, dp, accumulation):
            return len(global_batch) * length

    built = RunBuilder(config).build()
    trainer = built.trainer
    # the sample data's tokenizer has fewer than 1000 tokens
    vocab = min(1000, len(built.data.tokenizer))
    trainer.batcher = FixedLengthBatcher(trainer.batcher.split, vocab, trainer.layout.device)
    trainer.model.train()
    records = [trainer.train_step(list(range(config.batch_size))) for _ in range(warmup + steps)]
    if trainer.layout.is_main:
        (Path(config.output_dir) / "step_records.json").write_text(
            json.dumps(
                {
                    "records": records,
                    "peak_tflops": trainer.peak.tflops,
                    "achievable_tflops": trainer.peak.achievable_tflops,
                    "warmup": warmup,
                }
            )
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(
    nproc: int,
    threads: int,
    batch: int,
    length: int,
    overrides: list[str],
    data_dir: str,
    folder: Path,
    warmup: int = 2,
    steps: int = 6,
) -> dict:
    """Median step seconds and MFU of the timed steps, plus the warm-up steps' seconds (compile time shows there)."""
    settings = [
        "size=tiny",
        f"batch_size={batch}",
        f"max_length={length}",
        "export=false",
        "tensor_parallel_degree=1",
        f"max_steps={warmup + steps}",
        f"data_dir={data_dir}",
        f"output_dir={folder}",
        "overwrite=true",
        "log_every=1000",
        *overrides,
    ]
    command = torchrun_command(nproc, __file__, "--worker", *settings)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        BENCH_WARMUP=str(warmup),
        BENCH_STEPS=str(steps),
        BENCH_LENGTH=str(length),
    )
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{folder.name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads((folder / "step_records.json").read_text())
    timed = result["records"][warmup:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in timed),
        "mfu": None if None in (mfus := [r["mfu"] for r in timed]) else statistics.median(mfus),
        "tflops_per_device": statistics.median(r["tflops_per_device"] for r in timed),
        "peak_tflops": result["peak_tflops"],  # None: unknown
        "achievable_tflops": result["achievable_tflops"],
        "warmup_s": [r["step_time_s"] for r in result["records"][:warmup]],
    }


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    worker(sys.argv[2:])
