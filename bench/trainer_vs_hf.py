"""Single-process training throughput: our trainer vs the Hugging Face `Trainer`, same model, data, batch, precision.

By default the real pretrained MiniLM checkpoint (recipes/bert/minilm.yaml), 400 steps of batch 32, the recipe's
lr and warm-up in both loops, precision as `auto` picks it (bf16 on CPUs with bf16 units, else fp32).
Four runs in one process, one after the other, on the same tokenized SST-2 (`make bench DATA=...`):
  ours          scripts/train.py's trainer (dynamic padding, length-grouped global batches)
  ours-random   the same with group_by_length=false (random batches, like the Trainer's default sampler)
  hf-dynamic    transformers.Trainer with DataCollatorWithPadding (pads each batch to its longest row)
  hf-pad128     transformers.Trainer as run_glue.py runs by default (every row padded to max_seq_length=128)
Prints samples/s, dev accuracy and the ratios; writes runs/bench/trainer_vs_hf.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DataCollatorWithPadding, Trainer, TrainingArguments  # noqa: E402

from parallel_finetune import data  # noqa: E402
from parallel_finetune.config import load_config  # noqa: E402
from parallel_finetune.families import get_family  # noqa: E402
from parallel_finetune.families.base import download_model  # noqa: E402
from parallel_finetune.model import seed_everything  # noqa: E402
from parallel_finetune.trainer import Trainer as OurTrainer  # noqa: E402
from parallel_finetune.trainer import padding_fraction  # noqa: E402
from parallel_finetune.weights import build_and_load  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def our_run(config) -> dict:
    trainer = OurTrainer(config)
    trainer.setup()
    trainer.fit()
    trainer.reporter.close()
    results = trainer.evaluate()
    seconds = trainer.timer.seconds["train"]
    torch.distributed.destroy_process_group()
    return {
        "samples_per_s": config.max_steps * config.batch_size / seconds,
        "train_seconds": seconds,
        "accuracy": results["accuracy"],
        "padding_fraction": padding_fraction(trainer.padding.values()),
        "mfu": statistics.median(r["mfu"] for r in trainer.history),
        "peak_tflops": trainer.peak_tflops,
    }


def hf_run(config, prepared, pad_to_128: bool, output_dir: Path) -> dict:
    family = get_family(config.family)
    tokenizer = prepared.tokenizer
    model_path = download_model(config.model, config.revision) if config.size == "full" else None
    hf_config = family.config_for(config, len(tokenizer), tokenizer.pad_token_id, model_path)
    seed_everything(config.seed)
    model = build_and_load(family, "classification", hf_config, model_path, config.seed)

    def rows(split):
        dataset = prepared.splits[split].rename_column("label", "labels").remove_columns(["length"])
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
    )

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows("train"),
        eval_dataset=rows("validation"),
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
    )
    metrics = trainer.train().metrics
    evaluation = trainer.evaluate()
    return {
        "samples_per_s": metrics["train_samples_per_second"],
        "train_seconds": metrics["train_runtime"],
        "accuracy": evaluation["eval_accuracy"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="GLUE SST-2 folder (default: ../shared/data/sst2 if present)")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "bert" / "minilm.yaml"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["ours", "ours-random", "hf-dynamic", "hf-pad128"],
        choices=["ours", "ours-random", "hf-dynamic", "hf-pad128"],
        help="which of the four runs (default: all)",
    )
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model_config.n_embd=512")
    args = parser.parse_args()
    data_dir = args.data_dir or str(REPO.parent / "shared" / "data" / "sst2")
    out = REPO / "runs" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(
        args.recipe,
        [
            f"data_dir={data_dir}",
            f"max_steps={args.steps}",
            "batch_size=32",
            "tensor_parallel_degree=1",
            "export=false",
            f"output_dir={out / 'ours'}",
            "overwrite=true",
            "resume=none",
            "log_every=1000000",
            *args.overrides,
        ],
    )
    if config.precision == "auto":
        from parallel_finetune.precision import resolve_precision

        config.precision = resolve_precision("auto", torch.device("cpu"), "torch")
    prepared = data.prepare_for_config(config)
    results = {}
    random_batches = dataclasses.replace(config, group_by_length=False, output_dir=str(out / "ours-random"))
    for name, run in (
        ("ours", lambda: our_run(config)),
        ("ours-random", lambda: our_run(random_batches)),
        ("hf-dynamic", lambda: hf_run(config, prepared, False, out / "hf-dynamic")),
        ("hf-pad128", lambda: hf_run(config, prepared, True, out / "hf-pad128")),
    ):
        if name not in args.runs:
            continue
        started = time.perf_counter()
        results[name] = run()
        print(
            f"{name:12s} {results[name]['samples_per_s']:8.1f} samples/s  accuracy {results[name]['accuracy']:.4f}"
            f"  ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    pairs = [("ours", "hf-dynamic"), ("ours", "hf-pad128"), ("ours-random", "hf-dynamic")]
    ratios = {
        f"{a} / {b}": results[a]["samples_per_s"] / results[b]["samples_per_s"]
        for a, b in pairs
        if a in results and b in results
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.2f}x")
    setup = {
        "recipe": args.recipe,
        "model": config.model if config.size == "full" else f"tiny {config.family}",
        "overrides": args.overrides,
        "steps": config.max_steps,
        "batch_size": config.batch_size,
        "precision": config.precision,
        "threads": torch.get_num_threads(),
        "data": data_dir,
    }
    (out / "trainer_vs_hf.json").write_text(
        json.dumps({"setup": setup, "results": results, "ratios": ratios}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
