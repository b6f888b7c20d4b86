"""Our task=dpo against TRL's DPOTrainer (trl==1.16.0 from PyPI, a benchmark peer only, never a dependency): the
step-1 figures of both on the same tiny Llama, the same pairs, beta and batch, in fp32 on CPU.

`make bench-dpo-trl` (creates .venv-trl: trl installed with --no-deps beside .venv's packages). One starting point:
a Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, untied head, dropout 0) initialised from torch.manual_seed(0)
and saved with save_pretrained, beside a byte-level BPE tokenizer learned from the shipped preference sample
(ChatML's control tokens special, ChatML as its chat template). Pairs: the sample's first 8 rows, conversational
(prompt/chosen/rejected messages, rendered by the template) and the same rows as plain text (the user's content, the
answers' contents; EOS appended to each answer). One batch of all 8 pairs, beta 0.1, max_length 128, one step, for
dpo_loss sigmoid and ipo; and, on the conversational pairs, simpo against CPOTrainer (loss_type="simpo",
cpo_alpha=0, simpo_gamma 0.5) and orpo against ORPOTrainer (also nll_loss, log_odds_ratio, log_odds_chosen), both
fed DPOTrainer's token ids for the rows (the peer's docstring says how).
Ours: scripts/train.py (recipes/llama/tp.yaml, model=<folder>, one process), its first
metrics.jsonl record; TRL: bench/trl_dpo_peer.py in .venv-trl, what DPOTrainer logged for step 1.

At step 1 the policy is the reference, so both report rewards 0 and a loss of ln 2 (sigmoid) or 1/(4 beta^2)
(ipo) whatever the code does; the figures that test something are logps/chosen, logps/rejected (sums of the
answers' token log-probabilities, means over the pairs) and grad_norm (the global L2 norm of the gradients before
clipping, on both sides). Each figure must agree within TOLERANCE; the token ids of every row are compared too
(ours: the data the run trains on; TRL's: the peer's rows), and the first difference is printed where they differ.

Prints one markdown table (docs/benchmarks.md) and writes runs/bench/dpo-vs-trl/results.json; exit code 1 when a
figure or a token differs. tests/loop/test_dpo_trl.py runs the same comparison with this module's functions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama" / "tp.yaml"
PEER = REPO / "bench" / "trl_dpo_peer.py"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
SAMPLE = REPO / "src" / "parallel_finetune" / "sample_data" / "preference" / "train.jsonl"
OUT = REPO / "runs" / "bench" / "dpo-vs-trl"
PAIRS = 8  # the sample's first rows: the one batch
BETA = 0.1
MAX_LENGTH = 128
FORMATS = ("conversational", "text")
LOSSES = ("sigmoid", "ipo")
# the reference-free losses (TRL's CPOTrainer loss_type=simpo, cpo_alpha=0, simpo_gamma 0.5, and ORPOTrainer), on
# the conversational pairs' token ids (the peer feeds them DPOTrainer's, which the DPO cases check against ours)
FREE_LOSSES = ("simpo", "orpo")
CASES = [(fmt, loss) for fmt in FORMATS for loss in LOSSES] + [("conversational", loss) for loss in FREE_LOSSES]
FIGURES = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "grad_norm",
)
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
ORPO_FIGURES = ("nll_loss", "log_odds_ratio", "log_odds_chosen")  # ORPO's own, besides FIGURES


def figures_of(loss: str) -> tuple[str, ...]:
    """The figures compared for a loss: FIGURES, and ORPO's own."""
    return FIGURES + ORPO_FIGURES if loss == "orpo" else FIGURES


def tolerance(figure: str, loss: str) -> dict[str, float]:
    """How closely a figure must agree: absolute 1e-5 (fp32), relative 1e-6 for the figures that are large (logps
    sums, ipo's loss of 1/(4 beta^2) = 25), relative 1e-4 for the gradient norm (a sum over every parameter)."""
    if figure == "grad_norm":
        return {"rel": 1e-4}
    if figure.startswith("logps/") or figure == "nll_loss" or (figure == "loss" and loss in ("ipo", "orpo")):
        return {"rel": 1e-6}
    return {"abs": 1e-5}


