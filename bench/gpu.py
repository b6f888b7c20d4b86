"""The GPU check: correctness of the CUDA-only paths first, then speed against the peers, on one GPU, offline.

    python bench/gpu.py [--out DIR] [--rows ...]     on a CUDA GPU (bench/gpu_check.sh installs the bundle first)
    python bench/gpu.py --dry-run                    the whole check on a CPU: tiny shapes, the kernels' strict
                                                     stand-ins (model/standins.py), peers skipped where absent

Each row runs in its own process; a row that fails is recorded as failed with its one-line reason and the table goes
on. After every row, DIR/gpu.json (every figure) and DIR/gpu.md (the table docs/benchmarks.md takes as is: GPU,
torch, commit, settings) are rewritten, and the row's output is appended to DIR/gpu.log.

Correctness (under 3 minutes on an H100/H200, so a short lease proves correctness before speed):
  setup           a Llama of Llama 3.2 1B's shape with random weights (bf16), the chat rows and SST-2 rows
  varlen-logits   one packed batch through the dense 4-D mask and through varlen attention: logits compared
  packed-steps    a few packed training steps (bf16 autocast over fp32 weights, activation checkpointing) with
                  varlen attention and with the dense mask: the losses compared step by step
  nf4-dequant     QLoRA's dequantization as training runs it (compiled on CUDA) against torchao's, bit for bit
Speed (steps after the warm-up steps, real tokens: the rows' own tokens, no padding, counted alike on every side):
  ours-packed     instruction tuning (train_on=all, packing, bf16 autocast, activation checkpointing)
  ours-padded     the same rows padded and length-grouped
  trl-packed      TRL's SFTTrainer on the same rows and model (packing, gradient checkpointing, bf16)
  ours-qlora      QLoRA (recipes/llama/qlora.yaml) on SST-2 rows, a classification head
  peft-qlora      peft + bitsandbytes (nf4, double quantization, bf16 compute) on the very batches ours trained
MFU counts 6 x parameters per token for full training and 4 x for a frozen base (its adapters and a trained head
6 x), plus 12 L d n^2 for attention (model/throughput.py), the same formula for ours and the peers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".gpu-bundle"
CORRECTNESS = ("setup", "varlen-logits", "packed-steps", "nf4-dequant")
SPEED = ("ours-packed", "ours-padded", "trl-packed", "ours-qlora", "peft-qlora")
ROWS = CORRECTNESS + SPEED
SKIPPED = 3  # a row's exit status for "skipped" (its reason on the last line)

# The shapes, steps and batches. GPU: sized so that the whole check fits one call of 10 minutes on an H100/H200
# (estimate ~6 min: ~1.5 min correctness, ~40-60 s per speed row, most of it process start and model load).
GPU = {
    "device": "cuda",
    "model": "meta-llama/Llama-3.2-1B",
    "chat_rows": 1000,
    "max_length": 2048,
    "batch_size": 24,  # rows per step: ~11k real tokens
    "trl_batch": 6,  # TRL: packed sequences of 2048 per step (~12k token slots)
    "steps": 12,
    "warmup": 3,
    "parity_steps": 4,
    "qlora_batch": 32,
    "qlora_length": 128,
    "nf4_block": 64,
    "nf4_scaler_block": 256,
    "row_timeout_s": 240,
}
# --dry-run: the same rows on a CPU in a few minutes (a 2-block Llama of the same class, short rows)
DRY = {
    "device": "cpu",
    "model": "tiny",
    "chat_rows": 120,
    "max_length": 256,
    "batch_size": 8,
    "trl_batch": 2,
    "steps": 5,
    "warmup": 2,
    "parity_steps": 3,
    "qlora_batch": 8,
    "qlora_length": 64,
    "nf4_block": 16,
    "nf4_scaler_block": 8,
    "row_timeout_s": 180,
}
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


class Skip(Exception):
    """The row cannot run here (a peer's package or CUDA absent): recorded as skipped with this reason."""


# ----------------------------------------------------------------------------------------------- the parent
def git_commit() -> str:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return (found.stdout.strip() or "unknown") + (" (modified)" if dirty else "")
    except OSError:
        return "unknown (no git)"


def machine() -> dict:
    """What the table's header says: device, torch, transformers, commit."""
    import torch

    info = {"torch": torch.__version__, "commit": git_commit(), "python": platform.python_version()}
    for name in ("transformers", "trl", "peft", "bitsandbytes", "torchao"):
        try:
            info[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: the table says so
            info[name] = "absent"
    if torch.cuda.is_available():
        info["device"] = f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    else:
        info["device"] = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    return info


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else "no output")[:300]


def run_row(name: str, settings_file: Path, out: Path, work: Path, timeout: float, log) -> dict:
    """One row in its own process: its result, or failed with its last output line (or the timeout)."""
    result_file = work / "results" / f"{name}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--row", name, "--settings", str(settings_file)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += f"\ntimed out after {timeout:.0f} s"
        code = None
    seconds = time.perf_counter() - started
    log.write(f"\n===== {name} (exit {code}, {seconds:.1f} s)\n{output}")
    log.flush()
    row = {"row": name, "section": "correctness" if name in CORRECTNESS else "speed", "seconds": round(seconds, 1)}
    if code == 0 and result_file.is_file():
        return row | {"status": "ok"} | json.loads(result_file.read_text())
    if code == SKIPPED:
        return row | {"status": "skipped", "reason": last_line(output)}
    return row | {"status": "failed", "reason": last_line(output)}


def percent(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def number(value, form: str = ",.0f") -> str:
    return "-" if value is None else format(value, form)


def markdown(info: dict, settings: dict, rows: list[dict], dry_run: bool, total: float) -> str:
    """The table docs/benchmarks.md takes as is."""
    title = "GPU check, dry run on a CPU with the kernels' stand-ins" if dry_run else "GPU check"
    versions = ", ".join(f"{k} {info[k]}" for k in ("transformers", "trl", "peft", "bitsandbytes", "torchao"))
    lines = [
        f"### {title}: {info['device']}",
        "",
        f"torch {info['torch']} (Python {info['python']}), {versions}; commit {info['commit']}; {total:.0f} s in all.",
        f"Settings: model {settings['model']} (random weights), chat rows {settings['chat_rows']} "
        f"(max_length {settings['max_length']}), {settings['steps']} steps of which the first {settings['warmup']} "
        f"are warm-up and not counted; ours {settings['batch_size']} rows a step, TRL {settings['trl_batch']} packed "
        f"sequences a step; QLoRA {settings['qlora_batch']} x {settings['qlora_length']} SST-2 rows, rank 16, "
        f"NF4 blocks {settings['nf4_block']}/{settings['nf4_scaler_block']}.",
        "MFU: 6 x parameters per token in full training, 4 x for a frozen base (adapters and a trained head 6 x), "
        "plus 12 L d n^2 attention; tokens are real tokens (no padding) of the steps after the warm-up.",
        "",
        "| correctness | status | result | s |",
        "| --- | --- | --- | ---: |",
    ]
    for row in rows:
        if row["section"] == "correctness":
            lines.append(f"| {row['row']} | {row['status']} | {row.get('summary') or row.get('reason', '')} | "
                         f"{row['seconds']:.0f} |")  # fmt: skip
    lines += [
        "",
        "| speed | status | steps | real tokens | tokens/s | MFU | peak GiB | s | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        if row["section"] != "speed":
            continue
        if row["status"] != "ok":
            lines.append(f"| {row['row']} | {row['status']} | | | | | | {row['seconds']:.0f} | {row['reason']} |")
            continue
        lines.append(
            f"| {row['row']} | ok | {row['steps']} | {number(row['tokens'])} | {number(row['tokens_per_s'])} | "
            f"{percent(row['mfu'])} | {number(row['peak_gib'], '.1f')} | {row['seconds']:.0f} | "
            f"{row.get('notes', '')} |"
        )
    return "\n".join(lines) + "\n"


def check(args) -> int:
    settings = dict(DRY if args.dry_run else GPU)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU; on a CPU run it with --dry-run", file=sys.stderr)
        return 2
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    settings |= {"work": str(work), "dry_run": args.dry_run}
    settings_file = work / "settings.json"
    settings_file.write_text(json.dumps(settings, indent=1))
    info = machine()
    started, rows = time.perf_counter(), []
    deadline = started + args.budget_s
    with (out / "gpu.log").open("w") as log:
        for name in args.rows:
            left = deadline - time.perf_counter()
            if left < 20:
                row = {"row": name, "section": "correctness" if name in CORRECTNESS else "speed", "seconds": 0.0}
                rows.append(row | {"status": "skipped", "reason": f"out of time (--budget-s {args.budget_s:.0f})"})
            else:
                rows.append(run_row(name, settings_file, out, work, min(settings["row_timeout_s"], left), log))
            row = rows[-1]
            said = row.get("summary") or row.get("reason") or f"{number(row.get('tokens_per_s'))} tokens/s"
            print(f"{name}: {row['status']} ({row['seconds']:.0f} s) {said}",
                  flush=True)  # fmt: skip
            total = time.perf_counter() - started
            table = markdown(info, settings, rows, args.dry_run, total)
            (out / "gpu.json").write_text(json.dumps({"machine": info, "settings": settings, "rows": rows}, indent=1))
            (out / "gpu.md").write_text(table)
    print("\n" + table)
    failed = [row["row"] for row in rows if row["status"] == "failed"]
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------- the rows
def load_settings(path: Path) -> dict:
    return json.loads(path.read_text())


def device(settings: dict):
    import torch

    return torch.device(settings["device"])


def folders(settings: dict) -> dict[str, Path]:
    work = Path(settings["work"])
    return {"model": work / "llama", "chat": work / "data" / "chat.jsonl", "sst2": work / "data" / "sst2"}


def chat_rows(path: Path, count: int, seed: int = 0, short: bool = False) -> Path:
    """`count` conversations of 1-3 turns built from SST-2 sentences (~466 tokens on average; `short`: ~100)."""
    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.tasks.sources import SAMPLE_DIR

    sentences = column(read_glue_dir(SAMPLE_DIR)["train"], "text")
    draw = random.Random(seed)
    scale = 0.2 if short else 1.0

    def text(words: int) -> str:
        out = []
        while sum(len(s.split()) for s in out) < words * scale:
            out.append(draw.choice(sentences))
        return " ".join(out)

    path.parent.mkdir(parents=True, exist_ok=True)
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


def tokenizer_for_runs():
    """The tokenizer our chat recipe's tiny size trains (offline); saved with the model so every side shares it."""
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    return prepare_data(load_config(REPO / "recipes" / "llama" / "sft.yaml", ["size=tiny"])).tokenizer


def row_setup(settings: dict) -> dict:
    """The model folder and the data every later row reads (the bundle's data when it came along)."""
    import torch

    from parallel_finetune.families import get_family, published_model
    from parallel_finetune.tasks.sources import SAMPLE_DIR

    where = folders(settings)
    tokenizer = tokenizer_for_runs()
    if settings["model"] == "tiny":
        family = get_family("llama")
        hf_config = family.hf_config(None, "tiny", len(tokenizer), settings["max_length"], {})
        for key, value in TINY_LLAMA.items():
            setattr(hf_config, key, value)
    else:
        family, hf_config = published_model(settings["model"])
    hf_config.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    with device(settings):
        model = family.hf_model("causal_lm", hf_config).to(torch.bfloat16)
    shutil.rmtree(where["model"], ignore_errors=True)
    model.save_pretrained(where["model"])
    tokenizer.save_pretrained(where["model"])
    parameters = sum(p.numel() for p in model.parameters())
    bundled = BUNDLE / "data"
    if (bundled / "chat.jsonl").is_file() and not settings["dry_run"]:
        where["chat"].parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bundled / "chat.jsonl", where["chat"])
        chat_from = "the bundle"
    else:
        chat_rows(where["chat"], settings["chat_rows"], short=settings["dry_run"])
        chat_from = "made here"
    shutil.rmtree(where["sst2"], ignore_errors=True)
    sst2_from = bundled / "sst2" if (bundled / "sst2" / "train.tsv").is_file() else SAMPLE_DIR
    where["sst2"].mkdir(parents=True)
    for split in ("train.tsv", "dev.tsv"):
        shutil.copy(sst2_from / split, where["sst2"] / split)
    rows = sum(1 for _ in (where["sst2"] / "train.tsv").open()) - 1
    source = "the bundle" if sst2_from != SAMPLE_DIR else "the package's sample"
    return {"summary": f"{parameters / 1e6:.1f}M-parameter Llama; chat rows {chat_from}; {rows} SST-2 rows from "
                       f"{source}"}  # fmt: skip


def row_varlen_logits(settings: dict) -> dict:
    """The same packed batch through the dense mask and varlen attention: the largest logit difference against
    the logits' scale (bf16: within a few hundredths of it)."""
    import torch
    from transformers import AutoModelForCausalLM

    from parallel_finetune.data.batch import PackedBatcher, TokenizedSplit
    from parallel_finetune.data.packing import PackedShape
    from parallel_finetune.families import get_family
    from parallel_finetune.loop.loss import TOKEN_OBJECTIVE
    from parallel_finetune.loop.runner import WholeModel
    from parallel_finetune.model import attention
    from parallel_finetune.tasks.task import HeadKind

    attention.register()
    on = device(settings)
    capacity = settings["max_length"]
    draw = random.Random(0)
    longest = capacity * 7 // 16
    rows = [[draw.randrange(10, 500) for _ in range(draw.randint(capacity // 40, longest))] for _ in range(12)]
    split = TokenizedSplit(HeadKind.CAUSAL_LM, rows, [len(r) for r in rows], [len(r) - 1 for r in rows])
    batch = PackedBatcher(split, pad_id=0, shape=PackedShape(capacity=capacity), device=on).batch(range(len(rows)))
    family = get_family("llama")
    logits = []
    for implementation in ("sdpa", attention.NAME):
        model = AutoModelForCausalLM.from_pretrained(folders(settings)["model"], dtype=torch.bfloat16,
                                                     attn_implementation="sdpa")  # fmt: skip
        model.config._attn_implementation = implementation
        runner = WholeModel(model.to(on).eval(), HeadKind.CAUSAL_LM, TOKEN_OBJECTIVE, contextlib.nullcontext, None,
                            False, on, packing=family)  # fmt: skip
        with torch.no_grad():
            logits.append(runner.forward(batch).float())
        del model
    scale = logits[0].abs().max().item()
    worst = (logits[1] - logits[0]).abs().max().item()
    ratio = worst / scale
    summary = f"{batch.rows} packed sequences of {len(rows)} rows: largest logit difference {worst:.3g} ({ratio:.2%} "
    summary += "of the largest logit)"
    if not ratio < 0.05:  # bf16: each of 2 x layers attention outputs rounded to 8 bits, ~1% drift at most seen
        raise AssertionError(summary + ", over 5%")
    return {"summary": summary, "max_logit_difference": worst, "logit_scale": scale}


def our_overrides(settings: dict, name: str, steps: int, packing: bool) -> list[str]:
    where = folders(settings)
    overrides = [f"model={where['model']}", "size=full", f"train_file={where['chat']}", "train_on=all"]
    overrides += [f"max_length={settings['max_length']}", f"batch_size={settings['batch_size']}"]
    overrides += [f"max_steps={steps}", "activation_checkpointing=true", "eval_every=null", "generate_every=0"]
    overrides += ["validation_split_percentage=2", "log_every=1", "precision=bf16"]
    overrides += [f"packing={str(packing).lower()}", f"group_by_length={str(not packing).lower()}"]
    return overrides + common_overrides(settings, name)


def common_overrides(settings: dict, name: str) -> list[str]:
    folder = Path(settings["work"]) / "runs" / name
    return ["tensor_parallel_degree=1", "export=false", f"output_dir={folder}", "overwrite=true",
            f"cache_dir={Path(settings['work']) / 'cache'}"]  # fmt: skip


def train(settings: dict, recipe: str, overrides: list[str], dense: bool = False) -> Path:
    """Our training run in a process of its own (scripts/train.py; `dense`: packed batches keep the dense mask),
    the kernels' stand-ins in a dry run. Its run folder."""
    command = [sys.executable, str(Path(__file__).resolve()), "--train"] + (["--dense"] if dense else [])
    command += [str(REPO / "recipes" / "llama" / recipe), *overrides]
    env = dict(os.environ)
    if settings["dry_run"]:
        env["PARALLEL_FINETUNE_KERNEL_STANDINS"] = "1"
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    print(done.stdout[-4000:] + done.stderr[-4000:], flush=True)
    if done.returncode:
        raise RuntimeError(f"training ({recipe}) exited {done.returncode}: {last_line(done.stdout + done.stderr)}")
    folder = next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir="))
    return Path(folder)


def train_entry(argv: list[str]) -> int:
    """`--train [--dense] RECIPE overrides`: scripts/train.py in this process; `--dense` keeps packed batches on the
    dense 4-D mask (the reference packed-steps compares varlen attention with)."""
    from parallel_finetune import train as entry
    from parallel_finetune.model import attention

    if argv and argv[0] == "--dense":
        argv = argv[1:]
        attention.varlen_unavailable = lambda *args, **kwargs: "the GPU check's dense-mask reference"
    return entry.main(argv)


def step_records(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "step_time_s" in r]


def measured(records: list[dict], warmup: int, summary: dict) -> dict:
    """Steps after the warm-up: their real tokens over their time, their model FLOPs' MFU."""
    kept = records[warmup:]
    if not kept:
        raise RuntimeError(f"{len(records)} steps recorded, none after the {warmup} warm-up steps")
    seconds = sum(r["step_time_s"] for r in kept)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in kept)
    tflops = sum(r["tflops_per_device"] * r["step_time_s"] for r in kept) / seconds
    peak = summary.get("peak_tflops_per_device")
    return {
        "steps": len(kept),
        "tokens": round(tokens),
        "step_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": tflops,
        "mfu": tflops / peak if peak and tflops <= peak else None,
        "peak_tflops": peak,
        "peak_gib": max(summary["peak_memory_mib_per_rank"]) / 1024,
    }


def row_packed_steps(settings: dict) -> dict:
    """A few packed steps with varlen attention and with the dense mask: the same losses within bf16's rounding."""
    steps = settings["parity_steps"]
    losses = {}
    for dense in (False, True):
        name = "parity-dense" if dense else "parity-varlen"
        folder = train(settings, "sft.yaml", our_overrides(settings, name, steps, packing=True), dense=dense)
        log = (folder / "train.log").read_text() if (folder / "train.log").is_file() else ""
        losses[dense] = [r["loss"] for r in step_records(folder)]
        if not dense and log and "varlen attention over each packed row" not in log:
            raise AssertionError("the varlen run did not take varlen attention (train.log says why)")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[False], losses[True]))
    summary = f"{steps} steps, losses varlen {losses[False][0]:.4f}..{losses[False][-1]:.4f}, dense mask "
    summary += f"{losses[True][0]:.4f}..{losses[True][-1]:.4f}: largest relative difference {worst:.2e}"
    if len(losses[False]) != steps or not worst < 2e-2:  # bf16 autocast: 1e-2 a step, drifting a little after
        raise AssertionError(summary + " (over 2e-2, or steps missing)")
    return {"summary": summary, "losses_varlen": losses[False], "losses_dense": losses[True]}


def row_nf4(settings: dict) -> dict:
    """QLoRA's dequantization as a training step runs it on this device (quantize.original_weight: compiled on
    CUDA, eager on a CPU) against torchao's get_original_weight, bit for bit, on the 1B shape's weights."""
    import torch

    from parallel_finetune.model import quantize

    on = device(settings)
    nf4_class = quantize.torchao_nf4()  # torchao's nf4_tensor module
    shapes = [(2048, 2048), (512, 2048), (8192, 2048)] if settings["model"] != "tiny" else [(64, 64), (32, 64)]
    worst, differing, compiled = 0.0, 0, on.type == "cuda"
    torch.manual_seed(0)
    for shape in shapes:
        weight = (torch.randn(shape, device=on) * 0.02).to(torch.bfloat16)
        nf4 = nf4_class.NF4Tensor.from_tensor(weight, settings["nf4_block"], settings["nf4_scaler_block"])
        for _ in range(2):  # twice: the second call reuses the compiled graph
            ours, theirs = quantize.original_weight(nf4), nf4.get_original_weight()
        differing += int((ours != theirs).sum())
        worst = max(worst, (ours.float() - theirs.float()).abs().max().item())
    how = "compiled" if compiled else "eager (a CPU)"
    summary = f"{how} dequantization vs torchao on {len(shapes)} weight shapes: {differing} elements differ, "
    summary += f"largest difference {worst:.3g}"
    if differing:
        raise AssertionError(summary)
    return {"summary": summary, "differing": differing}


def row_ours(settings: dict, name: str) -> dict:
    packing = name == "ours-packed"
    overrides = our_overrides(settings, name, settings["steps"], packing=packing)
    folder = train(settings, "sft.yaml", overrides)
    summary = json.loads((folder / "summary.json").read_text())
    notes = "packed" + (f", packing efficiency {summary['packing_efficiency']:.0%}" if packing else "")
    if not packing:
        notes = f"padded, length-grouped, padding {summary['padding_fraction']:.0%}"
    return measured(step_records(folder), settings["warmup"], summary) | {"notes": notes}


def our_flops(model_dir: Path, head: str):
    """Our ModelFlops of the model in `model_dir` (built on meta): the formula every side's MFU uses."""
    import torch
    from transformers import AutoConfig

    from parallel_finetune.families import get_family
    from parallel_finetune.model.throughput import attention_width, model_flops
    from parallel_finetune.parallel.pipeline import stage_costs

    family = get_family("llama")
    config = AutoConfig.from_pretrained(model_dir)
    if head == "classification":
        config.num_labels = 2
    with torch.device("meta"):
        model = family.hf_model(head, config)
    return model_flops(*stage_costs(model, family), attention_width(config))


def peak_tflops() -> float | None:
    import torch

    from parallel_finetune.model.throughput import gpu_peak_tflops

    return gpu_peak_tflops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def speed_figures(steps: int, tokens: int, seconds: float, model_flops: float) -> dict:
    """A speed row's figures, counted alike for every side: the counted steps (warm-up excluded), their real
    tokens, seconds and model FLOPs (the MFU convention of model/throughput.py), and the GPU's peak memory."""
    import torch

    peak = peak_tflops()
    tflops = model_flops / seconds / 1e12
    return {
        "steps": steps,
        "tokens": tokens,
        "step_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_tflops": peak,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def timed_steps(step, batches, warmup: int, flops) -> dict:
    """Run `step(batch)` over `batches` (each: (inputs, real token count, sequence lengths)); count the steps after
    `warmup` as ours are counted: wall time of each step after a device sync, real tokens, model FLOPs."""
    import torch

    torch.cuda.reset_peak_memory_stats()
    seconds = tokens = model_flops = 0.0
    for number, (inputs, real, lengths) in enumerate(batches):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step(inputs)
        torch.cuda.synchronize()
        if number >= warmup:
            seconds += time.perf_counter() - started
            tokens += real
            model_flops += flops.batch(lengths)
    return speed_figures(len(batches) - warmup, round(tokens), seconds, model_flops)


def row_trl(settings: dict) -> dict:
    """TRL's SFTTrainer on the same chat rows and model: its packing and collator, our count of its steps (the
    trainer's own loop, each step timed by a callback after a device sync; real tokens of what its collator made)."""
    import torch

    try:
        import trl
        from trl import SFTConfig, SFTTrainer
    except ImportError as exc:
        raise Skip(f"TRL is not importable ({exc}); bench/gpu_check.sh installs it from the bundle") from None
    if not torch.cuda.is_available():
        raise Skip("TRL's row runs on CUDA only (bf16 training at this size)")
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    where = folders(settings)
    flops = our_flops(where["model"], "causal_lm")
    tokenizer = AutoTokenizer.from_pretrained(where["model"])
    model = AutoModelForCausalLM.from_pretrained(where["model"], dtype=torch.float32)
    config = SFTConfig(
        output_dir=str(Path(settings["work"]) / "runs" / "trl-packed"), packing=True,
        max_length=settings["max_length"], per_device_train_batch_size=settings["trl_batch"],
        gradient_checkpointing=True, bf16=True, max_steps=settings["steps"], logging_steps=1, report_to=[],
        save_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    counted: list[tuple[int, list[int]]] = []

    def real_tokens(batch) -> tuple[int, list[int]]:
        """Real tokens and sequence lengths of a collated batch: packed rows by their position_ids' restarts,
        padded rows by their attention mask."""
        if "position_ids" in batch:
            lengths = []
            for positions in batch["position_ids"].tolist():
                starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
                lengths += [b - a for a, b in zip(starts, starts[1:])]
            if "attention_mask" in batch:  # padding after the last row, if any
                padding = int(batch["attention_mask"].numel() - batch["attention_mask"].sum())
                lengths[-1] -= padding
            return sum(lengths), lengths
        mask = batch["attention_mask"]
        lengths = mask.sum(-1).tolist()
        return int(mask.sum()), lengths

    class Counting:
        def __init__(self, collator):
            self.collator = collator

        def __call__(self, examples):
            batch = self.collator(examples)
            counted.append(real_tokens(batch))
            return batch

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.started)

    dataset = load_dataset("json", data_files=str(where["chat"]))["train"]
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[Timer()])  # fmt: skip
    trainer.data_collator = Counting(trainer.data_collator)
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    warmup = settings["warmup"]
    if len(times) != settings["steps"] or len(counted) < settings["steps"]:
        raise RuntimeError(f"TRL ran {len(times)} steps and collated {len(counted)} batches of {settings['steps']}")
    kept = counted[warmup : settings["steps"]]  # the dataloader may collate one batch ahead
    seconds = sum(times[warmup:])
    tokens = sum(real for real, _ in kept)
    model_flops = sum(flops.batch(lengths) for _, lengths in kept)
    figures = speed_figures(len(times) - warmup, tokens, seconds, model_flops)
    figures["notes"] = (
        f"TRL {trl.__version__}, packing, {settings['trl_batch']} x {settings['max_length']} slots a step"
    )
    return figures


def qlora_overrides(settings: dict, name: str) -> list[str]:
    where = folders(settings)
    overrides = [f"model={where['model']}", "size=full", f"data_dir={where['sst2']}"]
    overrides += [f"batch_size={settings['qlora_batch']}", f"max_length={settings['qlora_length']}"]
    overrides += [f"max_steps={settings['steps']}", "activation_checkpointing=true", "eval_every=null", "log_every=1"]
    overrides += [f"nf4_block_size={settings['nf4_block']}", f"nf4_scaler_block_size={settings['nf4_scaler_block']}"]
    overrides += ["precision=bf16"]
    return overrides + common_overrides(settings, name)


def row_ours_qlora(settings: dict) -> dict:
    folder = train(settings, "qlora.yaml", qlora_overrides(settings, "ours-qlora"))
    summary = json.loads((folder / "summary.json").read_text())
    padding = f"padding {summary['padding_fraction']:.0%}"
    return measured(step_records(folder), settings["warmup"], summary) | {"notes": f"torchao NF4, rank 16, {padding}"}


def row_peft_qlora(settings: dict) -> dict:
    """peft + bitsandbytes on the very batches ours-qlora trained: our data pipeline's rows, its sampler's order,
    padded to each batch's longest row as ours are; the same steps counted the same way."""
    import torch

    try:
        import bitsandbytes  # noqa: F401
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise Skip(
            f"peft/bitsandbytes not importable ({exc}); bench/gpu_check.sh installs them from the bundle"
        ) from None
    if not torch.cuda.is_available():
        raise Skip("bitsandbytes' 4-bit layers need CUDA")
    from transformers import AutoConfig, AutoModelForSequenceClassification, BitsAndBytesConfig

    from parallel_finetune.data.batch import TokenizedSplit
    from parallel_finetune.data.sampling import GlobalBatches
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    config = load_config(REPO / "recipes" / "llama" / "qlora.yaml", qlora_overrides(settings, "peft-qlora"))
    prepared = prepare_data(config)
    split = TokenizedSplit.of(prepared.splits["train"], prepared.task)
    sampler = GlobalBatches(split.lengths, config.training.batch_size, config.training.seed,
                            config.data.group_by_length)  # fmt: skip
    order = [b for epoch in range(settings["steps"] // max(1, len(sampler)) + 1) for b in sampler.epoch(epoch)]
    pad = prepared.tokenizer.pad_token_id or 0
    batches = []
    for indices in order[: settings["steps"]]:
        longest = max(split.lengths[i] for i in indices)
        ids = torch.full((len(indices), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(indices):
            ids[row, : split.lengths[i]] = torch.tensor(split.ids[i])
            mask[row, : split.lengths[i]] = 1
        labels = torch.tensor([split.labels[i] for i in indices])
        inputs = {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": labels.cuda()}
        batches.append((inputs, int(mask.sum()), [split.lengths[i] for i in indices]))
    where = folders(settings)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    model = AutoModelForSequenceClassification.from_pretrained(where["model"], num_labels=2,
                                                               quantization_config=quantization)  # fmt: skip
    model.config.pad_token_id = pad
    model.gradient_checkpointing_enable()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets,
                                             task_type="SEQ_CLS"))  # fmt: skip
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    full = our_flops(where["model"], "classification")
    # the score head is trained in full (peft's modules_to_save for SEQ_CLS), as ours: 6 x; the rest frozen: 4 x
    score = 2 * AutoConfig.from_pretrained(where["model"]).hidden_size
    flops = full.with_adapters(full.matmul_params - score, adapters)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)

    def step(inputs):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    result = timed_steps(step, batches, settings["warmup"], flops)
    return result | {"notes": "bitsandbytes nf4 + double quantization, rank 16, our batches"}


ROW_FUNCTIONS = {
    "setup": row_setup,
    "varlen-logits": row_varlen_logits,
    "packed-steps": row_packed_steps,
    "nf4-dequant": row_nf4,
    "ours-packed": lambda s: row_ours(s, "ours-packed"),
    "ours-padded": lambda s: row_ours(s, "ours-padded"),
    "trl-packed": row_trl,
    "ours-qlora": row_ours_qlora,
    "peft-qlora": row_peft_qlora,
}


def row_entry(name: str, settings_file: Path) -> int:
    """One row, in this process: its result file, or exit SKIPPED with the reason last (a failure: its traceback,
    then the one line the table shows)."""
    settings = load_settings(settings_file)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    needs = {"setup": (), "peft-qlora": ("setup",)}.get(name, ("setup",))
    for needed in needs:
        if not (Path(settings["work"]) / "results" / f"{needed}.json").is_file():
            print(f"needs the {needed} row, which did not succeed in this check", file=sys.stderr)
            return 1
    standins = contextlib.nullcontext()
    if settings["dry_run"] and name == "varlen-logits":
        from parallel_finetune.model import standins as module

        standins = module.install()
    try:
        with standins:
            result = ROW_FUNCTIONS[name](settings)
    except Skip as exc:
        print(exc)
        return SKIPPED
    except Exception as exc:  # noqa: BLE001 - the row's failure is the table's line; the traceback goes to the log
        import traceback

        traceback.print_exc()
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 1
    (Path(settings["work"]) / "results" / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--train"]:
        return train_entry(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: tiny shapes, the kernels' stand-ins")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--out", default=str(REPO / "runs" / "bench" / "gpu"), help="gpu.json, gpu.md, gpu.log")
    parser.add_argument("--work", default=None, help="models, data and runs (default runs/bench/gpu-work)")
    parser.add_argument("--budget-s", type=float, default=570.0, help="rows not started by then are skipped")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        return row_entry(args.row, Path(args.settings))
    args.work = args.work or str(REPO / "runs" / "bench" / "gpu-work")
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
