"""Pipeline parallelism (PP=2) against the bubble model, for the GPipe and 1F1B schedules.

`make bench-pipeline DATA=../shared/data/sst2` (also part of `make bench`). Each measurement is a torchrun launch of
the real trainer (tiny GPT-J widened to hidden 512, 4 blocks, fp32, one thread per process) timing whole
training steps on fixed 64-token sequences:
  t1        one process, one thread, the same global batch
  PP=2      two processes (one stage each, 2 blocks), m micro-batches
  ideal     t1 / p * (m + p - 1) / m    (p = 2: the stage work halves, the bubble adds p - 1 micro-batch slots)
  efficiency = ideal / measured
  t1 sliced one process, one thread, the global batch run as m accumulation slices of the micro-batch's size:
            the same arithmetic at the same granularity as the pipeline's micro-batches, without a pipeline
  efficiency vs sliced = (t1 sliced / p * (m + p - 1) / m) / measured: what the schedule, the sends and the
            bubble cost, with small-matmul inefficiency (which no schedule removes) taken out
Two views: micro-batches kept at 8 sequences (the global batch grows with m: 16, 32, 64) and the global batch
kept at 16 (micro-batches of 8, 4 and 2 sequences). Writes runs/bench/pipeline/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from steps import REPO, measure  # noqa: E402

LENGTH = 64
MODEL = ["model_config.n_embd=512", "model_config.n_head=8", "model_config.n_layer=4"]
STAGES = 2


def main() -> int:
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
    sliced: dict[tuple[int, int], float] = {}  # (batch, m) -> one process, m accumulation slices
    pipelined: dict[tuple, float] = {}  # both views share the m=2 runs
    rows = []
    for view, batch_of in views.items():
        for m in args.micro_batches:
            batch = batch_of(m)
            if batch not in single:
                single[batch] = measure(
                    1,
                    1,
                    batch,
                    LENGTH,
                    ["precision=fp32", *MODEL],
                    args.data_dir,
                    out / f"single-b{batch}",
                    args.warmup,
                    args.steps,
                )["step_s"]
            ideal = single[batch] / STAGES * (m + STAGES - 1) / m
            if (batch, m) not in sliced:
                sliced[batch, m] = (
                    single[batch]
                    if m == 1
                    else measure(
                        1,
                        1,
                        batch,
                        LENGTH,
                        ["precision=fp32", *MODEL, f"gradient_accumulation_steps={m}"],
                        args.data_dir,
                        out / f"single-b{batch}-acc{m}",
                        args.warmup,
                        args.steps,
                    )["step_s"]
                )
            ideal_sliced = sliced[batch, m] / STAGES * (m + STAGES - 1) / m
            for schedule in ("gpipe", "1f1b"):
                if (batch, m, schedule) not in pipelined:
                    pipelined[batch, m, schedule] = measure(
                        STAGES,
                        1,
                        batch,
                        LENGTH,
                        [
                            "precision=fp32",
                            *MODEL,
                            f"pipeline_parallel_degree={STAGES}",
                            f"microbatches={m}",
                            f"pipeline_schedule={schedule}",
                        ],
                        args.data_dir,
                        out / f"pp{STAGES}-{schedule}-b{batch}-m{m}",
                        args.warmup,
                        args.steps,
                    )["step_s"]
                seconds = pipelined[batch, m, schedule]
                rows.append(
                    {
                        "view": view,
                        "batch": batch,
                        "microbatches": m,
                        "rows_per_microbatch": batch // m,
                        "schedule": schedule,
                        "t1_s": single[batch],
                        "pp_s": seconds,
                        "ideal_s": ideal,
                        "efficiency": ideal / seconds,
                        "t1_sliced_s": sliced[batch, m],
                        "efficiency_vs_sliced": ideal_sliced / seconds,
                    }
                )
                print(
                    f"{view:<26} batch {batch:>3} m={m} {schedule:<5} t1 {single[batch]:.3f} s  "
                    f"PP=2 {seconds:.3f} s  ideal {ideal:.3f} s  efficiency {ideal / seconds:.2f}  "
                    f"t1 sliced {sliced[batch, m]:.3f} s  efficiency vs sliced {ideal_sliced / seconds:.2f}",
                    flush=True,
                )
    print(
        "\n| view | batch | m | rows/micro | schedule | t1 (s) | PP=2 (s) | ideal (s) | efficiency "
        "| t1 sliced (s) | efficiency vs sliced |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['view']} | {r['batch']} | {r['microbatches']} | {r['rows_per_microbatch']} | {r['schedule']} | "
            f"{r['t1_s']:.3f} | {r['pp_s']:.3f} | {r['ideal_s']:.3f} | {r['efficiency']:.2f} | "
            f"{r['t1_sliced_s']:.3f} | {r['efficiency_vs_sliced']:.2f} |"
        )
    (out / "pipeline.json").write_text(json.dumps({"model": MODEL, "length": LENGTH, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
