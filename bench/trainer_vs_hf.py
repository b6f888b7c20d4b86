"""Single-process training throughput: our trainer vs the Hugging Face `Trainer`, same model, data, batch, precision.

By default the real pretrained MiniLM checkpoint (recipes/bert/minilm.yaml), 300 steps of batch 32, the recipe's
lr and warm-up in both loops, fp32 (`--precision`; `auto` picks bf16 on CPUs with bf16 units), 2 threads.
Every run is its own process (no order effects: allocator, caches, compiled code), and `--rounds` repeats the
set in rotated order; the table gives medians. Runs:
  ours                scripts/train.py's trainer (dynamic padding, length-grouped global batches, compile auto)
  ours-eager          the same with compile=false
  ours-compile        the same with compile=true
  ours-random         group_by_length=false (random batches, like the Trainer's default sampler)
  hf-dynamic          transformers.Trainer with DataCollatorWithPadding (pads each batch to its longest row)
  hf-grouped          the same with train_sampling_strategy="group_by_length" (the Trainer at its best, eager)
  hf-grouped-compile  the same with torch_compile=True
  hf-pad128           transformers.Trainer as run_glue.py runs by default (every row padded to max_seq_length=128)
Prints samples/s, dev accuracy, the load average and the ratios against the better of hf-grouped and
hf-grouped-compile; writes runs/bench/trainer_vs_hf.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DataCollatorWithPadding, Trainer, TrainingArguments  # noqa: E402

from parallel_finetune.families import get_family  # noqa: E402
from parallel_finetune.loop.builder import RunBuilder, prepare_data  # noqa: E402
from parallel_finetune.model.hub import download_model  # noqa: E402
from parallel_finetune.model.load import load_model, seed_everything  # noqa: E402
from parallel_finetune.outputs.summary import padding_fraction  # noqa: E402
from parallel_finetune.resolve import load_config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def our_run(config) -> dict:
    trainer = RunBuilder(config).build().trainer
    trainer.fit()
    trainer.reporter.close()
    results = trainer.evaluator.evaluate()
    seconds = trainer.timer.seconds["train"]
    torch.distributed.destroy_process_group()
    return {
        "samples_per_s": config.max_steps * config.batch_size / seconds,
        "train_seconds": seconds,
        "accuracy": results["accuracy"],
        "padding_fraction": padding_fraction(trainer.padding.values()),
        "mfu": None if None in (mfus := [r["mfu"] for r in trainer.history]) else statistics.median(mfus),
        "peak_tflops": trainer.peak.tflops,  # None: unknown
        "achievable_matmul_tflops": trainer.peak.achievable_tflops,
    }


def hf_run(config, prepared, output_dir: Path, pad_to_128=False, grouped=False, compiled=False) -> dict:
    family = get_family(config.family)
    tokenizer = prepared.tokenizer
    model_path = download_model(config.model.model, config.revision) if config.size == "full" else None
    hf_config = family.config_for(
        model=config.model,
        head=prepared.task.head,
        max_length=config.max_length,
        tokenizer_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        model_path=model_path,
        labels=prepared.task,
    )
    seed_everything(config.seed)
    # The same weights (the checkpoint's, and the same new classifier head) in transformers' own class: our
    # family's surgery (BERT's last layer computing only [CLS]) is part of what is measured, not of the baseline.
    ours = load_model(family, "classification", hf_config, model_path, seed=config.seed).model
    model = family.hf_model("classification", hf_config)
    model.load_state_dict(family.to_hf_state_dict(ours.state_dict(), hf_config), strict=True)
    del ours

    def rows(split):
        dataset = prepared.splits[split].rename_column("label", "labels").remove_columns(["index"])
        if not (grouped and split == "train"):  # the length column spares LengthGroupedSampler a pass over the rows
            dataset = dataset.remove_columns(["length"])
        if pad_to_128:

            def pad(batch):
                padded = tokenizer.pad({"input_ids": batch["input_ids"]}, padding="max_length", max_length=128)
                return {"input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"]}

            dataset = dataset.map(pad, batched=True)
        return dataset

    args = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=config.batch_size,
        per_device_eval_batch_size=64,
        max_steps=config.max_steps,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_steps or math.ceil(config.warmup_ratio * config.max_steps),
        max_grad_norm=config.max_grad_norm,
        bf16=config.precision == "bf16",
        use_cpu=not torch.cuda.is_available(),
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        seed=config.seed,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length" if grouped else "random",
        torch_compile=compiled,
    )

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows("train"),
        eval_dataset=rows("validation"),
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=accuracy,
    )
    metrics = trainer.train().metrics
    evaluation = trainer.evaluate()
    return {
        "samples_per_s": metrics["train_samples_per_second"],
        "train_seconds": metrics["train_runtime"],
        "accuracy": evaluation["eval_accuracy"],
    }


RUNS = {
    "ours": [],
    "ours-eager": ["compile=false"],
    "ours-compile": ["compile=true"],
    "ours-random": ["group_by_length=false"],
    "hf-dynamic": {},
    "hf-grouped": {"grouped": True},
    "hf-grouped-compile": {"grouped": True, "compiled": True},
    "hf-pad128": {"pad_to_128": True},
}
TRAINER_AT_ITS_BEST = ("hf-grouped", "hf-grouped-compile")


def worker(name: str, args, out: Path) -> dict:
    """One run, in this process."""
    torch.set_num_threads(args.threads)
    config = load_config(
        args.recipe,
        [
            f"data_dir={args.data_dir}",
            f"max_steps={args.steps}",
            "batch_size=32",
            "tensor_parallel_degree=1",
            "export=false",
            f"output_dir={out / name}",
            "overwrite=true",
            "resume=none",
            "log_every=1000000",
            f"precision={args.precision}",
            *args.overrides,
            *(RUNS[name] if name.startswith("ours") else []),
        ],
    )
    if config.precision == "auto":
        from parallel_finetune.model.precision import resolve_precision

        config.precision = resolve_precision("auto", torch.device("cpu"), "torch")
    if name.startswith("ours"):
        return our_run(config)
    return hf_run(config, prepare_data(config), out / name, **RUNS[name])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="GLUE SST-2 folder (default: ../shared/data/sst2 if present)")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "bert" / "minilm.yaml"))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--precision", default="fp32", help="fp32 (default), bf16 or auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the runs, rotating their order (medians)")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["ours", "hf-grouped", "hf-grouped-compile"],
        choices=list(RUNS),
        help="which runs (default: ours and the Trainer at its best)",
    )
    parser.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="trainer_vs_hf", help="name of the result file under runs/bench/")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model_config.n_embd=512")
    args = parser.parse_args()
    args.data_dir = args.data_dir or str(REPO.parent / "shared" / "data" / "sst2")
    out = REPO / "runs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        Path(args.json).write_text(json.dumps(worker(args.worker, args, out)))
        return 0
    results: dict[str, list[dict]] = {name: [] for name in args.runs}
    for number in range(args.rounds):
        order = args.runs[number % len(args.runs) :] + args.runs[: number % len(args.runs)]
        for name in order:
            result_file = out / f"{args.tag}-{name}-{number}.json"
            command = [sys.executable, __file__, "--worker", name, "--json", str(result_file)]
            command += ["--data-dir", args.data_dir, "--recipe", args.recipe, "--steps", str(args.steps)]
            command += ["--precision", args.precision, "--threads", str(args.threads), *args.overrides]
            load_before = os.getloadavg()[0]
            started = time.perf_counter()
            proc = subprocess.run(command, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
            result = json.loads(result_file.read_text())
            result.update(wall_s=time.perf_counter() - started, load_before=load_before, load_after=os.getloadavg()[0])
            results[name].append(result)
            print(
                f"round {number + 1} {name:19s} {result['samples_per_s']:7.1f} samples/s  accuracy "
                f"{result['accuracy']:.4f}  ({result['wall_s']:.0f} s, load {load_before:.2f} -> "
                f"{result['load_after']:.2f})",
                flush=True,
            )
    medians = {
        name: {
            "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
            "accuracy": statistics.median(r["accuracy"] for r in runs),
        }
        for name, runs in results.items()
    }
    ratios = {}
    best = max(
        (n for n in TRAINER_AT_ITS_BEST if n in medians), key=lambda n: medians[n]["samples_per_s"], default=None
    )
    for name in medians:
        if name.startswith("ours"):
            for other in [n for n in medians if n.startswith("hf")]:
                ratios[f"{name} / {other}"] = medians[name]["samples_per_s"] / medians[other]["samples_per_s"]
    print("medians:")
    for name, m in medians.items():
        print(f"  {name:19s} {m['samples_per_s']:7.1f} samples/s  accuracy {m['accuracy']:.4f}")
    for name, ratio in ratios.items():
        print(
            f"{name}: {ratio:.2f}x" + ("  <- the better Trainer configuration" if best and name.endswith(best) else "")
        )
    setup = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "steps": args.steps,
        "batch_size": 32,
        "precision": args.precision,
        "threads": args.threads,
        "rounds": args.rounds,
        "data": args.data_dir,
        "better_trainer": best,
    }
    (out / f"{args.tag}.json").write_text(
        json.dumps({"setup": setup, "results": results, "medians": medians, "ratios": ratios}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
