"""Packed vs padded batches: instruction tuning of a small Llama (ours padded, ours packed, TRL's SFTTrainer) and
MiniLM classification on SST-2 (ours length-grouped vs packed), each run its own process, one after another.

`make bench-sft` (creates .venv-trl: trl installed with --no-deps beside .venv's packages, so TRL is a benchmark
peer only, never a dependency of the package). Runs (`--runs`):
  ours-grouped      task=sft, rows padded to the longest of their batch, group_by_length=true (today's best unpacked)
  ours-packed       the same rows per step, packing=true (first-fit decreasing into max_length sequences)
  ours-random       padded, group_by_length=false (random batches: where packing has the most padding to remove)
  trl-padded        TRL's SFTTrainer, its padding collator, the same batches in the same order as ours
  trl-padding-free  TRL's SFTTrainer, padding_free=True (a batch's rows flattened into one sequence with
                    position_ids), the same batches
  minilm-grouped    the real all-MiniLM-L6-v2 (recipes/bert/minilm.yaml) on SST-2, length-grouped padded batches
  minilm-packed     the same with packing=true
  minilm-packed-random  packing=true with group_by_length=false
The chat runs share one starting point: a Llama of `--hidden/--layers/--heads` initialised from `--seed` and saved
with save_pretrained, with the tokenizer learned from the shipped chat sample (ChatML template, written beside the
weights); every chat run loads that folder (ours: model=<folder>). Same rows (the shipped chat sample's 400
conversations, every token trained: train_on=all, TRL's default for `messages` rows), same tokens (checked row by
row), same max_length, batch, lr schedule, steps, fp32, threads. TRL's sampler is replaced by ours, so both see the
same batches in the same order and their losses compare step by step (step 1: same weights, same batch).
Trained tokens per second = target tokens (each row's length - 1) / training seconds (ours: the `train` phase;
TRL: train_runtime). Held-out loss: one evaluator (sum of token losses / tokens over the 60 validation
conversations) applied to every run's saved model. MiniLM: samples/s, tokens/s and dev accuracy after the steps.

The machine must be idle: the CPU time used by other processes is measured (/proc/stat minus this benchmark's own)
before and during each run; above `--max-foreign` of the machine the figures are marked NOT VALID and the exit
code is 3 (refused at the start unless `--allow-shared`, which only serves to check that the script works).
Writes runs/bench/sft_packing.json.
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

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "bench" / "sft-packing"
CHAT_RUNS = {
    "ours-grouped": ["group_by_length=true", "packing=false"],
    "ours-packed": ["group_by_length=true", "packing=true"],
    "ours-random": ["group_by_length=false", "packing=false"],
}
TRL_RUNS = {"trl-padded": False, "trl-padding-free": True}  # name -> padding_free
MINILM_RUNS = {
    "minilm-grouped": ["group_by_length=true", "packing=false"],
    "minilm-packed": ["group_by_length=true", "packing=true"],
    "minilm-packed-random": ["group_by_length=false", "packing=true"],
}
DEFAULT_RUNS = ["ours-grouped", "ours-packed", "trl-padded", "trl-padding-free", "minilm-grouped", "minilm-packed"]


# ----------------------------------------------------------------------------------- is the machine ours alone?
def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (steal included: a hypervisor's other guests), or None where
    /proc/stat is missing."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process and its finished children."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class ForeignLoad:
    """The share of the machine's CPU capacity other processes used between `start` and `stop`."""

    def start(self) -> None:
        self.busy, self.own, self.wall = busy_seconds(), own_seconds(), time.perf_counter()

    def stop(self) -> float:
        busy, own, wall = busy_seconds(), own_seconds(), time.perf_counter()
        if busy is None or self.busy is None:  # no /proc/stat: the load average is all there is
            return max(0.0, os.getloadavg()[0] - 1) / os.cpu_count()
        foreign = (busy - self.busy) - (own - self.own)
        return max(0.0, foreign) / ((wall - self.wall) * os.cpu_count())


def probe_foreign_load(seconds: float) -> float:
    load = ForeignLoad()
    load.start()
    time.sleep(seconds)
    return load.stop()


