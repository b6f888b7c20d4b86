"""Pipeline parallelism (PP=2) against the bubble model, for the GPipe and 1F1B schedules.

`make bench-pipeline DATA=../shared/data/sst2` (also part of `make bench`). Each measurement is a torchrun launch of
the real trainer (tiny GPT-J widened to hidden 512, 4 blocks, fp32, one thread per process) timing whole
training steps on fixed 64-token sequences:
  t1        one process, one thread, the same global batch
  PP=2      two processes (one stage each, 2 blocks), m micro-batches
  ideal     t1 / p * (m + p - 1) / m    (p = 2: the stage work halves, the bubble adds p - 1 micro-batch slots)
  efficiency = ideal / measured
Two views: micro-batches kept at 8 sequences (the global batch grows with m: 16, 32, 64) and the global batch
kept at 16 (micro-batches of 8, 4 and 2 sequences). Writes runs/bench/pipeline/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
LENGTH = 64
MODEL = ["model_config.n_embd=512", "model_config.n_head=8", "model_config.n_layer=4"]
STAGES = 2


def worker(argv: list[str]) -> None:
    """Under torchrun: set the trainer up as a user run would, then time train_step on fixed-length batches."""
    import torch

    from parallel_finetune.config import load_config
    from parallel_finetune.trainer import Trainer

    warmup, steps = int(os.environ["BENCH_WARMUP"]), int(os.environ["BENCH_STEPS"])
    config = load_config(REPO / "recipes" / "gptj" / "tp.yaml", argv)

    class FixedLengthTrainer(Trainer):
        def micro_batch(self, indices, ids=None, labels=None):
            generator = torch.Generator().manual_seed(len(indices))
            rows = len(indices)
            batch = {"input_ids": torch.randint(1, 1000, (rows, LENGTH), generator=generator),
                     "attention_mask": torch.ones(rows, LENGTH, dtype=torch.long),
                     "labels": torch.randint(0, 2, (rows,), generator=generator)}
            return {k: v.to(self.layout.device) for k, v in batch.items()}

    trainer = FixedLengthTrainer(config)
    trainer.setup()
    trainer.model.train()
    times = [trainer.train_step(list(range(config.batch_size)))["step_time_s"] for _ in range(warmup + steps)]
    if trainer.layout.is_main:
        (Path(config.output_dir) / "step_times.json").write_text(json.dumps(times[warmup:]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(nproc: int, batch: int, overrides: list[str], data_dir: str, folder: Path, warmup: int,
            steps: int) -> float:
    """Median seconds per training step."""
    settings = ["size=tiny", "precision=fp32", f"batch_size={batch}", f"max_length={LENGTH}", "export=false",
                "tensor_parallel_degree=1", f"max_steps={warmup + steps}", f"data_dir={data_dir}",
                f"output_dir={folder}", "overwrite=true", "log_every=1000", *MODEL, *overrides]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", *settings]
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_WARMUP=str(warmup), BENCH_STEPS=str(steps))
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{folder.name} failed:\n{proc.stderr[-3000:]}")
    return statistics.median(json.loads((folder / "step_times.json").read_text()))


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    out = REPO / "runs" / "bench" / "pipeline"
    out.mkdir(parents=True, exist_ok=True)
    views = {"micro-batch 8 x 64 tokens": lambda m: 8 * m, "global batch 16": lambda m: 16}
    single: dict[int, float] = {}
    pipelined: dict[tuple, float] = {}  # both views share the m=2 runs
    rows = []
    for view, batch_of in views.items():
        for m in args.micro_batches:
            batch = batch_of(m)
            if batch not in single:
                single[batch] = measure(1, batch, [], args.data_dir, out / f"single-b{batch}", args.warmup,
                                        args.steps)
            ideal = single[batch] / STAGES * (m + STAGES - 1) / m
            for schedule in ("gpipe", "1f1b"):
                if (batch, m, schedule) not in pipelined:
                    pipelined[batch, m, schedule] = measure(
                        STAGES, batch, [f"pipeline_parallel_degree={STAGES}", f"microbatches={m}",
                                        f"pipeline_schedule={schedule}"],
                        args.data_dir, out / f"pp{STAGES}-{schedule}-b{batch}-m{m}", args.warmup, args.steps)
                seconds = pipelined[batch, m, schedule]
                rows.append({"view": view, "batch": batch, "microbatches": m, "rows_per_microbatch": batch // m,
                             "schedule": schedule, "t1_s": single[batch], "pp_s": seconds, "ideal_s": ideal,
                             "efficiency": ideal / seconds})
                print(f"{view:<26} batch {batch:>3} m={m} {schedule:<5} t1 {single[batch]:.3f} s  "
                      f"PP=2 {seconds:.3f} s  ideal {ideal:.3f} s  efficiency {ideal / seconds:.2f}", flush=True)
    print(f"\n| view | batch | m | rows/micro | schedule | t1 (s) | PP=2 (s) | ideal (s) | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['view']} | {r['batch']} | {r['microbatches']} | {r['rows_per_microbatch']} | {r['schedule']} | "
              f"{r['t1_s']:.3f} | {r['pp_s']:.3f} | {r['ideal_s']:.3f} | {r['efficiency']:.2f} |")
    (out / "pipeline.json").write_text(json.dumps({"model": MODEL, "length": LENGTH, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
