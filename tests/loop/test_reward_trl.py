"""task=reward against TRL's RewardTrainer (trl==1.16.0 in .venv-trl, a test peer only, never a dependency): step 1
on the same tiny Llama sequence classifier, the same 8 pairs in one batch, gives the same loss, accuracy, margin,
min/mean/max_reward (within 1e-5) and gradient norm (relative 1e-4), from the same token ids row by row: on
conversational (ChatML) pairs, and on plain-text pairs with a margin column and center_rewards_coefficient. The
comparison is bench/reward_vs_trl.py's (`make bench-reward-trl`); TRL's runs go in the background while ours run."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO, launch, load_bench, subprocess_env

bench = load_bench("reward_vs_trl")


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """(the fixture folder, `trl(case)`: TRL's result for a case of bench.CASES, run in one background process)."""
    if not bench.TRL_PYTHON.exists():  # made as test_dpo_trl makes it (.venv taken as set up)
        env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        command = ["make", "-o", ".venv/.installed", ".venv-trl/.installed"]
        make = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert make.returncode == 0, f"make .venv-trl/.installed failed:\n{(make.stdout + make.stderr)[-6000:]}"
    dpo = load_bench("dpo_vs_trl")
    folder = bench.write_fixture(tmp_path_factory.mktemp("reward-trl"))
    outs = {case: folder / f"trl-{case}.json" for case in bench.CASES}
    command = dpo.trl_batch_command([bench.trl_command(folder, case, out) for case, out in outs.items()])
    proc = subprocess.Popen(
        command, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    state: dict = {}

    def trl(case: str) -> dict:
        if "output" not in state:
            try:
                state["output"] = proc.communicate(timeout=300)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                state["output"] = proc.communicate()[0] + "\n[timed out after 300 s]"
        if proc.returncode:
            pytest.fail(f"TRL's RewardTrainer failed ({proc.returncode}):\n{state['output'][-6000:]}")
        return bench.read_trl(outs[case])

    yield folder, trl
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("case", bench.CASES)
def test_reward_step_one_equals_trls(peer, case, cache_dir, tmp_path):
    folder, trl = peer
    run = launch(1, bench.ours_overrides(folder, case, cache_dir), tmp_path / "ours", recipe=bench.RECIPE)
    ours, rows = bench.read_ours(run.output_dir), bench.ours_tokens(folder, case, cache_dir)
    result = bench.result_of(case, ours, rows, trl(case))
    print("\n" + "\n".join(f"{case} {r['figure']}: ours {r['ours']:.8g} TRL {r['trl']:.8g}" for r in result["rows"]))
    assert not result["token_differences"], "our tokens differ from TRL's:\n" + "\n".join(result["token_differences"])
    assert all(row["ok"] for row in result["rows"]), [row for row in result["rows"] if not row["ok"]]
