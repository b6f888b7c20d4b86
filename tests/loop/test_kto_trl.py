"""task=kto against TRL's KTOTrainer (trl==1.16.0 in .venv-trl, a test peer only, never a dependency): steps 1 and 2
on the same tiny Llama, the same 16 unpaired rows in global batches of 8 (TRL fed them in our sampler's order, so
its KL rows are ours), beta 0.1, desirable_weight 3, give the same loss, kl, rewards/*, logps/* and gradient norm,
from the same token ids row by row: on conversational (ChatML) rows and on plain-text rows. Step 1 is the policy
against its reference (each row's loss 1/2 x its weight, kl 0); step 2's kl (0.2085 on the conversational rows)
is TRL's KL estimate of mismatched rows after one identical update. The comparison is bench/kto_vs_trl.py's
(`make bench-kto-trl`)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO, launch, load_bench, subprocess_env

bench = load_bench("kto_vs_trl")


@pytest.fixture(scope="module")
def peer(tmp_path_factory, cache_dir):
    """(the fixture folder, {case: (our rows, TRL's result)}): TRL's runs in one background process."""
    if not bench.TRL_PYTHON.exists():  # made as test_dpo_trl makes it (.venv taken as set up)
        env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        command = ["make", "-o", ".venv/.installed", ".venv-trl/.installed"]
        make = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert make.returncode == 0, f"make .venv-trl/.installed failed:\n{(make.stdout + make.stderr)[-6000:]}"
    dpo = load_bench("dpo_vs_trl")
    folder = bench.write_fixture(tmp_path_factory.mktemp("kto-trl"))
    ours, commands, outs = {}, [], {}
    for case in bench.CASES:
        ours[case] = bench.ours_rows(folder, case, cache_dir)
        outs[case] = folder / f"trl-{case}.json"
        rows = bench.write_trl_rows(folder, case, ours[case][1])
        commands.append(bench.trl_command(rows, folder / "model", outs[case]))
    proc = subprocess.Popen(
        dpo.trl_batch_command(commands),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
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
            pytest.fail(f"TRL's KTOTrainer failed ({proc.returncode}):\n{state['output'][-6000:]}")
        return bench.read_trl(outs[case], ours[case][1])

    yield folder, ours, trl
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("case", bench.CASES)
def test_kto_steps_equal_trls(peer, case, cache_dir, tmp_path):
    folder, ours, trl = peer
    run = launch(1, bench.ours_overrides(folder, case, cache_dir), tmp_path / "ours", recipe=bench.RECIPE)
    result = bench.result_of(case, bench.read_ours(run.output_dir), ours[case][0], trl(case))
    print(
        "\n"
        + "\n".join(
            f"{case} step {r['step']} {r['figure']}: ours {r['ours']:.8g} TRL {r['trl']:.8g}" for r in result["rows"]
        )
    )
    assert not result["token_differences"], "our tokens differ from TRL's:\n" + "\n".join(result["token_differences"])
    assert all(row["ok"] for row in result["rows"]), [row for row in result["rows"] if not row["ok"]]
    if case == "conversational":  # step 2's KL estimate is not the clamp's 0: the estimate itself is compared
        assert result["rows"][FIGURE_KL_STEP_2]["trl"] > 0.1


FIGURE_KL_STEP_2 = len(bench.FIGURES) + bench.FIGURES.index("kl")
