"""The recipes at the size users run them, on one GPU: `make bench-gpu` (CUDA only; nothing here runs on a CPU).

Rows of one table (tokens/s, MFU, peak GPU memory per run), written to runs/bench/gpu/gpu.json:
  varlen          packed attention: varlen flash attention (model/attention.py) against the dense 4-D mask, the
                  same packed batch through a Llama of Llama 3.2 1B's shape in bf16: largest logit difference
  ours-packed     instruction tuning of a Llama of Llama 3.2 1B's shape (random weights, 128,256 vocabulary, tied
                  embeddings) on 3,000 chat conversations of 1-3 turns (mean ~466 tokens), train_on=all,
                  max_length 2048, bf16 autocast over fp32 weights, activation checkpointing, packing=true
  ours-padded     the same rows padded and length-grouped (packing=false)
  trl-packed      TRL's SFTTrainer (its defaults, packing=True, gradient checkpointing, bf16) on the same rows,
                  model and batch; needs `trl` importable (a benchmark peer, never a dependency)
  ours-qlora      recipes/llama/qlora.yaml on a Llama of Llama 3.1 8B's shape (random weights), SST-2, batch 32 x
                  128, rank 16, activation checkpointing, bf16
  peft-qlora      the same model through peft + bitsandbytes' 4-bit layers (nf4, double quantization, bf16
                  compute), the same batch; needs `peft` and `bitsandbytes`
Pass `--runs` to choose; the machine has no network, so the wheels of TRL/bitsandbytes travel with the tree.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "bench" / "gpu"
RUNS = ("varlen", "ours-packed", "ours-padded", "trl-packed", "ours-qlora", "peft-qlora")


def llama_folder(name: str, published: str, tokenizer) -> Path:
    """A Llama of a published model's shape with random weights (bf16), and `tokenizer`, saved once."""
    import torch

    from parallel_finetune.families import published_model

    folder = OUT / name
    if (folder / "config.json").is_file():
        return folder
    family, hf_config = published_model(published)
    hf_config.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = family.hf_model("causal_lm", hf_config).to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def chat_rows(path: Path, count: int = 3000, seed: int = 0) -> Path:
    """`count` conversations of 1-3 turns built from SST-2 sentences, ~466 tokens on average (issue 47's rows)."""
    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.tasks.sources import SAMPLE_DIR

    if path.is_file():
        return path
    sentences = column(read_glue_dir(SAMPLE_DIR)["train"], "text")
    draw = random.Random(seed)

    def text(words: int) -> str:
        out = []
        while sum(len(s.split()) for s in out) < words:
            out.append(draw.choice(sentences))
        return " ".join(out)

    with path.open("w") as handle:
        for _ in range(count):
            messages = []
            for _ in range(draw.choice((1, 2, 3))):
                messages += [
                    {"role": "user", "content": "Say what this review feels: " + text(draw.randint(20, 120))},
                    {"role": "assistant", "content": text(draw.randint(40, 260))},
                ]
            handle.write(json.dumps({"messages": messages}) + "\n")
    return path


