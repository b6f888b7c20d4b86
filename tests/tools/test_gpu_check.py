"""The GPU check (bench/gpu.py) keeps going and keeps what it did: a row that fails is a table line with its one-line
reason, the rows after it still run, and gpu.json/gpu.md are written after every row. The whole check's dry run
(`make bench-gpu-dry-run`, minutes) is not run here; these take seconds."""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import load_bench

bench = load_bench("gpu")


def _settings(tmp_path, work):
    (work / "results").mkdir(parents=True)
    settings = dict(bench.DRY) | {"work": str(work), "dry_run": True}
    path = work / "settings.json"
    path.write_text(json.dumps(settings))
    return settings, path


def test_a_failing_row_is_one_line_and_the_next_row_still_runs(tmp_path):
    """Real row processes: varlen-logits fails (the setup row 'succeeded' but its model folder is missing), then
    peft-qlora is skipped on this CPU with its reason; neither stops the other."""
    work = tmp_path / "work"
    _, path = _settings(tmp_path, work)
    (work / "results" / "setup.json").write_text("{}")
    with (tmp_path / "gpu.log").open("w") as log:
        failed = bench.run_row("varlen-logits", path, tmp_path, work, 120, log)
        skipped = bench.run_row("peft-qlora", path, tmp_path, work, 120, log)
    assert failed["status"] == "failed" and "\n" not in failed["reason"], failed
    assert "llama" in failed["reason"] or "Error" in failed["reason"], failed
    assert skipped["status"] == "skipped" and ("bitsandbytes" in skipped["reason"] or "CUDA" in skipped["reason"])
    log_text = (tmp_path / "gpu.log").read_text()
    assert "===== varlen-logits" in log_text and "Traceback" in log_text  # the whole error stays in the log


def test_results_are_written_after_every_row(tmp_path, monkeypatch):
    """A check cut short after its first row (here: interrupted in the second) has written that row's gpu.json and
    gpu.md; a failed row's table line holds its reason; the exit status says a row failed."""
    seen = []

    def fake_row(name, settings_file, out, work, timeout, log):
        seen.append(name)
        if len(seen) == 2:
            raise KeyboardInterrupt
        return {"row": name, "section": "correctness", "seconds": 1.0, "status": "failed", "reason": "Boom: one line"}

    monkeypatch.setattr(bench, "run_row", fake_row)
    monkeypatch.setattr(bench, "machine", lambda: {k: "x" for k in ("torch", "commit", "python", "device",
                                                                    "transformers", "trl", "peft", "bitsandbytes",
                                                                    "torchao")})  # fmt: skip
    args = argparse.Namespace(dry_run=True, out=str(tmp_path / "out"), work=str(tmp_path / "work"),
                              rows=["setup", "varlen-logits"], budget_s=600.0)  # fmt: skip
    with pytest.raises(KeyboardInterrupt):
        bench.check(args)
    written = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert [r["row"] for r in written["rows"]] == ["setup"]
    assert "| setup | failed | Boom: one line |" in (tmp_path / "out" / "gpu.md").read_text()

    monkeypatch.setattr(bench, "run_row", lambda name, *rest: fake_row(name, *rest) | {"status": "skipped"})
    seen[:] = [None, None]  # no interruption now
    assert bench.check(args) == 0  # skipped rows are no failure
    assert [r["row"] for r in json.loads((tmp_path / "out" / "gpu.json").read_text())["rows"]] == args.rows


def test_the_speed_rows_count_only_the_steps_after_the_warm_up():
    records = [{"step_time_s": 10.0, "tokens_per_s": 1.0, "tflops_per_device": 0.1}] + [
        {"step_time_s": 2.0, "tokens_per_s": 500.0, "tflops_per_device": 50.0}
    ] * 3
    got = bench.measured(records, 1, {"peak_tflops_per_device": 100.0, "peak_memory_mib_per_rank": [2048.0]})
    assert (got["steps"], got["tokens"], got["tokens_per_s"], got["mfu"], got["peak_gib"]) == (3, 3000, 500.0, 0.5, 2.0)
    with pytest.raises(RuntimeError, match="none after the 4 warm-up"):
        bench.measured(records, 4, {})


def test_every_package_the_code_imports_at_load_is_bundled_or_on_the_gpu_image():
    """The GPU machine has its image's packages and the bundle's wheels, nothing else: every distribution that
    src/ and bench/gpu.py import at module level (not inside a function) is one of them. (evaluate was neither: the
    first GPU call failed at `import evaluate`.)"""
    import ast
    import importlib.metadata
    import sys
    from pathlib import Path

    bundle = load_bench("gpu_bundle")
    bundled = set(bundle.PINNED) | set(bundle.PEERS) | set(bundle.NEEDS)
    # the image's own, beyond requirements.txt's: what transformers and datasets themselves need
    image = set(bundle.ON_GPU_IMAGES) | {"huggingface-hub", "pyarrow", "pandas", "fsspec", "regex", "packaging"}
    distributions = importlib.metadata.packages_distributions()
    repo = Path(bench.__file__).resolve().parents[1]
    files = [*sorted((repo / "src" / "parallel_finetune").rglob("*.py")), repo / "bench" / "gpu.py"]
    missing = set()
    for path in files:
        for node in ast.parse(path.read_text()).body:  # module level only: a function's import is lazy
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"parallel_finetune"}:
                for dist in distributions.get(top, [top]):
                    if dist.lower().replace("_", "-") not in bundled | image:
                        missing.add(f"{path.relative_to(repo)}: {top} ({dist})")
    assert not missing, sorted(missing)
