"""Tensor-parallel scaling on this CPU, the FLOP rate of a training step against the matmul peak, and compile.

`make bench-speed DATA=../shared/data/sst2` (also part of `make bench`). Every figure is whole training steps of
the real trainer (bench/steps.py: fixed 64-token sequences, batch 16, median of 6 steps after 2 warm-up steps),
GPT-J config with 4 blocks (64-wide heads, MLP 4 x hidden) and the SST-2 BPE vocabulary (8192), precision as
`auto` picks it on this CPU:
  tp        TP=2 (two processes, one thread each) vs one process with two threads, at hidden 512 and 1024:
            throughput ratio = one-process step time / TP=2 step time (1.0 = as fast as one process)
  mfu       the one-process run's model FLOP rate as a fraction of the CPU's theoretical peak (2 cores), beside
            the achievable matmul rate (a 0.5 s matmul probe, 2 threads)
  compile   compile=true vs eager, one process with two threads: step time, and the compile time paid in the
            warm-up steps
On GPUs each process has a GPU of its own (nccl refuses two ranks on one GPU): with one GPU the TP rows are
skipped, said so, and the one-process rows and compile still run. `--batch`/`--length` size the step (a GPU needs
bigger ones than a CPU to leave launch overhead behind).
Writes runs/bench/speed/speed.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from steps import REPO, measure  # noqa: E402

from parallel_finetune.outputs.reporting import percent  # noqa: E402

BATCH, LENGTH = 16, 64


def model(hidden: int) -> list[str]:
    return [
        f"model_config.n_embd={hidden}",
        f"model_config.n_head={hidden // 64}",
        f"model_config.n_inner={4 * hidden}",
        "model_config.n_layer=4",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "sst2"))
    parser.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--length", type=int, default=LENGTH)
    args = parser.parse_args()
    out = REPO / "runs" / "bench" / "speed"
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"tp": {}, "single": {}, "compile": {}, "batch": args.batch, "length": args.length}
    gpus = torch.cuda.device_count()
    step = (args.batch, args.length)
    for hidden in args.hidden:
        single = measure(1, 2, *step, model(hidden), args.data_dir, out / f"single-h{hidden}")
        results["single"][hidden] = single
        if gpus == 1:
            print(
                f"hidden {hidden}: one process on {torch.cuda.get_device_name(0)} {single['step_s']:.4f} s/step, "
                f"{single['tflops_per_device']:.3g} TFLOP/s, MFU {percent(single['mfu'])} of "
                f"{single['peak_tflops'] or float('nan'):.3g} TFLOP/s (TP=2 skipped: it needs 2 GPUs, this machine "
                "has 1)",
                flush=True,
            )
            continue
        tp = measure(2, 1, *step, model(hidden) + ["tensor_parallel_degree=2"], args.data_dir, out / f"tp2-h{hidden}")
        results["tp"][hidden] = {
            "single_2_threads": single,
            "tp2_1_thread_each": tp,
            "throughput_ratio": single["step_s"] / tp["step_s"],
        }
        print(
            f"hidden {hidden}: one process x 2 threads {single['step_s']:.3f} s/step (MFU {percent(single['mfu'])} "
            f"of {single['peak_tflops'] or float('nan'):.3g} TFLOP/s; achievable matmul rate "
            f"{single['achievable_tflops']:.3g} TFLOP/s), TP=2 x 1 thread {tp['step_s']:.3f} s/step: "
            f"ratio {single['step_s'] / tp['step_s']:.2f}",
            flush=True,
        )
    hidden = args.hidden[0]
    eager = results["single"][hidden]
    compiled = measure(1, 2, *step, model(hidden) + ["compile=true"], args.data_dir, out / f"compiled-h{hidden}")
    results["compile"] = {
        "hidden": hidden,
        "eager": eager,
        "compiled": compiled,
        "speedup": eager["step_s"] / compiled["step_s"],
        "compile_s": sum(compiled["warmup_s"]) - sum(eager["warmup_s"]),
    }
    print(
        f"compile (hidden {hidden}): eager {eager['step_s']:.3f} s/step, compiled {compiled['step_s']:.3f} s/step "
        f"({eager['step_s'] / compiled['step_s']:.2f}x); warm-up steps {sum(compiled['warmup_s']):.1f} s vs "
        f"{sum(eager['warmup_s']):.1f} s eager",
        flush=True,
    )
    (out / "speed.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