def _as_text(row: dict) -> dict:
    """A conversational pair as plain text: the user's content, then each answer's assistant content."""
    user = [m["content"] for m in row["prompt"] if m["role"] == "user"]
    return {"prompt": user[-1], "chosen": row["chosen"][-1]["content"], "rejected": row["rejected"][-1]["content"]}


def write_fixture(folder: Path) -> Path:
    """`folder`/model (a tiny Llama and its tokenizer, save_pretrained) and `folder`/<format>/{train,validation}
    .jsonl for each of FORMATS (validation: the first 4 pairs). Returns `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallel_finetune.data.chat import CHATML
    from parallel_finetune.data.prepare import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in SAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]
    sentences = [m["content"] for row in rows for key in ("prompt", "chosen", "rejected") for m in row[key]]
    model_dir = folder / "model"
    tokenizer = train_tokenizer("bpe", sentences, 600, folder / "tokenizer", specials=CHATML_SPECIALS)
    tokenizer.chat_template = CHATML
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=2 * MAX_LENGTH,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    pairs = {"conversational": rows[:PAIRS], "text": [_as_text(row) for row in rows[:PAIRS]]}
    for fmt, chosen in pairs.items():
        (folder / fmt).mkdir(exist_ok=True)
        for split, split_rows in (("train", chosen), ("validation", chosen[:4])):
            text = "".join(json.dumps(row) + "\n" for row in split_rows)
            (folder / fmt / f"{split}.jsonl").write_text(text, encoding="utf-8")
    return folder


def ours_overrides(folder: Path, fmt: str, loss: str, cache_dir: Path) -> list[str]:
    """scripts/train.py's overrides (after RECIPE) for one case: one step of one batch of PAIRS pairs."""
    return [
        "size=full",
        f"model={folder / 'model'}",
        "family=llama",
        "task=dpo",
        f"train_file={folder / fmt / 'train.jsonl'}",
        f"validation_file={folder / fmt / 'validation.jsonl'}",
        f"batch_size={PAIRS}",
        "max_steps=1",
        "precision=fp32",
        f"max_length={MAX_LENGTH}",
        f"dpo_loss={loss}",
        f"dpo_beta={BETA}",
        "tensor_parallel_degree=1",
        "export=false",
        "log_every=1",
        f"cache_dir={cache_dir}",
        "peak_tflops=0.1",
        "lr=1e-6",
        "warmup_steps=0",
        "max_grad_norm=1.0",
        "group_by_length=false",
        "report_to=none",
        "seed=0",
        "resume=none",
    ]


