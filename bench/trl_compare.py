"""Ours against TRL's trainers, the part every comparison shares (bench/dpo_vs_trl.py, bench/reward_vs_trl.py,
bench/kto_vs_trl.py, and tests/loop/test_trl_peers.py through them): the command lines of TRL's side
(bench/trl_peer.py in .venv-trl, every run of a comparison in one process) and of ours (scripts/train.py, one
process), our run's figures from its metrics.jsonl, the figure-by-figure comparison within each figure's limit,
the row-by-row comparison of the token ids, the markdown table and the benchmarks' main.

A comparison is a bench module holding NAME (its task), CASES, write_fixture(folder) -> folder,
ours_overrides(folder, case, cache_dir), trl_request(folder, case, cache_dir, out) -> the peer's arguments,
compared(folder, case, cache_dir, ours_dir, trl_out, decode) -> a result (result_of) and table(results) -> str.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "llama" / "tp.yaml"
PEER = REPO / "bench" / "trl_peer.py"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
# Our side of every comparison: one fp32 process of scripts/train.py on RECIPE from a save_pretrained folder, one
# step of lr 1e-6 unless a comparison says otherwise, nothing exported, every step logged.
OURS = {
    "size": "full",
    "family": "llama",
    "max_steps": 1,
    "precision": "fp32",
    "tensor_parallel_degree": 1,
    "export": "false",
    "log_every": 1,
    "peak_tflops": 0.1,
    "lr": 1e-6,
    "warmup_steps": 0,
    "max_grad_norm": 1.0,
    "group_by_length": "false",
    "report_to": "none",
    "seed": 0,
    "resume": "none",
}


def label(case) -> str:
    """A case's name in file names and tables: its parts joined by '-'."""
    return "-".join(case) if isinstance(case, tuple) else case


def ours_overrides(task: str, model: Path, data: Path, cache_dir: Path, **settings) -> list[str]:
    """scripts/train.py's overrides (after RECIPE): `task` on `model`, trained on `data`/train.jsonl (held out:
    `data`/validation.jsonl), OURS with `settings` added or replacing."""
    files = {"train_file": data / "train.jsonl", "validation_file": data / "validation.jsonl"}
    values = {"model": model, "task": task, **files, "cache_dir": cache_dir, **OURS, **settings}
    return [f"{key}={value}" for key, value in values.items()]


def ours_command(overrides: list[str], output_dir: Path) -> list[str]:
    """Our run of `overrides` (ours_overrides) into `output_dir`, replacing an earlier run there."""
    run = [sys.executable, str(REPO / "scripts" / "train.py"), str(RECIPE), *overrides]
    return run + [f"output_dir={output_dir}", "overwrite=true"]


def read_ours(output_dir: Path, figures: tuple[str, ...], steps: int = 1) -> list[dict[str, float]]:
    """`figures` of each step from our run's metrics.jsonl (a step's figures are computed before its update)."""
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1)), records
    return [{figure: float(r[figure]) for figure in figures if figure in r} for r in records]


def peer_request(kind: str, **options) -> list[str]:
    """bench/trl_peer.py's arguments for one run of `kind`: --option value (underscores as dashes), a bare flag for
    True, nothing for None or False."""
    request = [kind]
    for name, value in options.items():
        if value is None or value is False:
            continue
        request += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return request


def batch_command(requests: list[list[str]], python: Path = TRL_PYTHON) -> list[str]:
    """One process that runs every request (peer_request) one after another: TRL's imports are paid once."""
    return [str(python), str(PEER), "batch", json.dumps(requests)]


def tolerance(figure: str, loss: str = "") -> dict[str, float]:
    """How closely a figure must agree: relative 1e-4 for the gradient norm (a sum over every parameter); relative
    1e-6 for the figures that are large (logps/* and nll_loss: sums over an answer's tokens, fp32's spacing near
    -90 being 8e-6; the loss of ipo, 1/(4 beta^2) = 25 at step 1, and orpo's); absolute 1e-5 for the rest."""
    if figure == "grad_norm":
        return {"rel": 1e-4}
    if figure.startswith("logps/") or figure == "nll_loss" or (figure == "loss" and loss in ("ipo", "orpo")):
        return {"rel": 1e-6}
    return {"abs": 1e-5}


def compare(ours: list[dict], trl: list[dict], figures: tuple[str, ...], limit: Callable[[str], dict]) -> list[dict]:
    """Per step and figure: both values (NaN where a side lacks it), the difference (relative where the limit is),
    the limit, ok."""
    assert len(ours) == len(trl), f"ours logged {len(ours)} steps, TRL {len(trl)}"
    rows = []
    for step, (mine, theirs) in enumerate(zip(ours, trl), start=1):
        for figure in figures:
            a, b, bound = mine.get(figure, math.nan), theirs.get(figure, math.nan), limit(figure)
            difference = abs(a - b) / max(abs(b), 1e-30) if "rel" in bound else abs(a - b)
            ok = math.isfinite(a) and math.isfinite(b) and difference <= next(iter(bound.values()))
            rows.append(
                {
                    "step": step,
                    "figure": figure,
                    "ours": a,
                    "trl": b,
                    "difference": difference,
                    "limit": bound,
                    "ok": ok,
                }
            )
    return rows


def _tail(ids: list[int], at: int, decode=None) -> str:
    """Up to 8 ids from position `at`, and their text with `decode`."""
    return f"{ids[at : at + 8]}" + (f" {decode(ids[at : at + 8])!r}" if decode else "")


