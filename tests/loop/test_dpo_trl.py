"""task=dpo against TRL's DPOTrainer (trl==1.16.0 from PyPI in .venv-trl, a test peer only, never a dependency):
step 1 on the same tiny Llama, the same 8 pairs in one batch, the same beta, gives the same loss, rewards/*, logps/*
and gradient norm (before clipping), for dpo_loss sigmoid and ipo, on conversational (ChatML) and plain-text pairs,
from the same token ids row by row; and SimPO (CPOTrainer, loss_type simpo) and ORPO (ORPOTrainer) step 1 on the
same rows, where the rewards are not 0, so every figure tests the formulas.
For DPO, while policy == reference (step 1) the rewards are 0 and the loss ln 2 or
1/(4 beta^2) whatever the code does: logps/* (the answers' tokens and log-probabilities) and grad_norm (the loss's
gradient through the whole model) are what this tests. The comparison is bench/dpo_vs_trl.py's (`make
bench-dpo-trl` prints it as a table); .venv-trl is built here when missing (make), and TRL's six runs share one
process, started by the module's fixture while ours run."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO, launch, load_bench, subprocess_env

bench = load_bench("dpo_vs_trl")


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """(the fixture folder of bench.write_fixture, its tokenizer's decode, `trl(case)`: TRL's result for a case of
    bench.CASES). .venv-trl is made first; TRL runs every case in one background process, awaited by the first
    `trl` call."""
    # as typed in a shell, not nested in `make test`; .venv is this interpreter's, so taken as set up (-o)
    env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    make = subprocess.run(
        ["make", "-o", ".venv/.installed", ".venv-trl/.installed"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert make.returncode == 0, f"make .venv-trl/.installed failed:\n{(make.stdout + make.stderr)[-6000:]}"
    from transformers import AutoTokenizer

    folder = bench.write_fixture(tmp_path_factory.mktemp("dpo-trl"))
    outs = {case: folder / f"trl-{case[0]}-{case[1]}.json" for case in bench.CASES}
    command = bench.trl_batch_command([bench.trl_command(folder, *case, out) for case, out in outs.items()])
    proc = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    state: dict = {}

    def trl(case: tuple[str, str]) -> dict:
        if "output" not in state:
            try:
                state["output"] = proc.communicate(timeout=300)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                state["output"] = proc.communicate()[0] + "\n[timed out after 300 s]"
        if proc.returncode:
            pytest.fail(f"TRL's DPOTrainer failed ({proc.returncode}):\n{state['output'][-6000:]}")
        return bench.read_trl(outs[case])

    yield folder, AutoTokenizer.from_pretrained(folder / "model").decode, trl
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize(("fmt", "loss"), bench.CASES, ids=[f"{fmt}-{loss}" for fmt, loss in bench.CASES])
def test_dpo_step_one_equals_trls(peer, fmt, loss, cache_dir, tmp_path):
    folder, decode, trl = peer
    run = launch(1, bench.ours_overrides(folder, fmt, loss, cache_dir), tmp_path / "ours", recipe=bench.RECIPE)
    our_rows = bench.ours_tokens(folder, fmt, loss, cache_dir)
    result = bench.result_of(fmt, loss, bench.read_ours(run.output_dir, loss), our_rows, trl((fmt, loss)), decode)
    print("\n" + bench.case_line(fmt, loss, result["rows"]))
    assert not result["token_differences"], "our tokens differ from TRL's:\n" + "\n".join(result["token_differences"])
    assert bench.passed(result), [row for row in result["rows"] if not row["ok"]]