# ----------------------------------------------------------------------------------- the chat runs' common start
def chat_overrides(args, init: Path, name: str) -> list[str]:
    return [
        f"model={init}",
        "size=full",
        "task=sft",
        "train_on=all",
        f"max_length={args.max_length}",
        f"batch_size={args.batch_size}",
        f"max_steps={args.steps}",
        f"lr={args.lr}",
        f"warmup_ratio={args.warmup_ratio}",
        "lr_scheduler=linear",
        f"weight_decay={args.weight_decay}",
        "max_grad_norm=1.0",
        "precision=fp32",
        f"seed={args.seed}",
        "tensor_parallel_degree=1",
        "eval_every=null",
        "log_every=1000000",
        "resume=none",
        f"output_dir={OUT / name}",
        "overwrite=true",
    ]


def write_start(args) -> dict:
    """The chat runs' shared starting point: the initial Llama and its tokenizer in OUT/init, and spec.json (rows,
    token ids, the batches of every step) for the TRL worker, which does not import this package."""
    import torch

    from parallel_finetune.data.sampling import GlobalBatches
    from parallel_finetune.families import get_family
    from parallel_finetune.families.base import tiny_vocab_size
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    init = OUT / "init"
    tiny = load_config(
        REPO / "recipes" / "llama" / "tp.yaml",
        ["size=tiny", *chat_overrides(args, init, "tokenizer")[2:]],
    )
    tokenizer = prepare_data(tiny).tokenizer  # learned from the chat sample, ChatML's control tokens special
    family = get_family("llama")
    hf_config = family.sized_config(
        tiny_vocab_size(len(tokenizer)), max(args.max_length, 128), args.hidden, args.layers, args.heads
    )
    hf_config.pad_token_id = tokenizer.pad_token_id
    hf_config.bos_token_id = hf_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(args.seed)
    model = family.hf_model("causal_lm", hf_config)
    model.save_pretrained(init)
    tokenizer.save_pretrained(init)
    # What our runs will train on: the data as a run from that folder prepares it (its tokenizer, the sample).
    config = load_config(REPO / "recipes" / "llama" / "tp.yaml", chat_overrides(args, init, "ours-grouped"))
    prepared = prepare_data(config)
    train, validation = prepared.splits["train"], prepared.splits["validation"]
    lengths = list(train["length"])
    spec = {
        "init": str(init),
        "train_file": str(prepared_file("train")),
        "validation_file": str(prepared_file("validation")),
        "train_ids": list(train["input_ids"]),
        "validation_ids": list(validation["input_ids"]),
        "lengths": lengths,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    for group_by_length in (True, False):
        batches = GlobalBatches(lengths, args.batch_size, args.seed, group_by_length)
        epochs = math.ceil(args.steps / len(batches))
        spec[f"batches_grouped_{group_by_length}"] = [b for e in range(epochs) for b in batches.epoch(e)][: args.steps]
    (OUT / "spec.json").write_text(json.dumps(spec))
    return spec


def prepared_file(split: str) -> Path:
    from parallel_finetune.tasks.sources import CHAT_SAMPLE_DIR

    return CHAT_SAMPLE_DIR / f"{split}.jsonl"


def heldout_loss(model_dir: str, validation_ids: list[list[int]], batch_size: int = 16) -> float:
    """Sum of the next-token losses over every validation token / their count: the same evaluator for every run's
    saved model (each row alone in its padded slot; the padding is never scored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(validation_ids), batch_size):
            rows = validation_ids[start : start + batch_size]
            longest = max(len(r) for r in rows)
            ids = torch.tensor([r + [0] * (longest - len(r)) for r in rows])
            mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            targets = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            loss = torch.nn.functional.cross_entropy(
                logits.transpose(1, 2), targets, reduction="sum", ignore_index=-100
            )
            total, count = total + loss.item(), count + int((targets != -100).sum())
    return total / count


# ----------------------------------------------------------------------------------- workers (one per process)
def ours_chat_worker(name: str, args) -> dict:
    from parallel_finetune.loop.run import run
    from parallel_finetune.resolve import load_config

    spec = json.loads((OUT / "spec.json").read_text())
    config = load_config(
        REPO / "recipes" / "llama" / "tp.yaml", [*chat_overrides(args, Path(spec["init"]), name), *CHAT_RUNS[name]]
    )
    summary = run(config)
    steps = [json.loads(line) for line in (OUT / name / "metrics.jsonl").read_text().splitlines()]
    grouped = config.group_by_length
    batches = spec[f"batches_grouped_{grouped}"]
    lengths = spec["lengths"]
    # the batches the trainer drew are the ones TRL is given: each step's token count must match
    for number, (record, batch) in enumerate(zip(steps, batches), start=1):
        expected = sum(lengths[i] for i in batch)
        if abs(record["tokens_per_s"] * record["step_time_s"] - expected) > 0.01 * expected:
            raise SystemExit(f"{name}: step {number} trained other rows than the batches given to TRL")
    return {
        "train_seconds": summary["seconds"]["train"],
        "losses": [record["loss"] for record in steps],
        "trained_tokens": sum(lengths[i] - 1 for batch in batches for i in batch),
        "real_tokens": sum(lengths[i] for batch in batches for i in batch),
        "slot_efficiency": 1 - summary["padding_fraction"],
        "model_dir": str(OUT / name / "hf"),
        "batches": batches,
    }


def trl_worker(name: str, args) -> dict:
    """TRL's SFTTrainer with the same start, rows, batches (our order, through its sampler) and schedule. Runs in
    the TRL venv: imports trl, transformers, torch and datasets only."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    spec = json.loads((OUT / "spec.json").read_text())
    batches = spec["batches_grouped_True"]
    order = [i for batch in batches for i in batch]

    class OurBatches(torch.utils.data.Sampler):
        def __len__(self):
            return len(order)

        def __iter__(self):
            return iter(order)

    class SameBatchesTrainer(SFTTrainer):
        def _get_train_sampler(self, *unused, **unused_too):
            return OurBatches()

    padding_free = TRL_RUNS[name]
    tokenizer = AutoTokenizer.from_pretrained(spec["init"])
    model = AutoModelForCausalLM.from_pretrained(spec["init"], dtype=torch.float32, attn_implementation="sdpa")
    sft_config = SFTConfig(
        output_dir=str(OUT / name),
        # padding-free without packing does not truncate: every row is shorter than max_length (checked below)
        max_length=None if padding_free else args.max_length,
        padding_free=padding_free,
        packing=False,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="linear",
        warmup_steps=math.ceil(args.warmup_ratio * args.steps),
        weight_decay=args.weight_decay,
        max_grad_norm=1.0,
        bf16=False,
        fp16=False,
        use_cpu=True,
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    assert max(spec["lengths"]) <= args.max_length, "rows longer than max_length: padding-free would not cut them"
    train = load_dataset("json", data_files=spec["train_file"], split="train")
    trainer = SameBatchesTrainer(model=model, args=sft_config, train_dataset=train, processing_class=tokenizer)
    mismatched = [i for i, ids in enumerate(trainer.train_dataset["input_ids"]) if ids != spec["train_ids"][i]]
    if mismatched:
        raise SystemExit(
            f"{name}: TRL tokenized {len(mismatched)} row(s) differently from ours, e.g. row {mismatched[0]}"
        )
    cross_row = attends_across_rows(model, spec, batches[0]) if padding_free else None
    metrics = trainer.train().metrics
    trainer.save_model(str(OUT / name / "hf"))
    lengths = spec["lengths"]
    slots = [sum(lengths[i] for i in b) if padding_free else len(b) * max(lengths[i] for i in b) for b in batches]
    return {
        "train_seconds": metrics["train_runtime"],
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "trained_tokens": sum(lengths[i] - 1 for batch in batches for i in batch),
        "real_tokens": sum(lengths[i] for batch in batches for i in batch),
        "slot_efficiency": sum(lengths[i] for b in batches for i in b) / sum(slots),
        "model_dir": str(OUT / name / "hf"),
        "cross_row_attention": cross_row,
        "batches": batches,
    }


def attends_across_rows(model, spec: dict, batch: list[int]) -> float:
    """Largest difference between each row's logits alone and inside one flattened padding-free sequence
    (position_ids restarting, no attention mask), as TRL's padding-free collator feeds the model: 0 when the
    attention keeps rows apart (transformers' sdpa mask reads the restarting positions), large when it does not."""
    import torch

    rows = [spec["train_ids"][i] for i in batch]
    with torch.no_grad():
        flat = torch.tensor([sum(rows, [])])
        positions = torch.tensor([[p for r in rows for p in range(len(r))]])
        together = model(input_ids=flat, position_ids=positions).logits[0]
        alone = torch.cat([model(input_ids=torch.tensor([r])).logits[0] for r in rows])
    return float((together - alone).abs().max())


def minilm_worker(name: str, args) -> dict:
    from parallel_finetune.loop.run import run
    from parallel_finetune.resolve import load_config

    config = load_config(
        REPO / "recipes" / "bert" / "minilm.yaml",
        [
            f"data_dir={args.data_dir}",
            f"max_steps={args.minilm_steps}",
            "batch_size=32",
            "precision=fp32",
            "tensor_parallel_degree=1",
            "export=false",
            "eval_every=null",
            "log_every=1000000",
            "resume=none",
            f"output_dir={OUT / name}",
            "overwrite=true",
            *MINILM_RUNS[name],
        ],
    )
    summary = run(config)
    steps = [json.loads(line) for line in (OUT / name / "metrics.jsonl").read_text().splitlines()]
    seconds = summary["seconds"]["train"]
    real_tokens = sum(record["tokens_per_s"] * record["step_time_s"] for record in steps)
    return {
        "train_seconds": seconds,
        "samples_per_s": config.max_steps * config.batch_size / seconds,
        "tokens_per_s": real_tokens / seconds,
        "slot_efficiency": 1 - summary["padding_fraction"],
        "accuracy": summary["accuracy"],
    }


def worker(name: str, args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    if name in TRL_RUNS:
        return trl_worker(name, args)
    return (ours_chat_worker if name in CHAT_RUNS else minilm_worker)(name, args)


# ----------------------------------------------------------------------------------- the driver
def run_worker(name: str, args, python: str, number: int) -> dict:
    result_file = OUT / f"{name}-{number}.json"
    command = [python, __file__, "--worker", name, "--json", str(result_file), *worker_arguments(args)]
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=path)
    load = ForeignLoad()
    load.start()
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(result_file.read_text())
    result.update(wall_s=time.perf_counter() - started, foreign_load=load.stop())
    if "model_dir" in result:  # the one evaluator, here, for every run's saved model
        spec = json.loads((OUT / "spec.json").read_text())
        result["heldout_loss"] = heldout_loss(result["model_dir"], spec["validation_ids"])
    return result


def worker_arguments(args) -> list[str]:
    keys = ("steps", "minilm_steps", "batch_size", "max_length", "hidden", "layers", "heads", "lr")
    keys += ("warmup_ratio", "weight_decay", "seed", "threads", "data_dir")
    return [item for key in keys for item in (f"--{key.replace('_', '-')}", str(getattr(args, key)))]


def describe_lengths(lengths: list[int]) -> str:
    ordered = sorted(lengths)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return (
        f"{len(ordered)} rows, tokens: min {ordered[0]}, p10 {at(0.1)}, median {at(0.5)}, p90 {at(0.9)}, "
        f"max {ordered[-1]}, mean {statistics.mean(ordered):.1f}"
    )


def print_tables(results: dict[str, list[dict]], valid: bool) -> None:
    mark = "" if valid else "  [NOT VALID: shared machine]"
    chat = [n for n in results if n not in MINILM_RUNS]
    if chat:
        base = "ours-grouped" if "ours-grouped" in results else chat[0]
        steps = len(results[chat[0]][0]["losses"])
        checkpoints = sorted({1, max(1, steps // 4), max(1, steps // 2), steps})
        head = " ".join(f"{'loss@' + str(s):>10}" for s in checkpoints)
        print(
            f"\n{'chat run':18} {'tokens/s':>9} {'x ' + base:>16} {'slots used':>10} {head} {'max |dloss|':>11} "
            f"{'held-out':>9}{mark}"
        )
        base_rate = statistics.median(r["trained_tokens"] / r["train_seconds"] for r in results[base])
        for name in chat:
            rate = statistics.median(r["trained_tokens"] / r["train_seconds"] for r in results[name])
            first = results[name][0]
            losses = " ".join(f"{first['losses'][s - 1]:>10.4f}" for s in checkpoints)
            # every step's loss against the base run's, where both trained on the same batches
            same = first["batches"] == results[base][0]["batches"]
            gap = max(abs(a - b) for a, b in zip(first["losses"], results[base][0]["losses"])) if same else None
            print(
                f"{name:18} {rate:>9.1f} {rate / base_rate:>15.2f}x {first['slot_efficiency']:>10.1%} {losses} "
                f"{'other batches' if gap is None else f'{gap:.1e}':>11} "
                f"{statistics.median(r['heldout_loss'] for r in results[name]):>9.4f}"
            )
            if first.get("cross_row_attention") is not None:
                print(
                    f"{'':18} padding-free rows' logits alone vs flattened: max diff {first['cross_row_attention']:.2e}"
                )
    minilm = [n for n in results if n in MINILM_RUNS]
    if minilm:
        print(
            f"\n{'MiniLM SST-2 run':22} {'samples/s':>9} {'tokens/s':>9} {'slots used':>10} {'dev accuracy':>12}{mark}"
        )
        for name in minilm:
            runs = results[name]
            print(
                f"{name:22} {statistics.median(r['samples_per_s'] for r in runs):>9.1f} "
                f"{statistics.median(r['tokens_per_s'] for r in runs):>9.1f} {runs[0]['slot_efficiency']:>10.1%} "
                f"{statistics.median(r['accuracy'] for r in runs):>12.4f}"
            )


def check_same_batches(results: dict[str, list[dict]]) -> None:
    """Every grouped chat run trained on the same batches in the same order (so losses compare step by step)."""
    grouped = [n for n in results if n in ("ours-grouped", "ours-packed", *TRL_RUNS)]
    batches = {json.dumps(results[n][0]["batches"]) for n in grouped}
    if len(batches) > 1:
        sys.exit(f"the runs {', '.join(grouped)} did not train on the same batches")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=[*CHAT_RUNS, *TRL_RUNS, *MINILM_RUNS])
    parser.add_argument("--steps", type=int, default=100, help="chat runs' steps")
    parser.add_argument("--minilm-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="chat runs' batch (rows)")
    parser.add_argument("--max-length", type=int, default=256, help="chat runs: packed sequences' length")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-ratio", type=float, default=0.06)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="repeat the runs in rotated order (medians)")
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "sst2"), help="GLUE SST-2")
    parser.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--max-foreign", type=float, default=0.05, help="share of the CPUs others may use")
    parser.add_argument("--allow-shared", action="store_true", help="run on a shared machine, figures NOT VALID")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    if args.worker:
        Path(args.json).write_text(json.dumps(worker(args.worker, args)))
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    if any(n in TRL_RUNS for n in args.runs) and not Path(args.trl_python).exists():
        sys.exit(f"--trl-python {args.trl_python}: no such interpreter; `make bench-sft` creates .venv-trl")
    before = probe_foreign_load(3.0)
    valid = before <= args.max_foreign
    print(f"other processes used {before:.1%} of the {os.cpu_count()} CPUs over 3 s before the runs")
    if not valid and not args.allow_shared:
        sys.exit(
            f"the machine is shared (> {args.max_foreign:.0%}): figures would not be true; wait, or --allow-shared"
        )
    if any(n not in MINILM_RUNS for n in args.runs):
        spec = write_start(args)
        print(f"chat sample: {describe_lengths(spec['lengths'])}; max_length {args.max_length}")
        print(
            f"Llama {args.hidden} hidden, {args.layers} layers, {args.heads} heads: {spec['parameters']:,} parameters"
        )
    results: dict[str, list[dict]] = {name: [] for name in args.runs}
    for number in range(args.rounds):
        order = args.runs[number % len(args.runs) :] + args.runs[: number % len(args.runs)]
        for name in order:
            python = args.trl_python if name in TRL_RUNS else sys.executable
            result = run_worker(name, args, python, number)
            results[name].append(result)
            valid = valid and result["foreign_load"] <= args.max_foreign
            print(f"round {number + 1} {name:22s} {result['wall_s']:6.0f} s, others used {result['foreign_load']:.1%}")
    check_same_batches(results)
    print_tables(results, valid)
    for runs in results.values():
        for run in runs:
            run.pop("batches", None)
    (OUT.parent / "sft_packing.json").write_text(json.dumps({"args": vars(args), "valid": valid, "results": results}))
    if not valid:
        print("NOT VALID: other processes used the CPUs during the runs; rerun on an idle machine")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