def summary_row(name: str, folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    return {
        "run": name,
        "tokens_per_s": summary["train_tokens_per_s"],
        "mfu": summary["mfu"],
        "peak_gib": max(summary["peak_memory_mib_per_rank"]) / 1024,
    }


def ours(name: str, recipe: str, overrides: list[str]) -> dict:
    folder = OUT / name
    command = [sys.executable, str(REPO / "scripts" / "train.py"), str(REPO / "recipes" / "llama" / recipe)]
    command += [*overrides, "tensor_parallel_degree=1", "export=false", f"output_dir={folder}", "overwrite=true"]
    subprocess.run(command, check=True, cwd=REPO)
    return summary_row(name, folder)


def varlen_row(model_dir: Path) -> dict:
    """The same packed batch through the dense mask and varlen attention: the largest logit difference."""
    import torch
    from transformers import AutoModelForCausalLM

    from parallel_finetune.data.batch import PackedBatcher, TokenizedSplit
    from parallel_finetune.data.packing import PackedShape
    from parallel_finetune.families import get_family
    from parallel_finetune.loop.loss import token_loss
    from parallel_finetune.loop.runner import WholeModel
    from parallel_finetune.model import attention
    from parallel_finetune.tasks.task import HeadKind

    attention.register()
    draw = random.Random(0)
    rows = [[draw.randrange(10, 8000) for _ in range(draw.randint(50, 900))] for _ in range(12)]
    split = TokenizedSplit(HeadKind.CAUSAL_LM, rows, [len(r) for r in rows], [len(r) - 1 for r in rows])
    device = torch.device("cuda")
    batch = PackedBatcher(split, pad_id=0, shape=PackedShape(capacity=2048), device=device).batch(range(len(rows)))
    logits = []
    for implementation in ("sdpa", attention.NAME):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.config._attn_implementation = implementation
        runner = WholeModel(model.to(device).eval(), HeadKind.CAUSAL_LM, token_loss, torch.no_grad, None, False,
                            device, packing=get_family("llama"))  # fmt: skip
        logits.append(runner.forward(batch).float())
        del model
    scale = logits[0].abs().max().item()
    return {"run": "varlen", "max_logit_difference": (logits[1] - logits[0]).abs().max().item(), "logit_scale": scale}


def trl_packed(model_dir: Path, rows: Path, args) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = SFTConfig(
        output_dir=str(OUT / "trl-packed"),
        packing=True,
        max_length=2048,
        per_device_train_batch_size=args.trl_batch,
        gradient_checkpointing=True,
        bf16=True,
        max_steps=args.steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=load_dataset("json", data_files=str(rows))["train"],
        processing_class=tokenizer,
    )  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    tokens = args.steps * args.trl_batch * 2048
    return {"run": "trl-packed", "tokens_per_s": tokens / seconds, "mfu": None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def peft_qlora(model_dir: Path, args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=2, quantization_config=quantization
    )
    model.config.pad_token_id = 0
    model.gradient_checkpointing_enable()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="SEQ_CLS"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    ids = torch.randint(10, 8000, (32, 128), device="cuda")
    labels = torch.randint(0, 2, (32,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    step = statistics.median(times[2:])
    return {"run": "peft-qlora", "tokens_per_s": 32 * 128 / step, "mfu": None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=24, help="ours: rows per step (~11k tokens)")
    parser.add_argument("--trl-batch", type=int, default=6, help="TRL: packed sequences of 2048 per step")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("error: make bench-gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    tokenizer = prepare_data(load_config(REPO / "recipes" / "llama" / "sft.yaml", ["size=tiny"])).tokenizer
    small = llama_folder("llama-1b", "meta-llama/Llama-3.2-1B", tokenizer)
    rows = chat_rows(OUT / "chat.jsonl")
    chat = [f"model={small}", "size=full", f"train_file={rows}", "train_on=all", "max_length=2048"]
    chat += [f"batch_size={args.batch_size}", f"max_steps={args.steps}", "activation_checkpointing=true"]
    chat += ["eval_every=null", "generate_every=0", "validation_split_percentage=2"]
    results = []
    for run in args.runs:
        if run == "varlen":
            results.append(varlen_row(small))
        elif run in ("ours-packed", "ours-padded"):
            packing = run == "ours-packed"
            extra = [f"packing={str(packing).lower()}", f"group_by_length={str(not packing).lower()}"]
            results.append(ours(run, "sft.yaml", chat + extra))
        elif run == "trl-packed":
            results.append(trl_packed(small, rows, args))
        elif run == "ours-qlora":
            large = llama_folder("llama-8b", "meta-llama/Llama-3.1-8B", tokenizer)
            sst2 = REPO.parent / "shared" / "data" / "sst2"
            overrides = [f"model={large}", "size=full", f"data_dir={sst2}", "batch_size=32", "max_length=128"]
            overrides += [f"max_steps={args.steps}", "activation_checkpointing=true", "eval_every=null"]
            results.append(ours(run, "qlora.yaml", overrides))
        elif run == "peft-qlora":
            results.append(peft_qlora(llama_folder("llama-8b", "meta-llama/Llama-3.1-8B", tokenizer), args))
        print(json.dumps(results[-1]), flush=True)
    (OUT / "gpu.json").write_text(json.dumps(results, indent=1))
    print(f"{'run':<12} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9}")
    for row in results:
        if "tokens_per_s" in row:
            mfu = "-" if row["mfu"] is None else f"{row['mfu']:.1%}"
            print(f"{row['run']:<12} {row['tokens_per_s']:>10.0f} {mfu:>7} {row['peak_gib']:>9.1f}")
        else:
            print(f"{row['run']:<12} varlen vs dense mask: largest logit difference {row['max_logit_difference']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
