"""QLoRA's memory on a ~1B checkpoint against the planner's estimate: QLoRA, LoRA and full fine-tuning at TP=2 and
FSDP DP=2 (sharding=full), per rank, on this machine's CPU.

`make bench-qlora-memory` (ARGS="--modes qlora lora", "--work DIR", "--keep"): writes a Llama-shaped checkpoint once
(Llama 3.2 1B's blocks: hidden 2048, 16 blocks, 32 heads, 2 key/value heads, MLP 8192, a 512-token vocabulary;
random fp16 weights, safetensors; 1.9 GiB) into --work, then under torchrun trains it for a few fp32 steps per mode
and layout and prints, per rank:
- state: parameters + gradients + optimizer bytes (summary.json's state_bytes_per_rank, tensor accounting; NF4
  weights as their codes and scalers) against the planner's params + grads + optimizer;
- load: the process's peak RSS while the model loads (load_peak_mib_per_rank) above its RSS as the load began
  (the data already tokenized, the process groups up: neither is the model's), against the planner's `load` (its
  GPU overheads left out: no CUDA context on a CPU, no 1.1 factor);
- training: the run's peak RSS (peak_memory_mib_per_rank) above the same baseline, against the planner's params +
  gathered + dequantized + grads + optimizer + activations, at the compute dtype's 4 B (fp32 on a CPU).
The ranks run with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB: glibc otherwise raises its mmap threshold as
tensors are freed and keeps later freed tensors in its heap, so RSS would count memory the process no longer uses.
The checkpoint is deleted at the end unless --keep. Full fine-tuning keeps 16 B per parameter: 7.8 GB per rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from parallel_finetune.launch import torchrun_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 2048, 16, 32, 2, 512
BATCH, MAX_LENGTH, STEPS, RANK = 4, 64, 2, 16
MODES = {
    "qlora": ["peft=lora", f"lora_rank={RANK}", "lora_target_modules=all-linear", "lora_base_quantization=nf4"],
    "lora": ["peft=lora", f"lora_rank={RANK}", "lora_target_modules=all-linear"],
    "full": ["peft=none"],
}
LAYOUTS = {"TP=2": ["tensor_parallel_degree=2"], "FSDP DP=2": ["tensor_parallel_degree=1", "sharding=full"]}
MIB = 2**20


def anonymous_rss_mib() -> float:
    """This process's resident anonymous memory (RssAnon): what it allocated, without the checkpoint's
    memory-mapped file pages, which the OS counts in RSS while they are read and can drop at any time."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon in /proc/self/status: this benchmark needs Linux")