def read_ours(output_dir: Path, loss: str = "sigmoid") -> dict[str, float]:
    """The loss's figures from the run's first metrics.jsonl record (step 1, computed before the update)."""
    first = json.loads((output_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1, first
    return {figure: float(first[figure]) for figure in figures_of(loss)}


def ours_tokens(folder: Path, fmt: str, loss: str, cache_dir: Path) -> list[dict]:
    """The rows our run trains on (the run's own data preparation, from the cache the run filled): for each pair,
    prompt_length and the chosen and rejected rows' token ids, in file order."""
    from parallel_finetune.loop.builder import prepare_data
    from parallel_finetune.resolve import load_config

    config = load_config(RECIPE, ours_overrides(folder, fmt, loss, cache_dir))
    train = prepare_data(config).splits["train"]
    rows = sorted(zip(train["index"], train["prompt_length"], train["input_ids"], train["rejected_ids"]))
    return [{"prompt_length": p, "chosen": list(c), "rejected": list(r)} for _, p, c, r in rows]


def trl_command(folder: Path, fmt: str, loss: str, out: Path, python: Path = TRL_PYTHON) -> list[str]:
    """The peer's command line for one case (run it in .venv-trl)."""
    return [
        str(python),
        str(PEER),
        "--model",
        str(folder / "model"),
        "--pairs",
        str(folder / fmt / "train.jsonl"),
        "--beta",
        str(BETA),
        "--loss-type",
        loss,
        "--batch-size",
        str(PAIRS),
        "--max-length",
        str(MAX_LENGTH),
        "--out",
        str(out),
    ]


# Several peer runs in one process, so that TRL's imports (~6 s of each run's ~8 s) are paid once: each run executes
# the peer as a script (its imports then found in sys.modules) with its own sys.argv.
PEER_RUNS = (
    "import json, runpy, sys\n"
    "for argv in json.loads(sys.argv[1]):\n"
    "    sys.argv = argv\n"
    "    runpy.run_path(argv[0], run_name='__main__')\n"
)


def trl_batch_command(commands: list[list[str]]) -> list[str]:
    """One command that runs several trl_command()s (same python) one after another in one process."""
    return [commands[0][0], "-c", PEER_RUNS, json.dumps([command[1:] for command in commands])]


def read_trl(out: Path) -> dict:
    """The peer's output: `version`, its step-1 `figures` (FIGURES) and its `rows`, as ours_tokens gives ours."""
    result = json.loads(out.read_text())
    rows = [
        {
            "prompt_length": len(row["prompt_input_ids"]),
            "chosen": (row["prompt_input_ids"] + row["chosen_input_ids"])[: result["max_length"]],
            "rejected": (row["prompt_input_ids"] + row["rejected_input_ids"])[: result["max_length"]],
        }
        for row in result["rows"]
    ]
    figures = {figure: float(result["metrics"][figure]) for figure in figures_of(result["loss_type"])}
    return {"version": result["trl_version"], "figures": figures, "rows": rows}


def _tail(ids: list[int], at: int, decode=None) -> str:
    """Up to 8 ids from position `at`, and their text with `decode`."""
    return f"{ids[at : at + 8]}" + (f" {decode(ids[at : at + 8])!r}" if decode else "")


def token_differences(ours: list[dict], trl: list[dict], decode=None) -> list[str]:
    """One line per pair whose tokens differ: which field, the first position that differs and the ids (and text,
    with `decode`) from there on each side."""
    if len(ours) != len(trl):
        return [f"ours has {len(ours)} pairs, TRL {len(trl)}"]
    lines = []
    for n, (a, b) in enumerate(zip(ours, trl)):
        if a["prompt_length"] != b["prompt_length"]:
            lines.append(f"pair {n}: prompt_length ours {a['prompt_length']}, TRL {b['prompt_length']}")
        for key in ("chosen", "rejected"):
            x, y = a[key], b[key]
            if x != y:
                at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
                ours_tail, trl_tail = (_tail(ids, at, decode) for ids in (x, y))
                where = f"pair {n} {key}: from token {at} (of ours {len(x)}, TRL {len(y)})"
                lines.append(f"{where}: ours {ours_tail}, TRL {trl_tail}")
    return lines


def compare(ours: dict[str, float], trl: dict[str, float], loss: str) -> list[dict]:
    """Per figure: both values, the difference (absolute, or relative where the tolerance is), the limit, ok."""
    rows = []
    for figure in figures_of(loss):
        a, b = ours[figure], trl[figure]
        limit = tolerance(figure, loss)
        if "rel" in limit:
            difference, bound = abs(a - b) / max(abs(b), 1e-30), limit["rel"]
        else:
            difference, bound = abs(a - b), limit["abs"]
        ok = math.isfinite(a) and math.isfinite(b) and difference <= bound
        rows.append({"figure": figure, "ours": a, "trl": b, "difference": difference, "limit": limit, "ok": ok})
    return rows


def passed(result: dict) -> bool:
    """Every figure of a result_of() within its limit (token differences aside)."""
    return all(row["ok"] for row in result["rows"])


def case_line(fmt: str, loss: str, rows: list[dict]) -> str:
    """One line: each figure as ours/TRL, then the largest difference."""
    worst = max(rows, key=lambda r: r["difference"] / next(iter(r["limit"].values())))
    cells = " | ".join(f"{r['figure']} {r['ours']:.8g}/{r['trl']:.8g}" for r in rows)
    kind = next(iter(worst["limit"]))
    return (
        f"{fmt:<14} {loss:<7} ours/TRL: {cells} || largest difference (vs its limit): {worst['figure']} "
        f"{kind} {worst['difference']:.2e} (limit {worst['limit'][kind]:g})"
    )


def markdown_table(results: list[dict]) -> str:
    """Ours vs TRL per figure, one row per figure and case."""
    lines = [
        f"Step 1 of task=dpo vs TRL {results[0]['trl_version']} DPOTrainer: tiny Llama, {PAIRS} pairs of the shipped "
        f"preference sample in one batch, beta {BETA}, max_length {MAX_LENGTH}, fp32, CPU.",
        "",
        "| pairs | dpo_loss | figure | ours | TRL | difference | limit | tokens equal |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for result in results:
        for row in result["rows"]:
            kind = next(iter(row["limit"]))
            lines.append(
                f"| {result['format']} | {result['loss']} | {row['figure']} | {row['ours']:.8g} | {row['trl']:.8g} | "
                f"{kind} {row['difference']:.1e} | {row['limit'][kind]:g} | "
                f"{'yes' if not result['token_differences'] else 'NO'} |"
            )
    return "\n".join(lines)


def result_of(fmt: str, loss: str, ours: dict[str, float], our_rows: list[dict], trl: dict, decode=None) -> dict:
    """One case compared: figures (compare) and tokens (token_differences)."""
    return {
        "format": fmt,
        "loss": loss,
        "trl_version": trl["version"],
        "rows": compare(ours, trl["figures"], loss),
        "token_differences": token_differences(our_rows, trl["rows"], decode),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(OUT))
    parser.add_argument("--trl-python", default=str(TRL_PYTHON))
    args = parser.parse_args()
    from transformers import AutoTokenizer

    out, trl_python = Path(args.out_dir), Path(args.trl_python)
    if not trl_python.exists():
        sys.exit(f"--trl-python {trl_python}: no such interpreter; `make bench-dpo-trl` creates .venv-trl")
    folder, cache_dir = write_fixture(out / "fixture"), out / "cache"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    trl_outs = {case: out / f"trl-{case[0]}-{case[1]}.json" for case in CASES}
    commands = {"TRL": trl_batch_command([trl_command(folder, *case, trl_outs[case], trl_python) for case in CASES])}
    for fmt, loss in CASES:
        commands[f"ours ({fmt}, {loss})"] = [sys.executable, str(REPO / "scripts" / "train.py"), str(RECIPE)]
        commands[f"ours ({fmt}, {loss})"] += ours_overrides(folder, fmt, loss, cache_dir)
        commands[f"ours ({fmt}, {loss})"] += [f"output_dir={out / f'ours-{fmt}-{loss}'}", "overwrite=true"]
    for name, command in commands.items():
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    decode = AutoTokenizer.from_pretrained(folder / "model").decode
    results = []
    for fmt, loss in CASES:
        ours = read_ours(out / f"ours-{fmt}-{loss}", loss)
        our_rows = ours_tokens(folder, fmt, loss, cache_dir)
        results.append(result_of(fmt, loss, ours, our_rows, read_trl(trl_outs[fmt, loss]), decode))
        print(case_line(fmt, loss, results[-1]["rows"]), flush=True)
        for line in results[-1]["token_differences"]:
            print("  tokens differ:", line)
    print()
    print(markdown_table(results))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [f"{r['format']}/{r['loss']}" for r in results if r["token_differences"] or not passed(r)]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every figure within its limit, every token equal'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