def token_differences(ours: list[dict], trl: list[dict], decode=None, unit: str = "pair") -> list[str]:
    """One line per field of a row that differs: for a list of ids, the first position that differs and the ids
    (and text, with `decode`) from there on each side; otherwise both values."""
    if len(ours) != len(trl):
        return [f"ours has {len(ours)} {unit}s, TRL {len(trl)}"]
    lines = []
    for n, (a, b) in enumerate(zip(ours, trl)):
        for key, x in a.items():
            y = b[key]
            if x == y:
                continue
            if not isinstance(x, list):
                lines.append(f"{unit} {n}: {key} ours {x}, TRL {y}")
                continue
            at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            where = f"{unit} {n} {key}: from token {at} (of ours {len(x)}, TRL {len(y)})"
            lines.append(f"{where}: ours {_tail(x, at, decode)}, TRL {_tail(y, at, decode)}")
    return lines


def result_of(case: dict, trl: dict, rows: list[dict], differences: list[str]) -> dict:
    """One case compared: `case`'s fields, TRL's version, the figures (compare) and the tokens (token_differences)."""
    return {**case, "trl_version": trl["trl_version"], "rows": rows, "token_differences": differences}


def passed(result: dict) -> bool:
    """Every figure of a result within its limit (token differences aside)."""
    return all(row["ok"] for row in result["rows"])


def case_line(name: str, rows: list[dict]) -> str:
    """One line: each figure as ours/TRL (with its step where there are several), then the largest difference."""
    worst = max(rows, key=lambda r: r["difference"] / next(iter(r["limit"].values())))
    steps = len({r["step"] for r in rows}) > 1
    step = lambda r: f"step {r['step']} " if steps else ""  # noqa: E731
    cells = " | ".join(f"{step(r)}{r['figure']} {r['ours']:.8g}/{r['trl']:.8g}" for r in rows)
    kind = next(iter(worst["limit"]))
    return (
        f"{name:<22} ours/TRL: {cells} || largest difference (vs its limit): {worst['figure']} "
        f"{kind} {worst['difference']:.2e} (limit {worst['limit'][kind]:g})"
    )


def markdown_table(title: str, columns: dict[str, str], results: list[dict]) -> str:
    """`title`, then one table row per figure (and step, where there are several) of each result; `columns` maps
    the headers of the leading columns to the result's fields."""
    steps = any(row["step"] > 1 for result in results for row in result["rows"])
    head = [*columns, *(["step"] if steps else []), "figure", "ours", "TRL", "difference", "limit", "tokens equal"]
    align = ["---"] * len(columns) + ["---:"] * steps + ["---", "---:", "---:", "---:", "---:", "---"]
    lines = [title, "", f"| {' | '.join(head)} |", f"|{'|'.join(align)}|"]
    for result in results:
        for row in result["rows"]:
            kind = next(iter(row["limit"]))
            cells = [str(result[key]) for key in columns.values()] + ([str(row["step"])] if steps else [])
            cells += [row["figure"], f"{row['ours']:.8g}", f"{row['trl']:.8g}", f"{kind} {row['difference']:.1e}"]
            cells += [f"{row['limit'][kind]:g}", "yes" if not result["token_differences"] else "NO"]
            lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def run_all(commands: dict[str, list[str]]) -> None:
    """Each command in turn; the first that fails ends the benchmark with its output's tail."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for name, command in commands.items():
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{name} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")


def main(bench, argv: list[str] | None = None) -> int:
    """`bench`'s comparison: every case's TRL run (one process) and ours, the table, runs/bench/<NAME>-vs-trl/
    results.json; 1 when a figure or a token differs."""
    parser = argparse.ArgumentParser(description=bench.__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=str(REPO / "runs" / "bench" / f"{bench.NAME}-vs-trl"))
    parser.add_argument("--trl-python", default=str(TRL_PYTHON))
    args = parser.parse_args(argv)
    out, trl_python = Path(args.out_dir), Path(args.trl_python)
    if not trl_python.exists():
        sys.exit(f"--trl-python {trl_python}: no such interpreter; `make bench-{bench.NAME}-trl` creates .venv-trl")
    from transformers import AutoTokenizer

    folder, cache_dir = bench.write_fixture(out / "fixture"), out / "cache"
    trl_outs = {case: out / f"trl-{label(case)}.json" for case in bench.CASES}
    requests = [bench.trl_request(folder, case, cache_dir, trl_outs[case]) for case in bench.CASES]
    commands = {"TRL": batch_command(requests, trl_python)}
    for case in bench.CASES:
        overrides = bench.ours_overrides(folder, case, cache_dir)
        commands[f"ours ({label(case)})"] = ours_command(overrides, out / f"ours-{label(case)}")
    run_all(commands)
    decode = AutoTokenizer.from_pretrained(folder / "model").decode
    results = []
    for case in bench.CASES:
        results.append(bench.compared(folder, case, cache_dir, out / f"ours-{label(case)}", trl_outs[case], decode))
        print(case_line(label(case), results[-1]["rows"]), flush=True)
        for line in results[-1]["token_differences"]:
            print("  tokens differ:", line)
    print()
    print(bench.table(results))
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [label(case) for case, r in zip(bench.CASES, results) if r["token_differences"] or not passed(r)]
    print(f"\n{'FAILED: ' + ', '.join(failed) if failed else 'every figure within its limit, every token equal'}")
    return 1 if failed else 0