class PeakSampler(threading.Thread):
    """The peak of `anonymous_rss_mib`, sampled every millisecond (the trainer's own peak is the OS's VmHWM, which
    includes the memory-mapped checkpoint)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = self.window_peak = anonymous_rss_mib()

    def run(self) -> None:
        while True:
            rss = anonymous_rss_mib()
            self.peak, self.window_peak = max(self.peak, rss), max(self.window_peak, rss)
            time.sleep(0.001)

    def __call__(self, device=None) -> float:  # stands in for hardware.peak_memory_mib in the trainer's records
        self.peak = max(self.peak, anonymous_rss_mib())
        return self.peak


class LoadWindow:
    """Stands in for hardware.peak_memory_mib in model.py, which reads it as the model's load starts and when the
    model is ready: the first call opens a window at the RSS of that moment (the data read and tokenized, the
    process groups up: what the planner's load term leaves out), the second returns the window's peak."""

    def __init__(self, sampler: PeakSampler, record: Path) -> None:
        self.sampler, self.record, self.start = sampler, record, None

    def __call__(self, device=None) -> float:
        rss = anonymous_rss_mib()
        if self.start is None:
            self.start = self.sampler.window_peak = rss
            self.record.write_text(json.dumps(rss))
            return rss
        return max(self.sampler.window_peak, rss)


def worker(out: str, overrides: list[str]) -> None:
    from parallel_finetune.loop.run import run
    from parallel_finetune.model.load import load as model
    from parallel_finetune.outputs import summary
    from parallel_finetune.parallel.hardware import peak_memory_mib
    from parallel_finetune.resolve import load_config

    sampler = PeakSampler()  # torch and the package imported, nothing loaded: the baseline
    rank = os.environ["RANK"]
    Path(out, f"baseline-{rank}.json").write_text(json.dumps(sampler.peak))
    sampler.start()
    summary.peak_memory_mib = sampler  # the run's peak: RssAnon since the process started
    model.peak_memory_mib = LoadWindow(sampler, Path(out, f"load-start-{rank}.json"))  # the load's own peak
    run(load_config(None, overrides))
    Path(out, f"vmhwm-{rank}.json").write_text(json.dumps(peak_memory_mib(__import__("torch").device("cpu"))))


def measure(folder: Path, work: Path, mode: str, layout: str) -> dict:
    out = work / f"{mode}-{layout.replace(' ', '').replace('=', '')}"
    out.mkdir(parents=True, exist_ok=True)
    overrides = [
        "family=llama",
        "size=full",
        f"model={folder}",
        "precision=fp32",
        f"batch_size={BATCH}",
        "eval_batch_size=8",
        f"max_length={MAX_LENGTH}",
        f"max_steps={STEPS}",
        "export=false",
        f"output_dir={out}",
        "overwrite=true",
        "resume=none",
        f"data_dir={REPO / 'src' / 'parallel_finetune' / 'sample_data'}",
        f"cache_dir={work / 'cache'}",
        *MODES[mode],
        *LAYOUTS[layout],
    ]
    command = torchrun_command(2, __file__, "--worker", str(out), *overrides)
    proc = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(128 * 1024)),
    )
    if proc.returncode:
        return {"failed": (proc.stdout + proc.stderr)[-1500:]}
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # full fine-tuning's is 12 GB
    baseline = [json.loads((out / f"baseline-{r}.json").read_text()) for r in range(2)]
    load_start = [json.loads((out / f"load-start-{r}.json").read_text()) for r in range(2)]
    return {
        "state": [sum(rank.values()) for rank in summary["state_bytes_per_rank"]],
        "load": [(p - b) * MIB for p, b in zip(summary["load_peak_mib_per_rank"], load_start)],
        "train": [(p - b) * MIB for p, b in zip(summary["peak_memory_mib_per_rank"], baseline)],
        "baseline_mib": baseline,
        "load_start_mib": load_start,  # load_start - baseline: the data and process groups, before the model
        "vmhwm_mib": [json.loads((out / f"vmhwm-{r}.json").read_text()) for r in range(2)],
    }


def estimate(folder: Path, mode: str, layout: str) -> dict:
    from parallel_finetune.tools.planner import Candidate, memory_per_gpu, model_shape

    shape = model_shape(str(folder))
    if mode != "full":
        shape = dataclasses.replace(shape, lora_rank=RANK, nf4=mode == "qlora")
    candidate = Candidate(2, 1, 1, "none", False, 1) if layout == "TP=2" else Candidate(1, 1, 2, "full", False, 1, 2)
    memory = memory_per_gpu(shape, candidate, longest_row(folder), BATCH, compute_bytes=4)
    terms = ("params", "gathered", "dequantized", "grads", "optimizer", "activations")
    return {
        "state": memory["params"] + memory["grads"] + memory["optimizer"],
        "load": memory["load"],
        "train": sum(memory[t] for t in terms),
    }


def longest_row(folder: Path) -> int:
    """Tokens in the longest training row: the planner's s, the worst batch (the sample sentences are shorter than
    MAX_LENGTH, and batches are padded to their longest row only)."""
    from transformers import AutoTokenizer

    from parallel_finetune.data.prepare import column, read_glue_dir

    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = column(read_glue_dir(REPO / "src" / "parallel_finetune" / "sample_data")["train"], "text")
    return min(MAX_LENGTH, max(len(tokenizer(text)["input_ids"]) for text in texts) + 1)


def write_model(work: Path) -> Path:
    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.model.synthetic import write_checkpoint

    folder = work / f"llama-h{HIDDEN}-l{LAYERS}-a{HEADS}-kv{KV_HEADS}-float16"
    if not (folder / "config.json").is_file():
        print(f"writing {folder} ...", flush=True)
        sentences = column(read_glue_dir(REPO / "src" / "parallel_finetune" / "sample_data")["train"], "text")
        write_checkpoint(
            folder, "llama", sentences, hidden=HIDDEN, layers=LAYERS, heads=HEADS, dtype="float16", vocab_size=VOCAB
        )
    return folder


def row(mode: str, layout: str, measured: dict, planned: dict) -> str:
    if "failed" in measured:
        return f"{mode:<6} {layout:<10} failed: {measured['failed'].splitlines()[-1][:120]}"
    cells = []
    for part in ("state", "load", "train"):
        worst = max(measured[part])
        cells.append(
            f"{', '.join(f'{m / MIB:,.0f}' for m in measured[part]):>15} {planned[part] / MIB:>7,.0f} "
            f"{worst / planned[part]:>5.2f}"
        )
    return f"{mode:<6} {layout:<10} " + "  ".join(cells)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-qlora-memory")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint for the next run")
    parser.add_argument("--report", action="store_true", help="print the table of --work's last runs again")
    args = parser.parse_args()
    folder = write_model(args.work)
    if args.report:
        for result in json.loads((args.work / "qlora_memory.json").read_text()):
            planned = estimate(folder, result["mode"], result["layout"])
            print(row(result["mode"], result["layout"], result["measured"], planned))
        return 0
    from parallel_finetune.tools.planner import model_shape

    print(
        f"llama {model_shape(str(folder)).total / 1e9:.3f}B parameters, fp16 files, batch {BATCH} x {MAX_LENGTH} "
        f"tokens, {STEPS} fp32 steps, LoRA rank {RANK} on every Linear of the blocks"
    )
    print("MiB per rank (rank 0, rank 1), planner estimate, worst rank / estimate")
    print(
        f"{'mode':<6} {'layout':<10} {'state':>15} {'plan':>7} {'ratio':>5}  {'load':>15} {'plan':>7} {'ratio':>5}  "
        f"{'training':>15} {'plan':>7} {'ratio':>5}"
    )
    results = []
    for layout in args.layouts:
        for mode in args.modes:
            measured, planned = measure(folder, args.work, mode, layout), estimate(folder, mode, layout)
            results.append({"mode": mode, "layout": layout, "measured": measured, "estimate": planned})
            print(row(mode, layout, measured, planned), flush=True)
            (args.work / "qlora_memory.json").write_text(json.dumps(results, indent=1))
    if not args.keep:
        shutil.rmtree(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
