"""Our preference tasks against TRL 1.16.0's trainers (trl from PyPI in .venv-trl, a test peer only, never a
dependency), on the same tiny Llama, the same rows and settings, in fp32 on CPU: the same token ids row by row, and
every figure within its limit (bench/trl_compare.py's tolerance: absolute 1e-5; relative 1e-6 for logps/*,
nll_loss and ipo's and orpo's loss; relative 1e-4 for the gradient norm before clipping).
- task=dpo against DPOTrainer, step 1 of 8 pairs in one batch: loss, rewards/*, logps/* and grad_norm for dpo_loss
  sigmoid and ipo, on conversational (ChatML) and plain-text pairs. While policy == reference (step 1) the rewards
  are 0 and the loss ln 2 or 1/(4 beta^2) whatever the code does: logps/* (the answers' tokens and
  log-probabilities) and grad_norm (the loss's gradient through the whole model) are what this tests. SimPO
  (CPOTrainer, loss_type simpo) and ORPO (ORPOTrainer) step 1 on the same rows, where the rewards are not 0, so
  every figure tests the formulas.
- task=reward against RewardTrainer, step 1 of a tiny Llama sequence classifier on 8 pairs in one batch: loss,
  accuracy, margin, min/mean/max_reward and grad_norm, on conversational pairs and on plain-text pairs with a
  margin column and center_rewards_coefficient.
- task=kto against KTOTrainer, steps 1 and 2 of 16 unpaired rows in global batches of 8 (TRL fed them in our
  sampler's order, so its KL rows are ours), beta 0.1, desirable_weight 3: loss, kl, rewards/*, logps/* and
  grad_norm, conversational and plain-text rows. Step 1 is the policy against its reference (each row's loss 1/2 x
  its weight, kl 0); step 2's kl (0.2085 on the conversational rows) is TRL's KL estimate of mismatched rows after
  one identical update.
The comparisons are bench/{dpo,reward,kto}_vs_trl.py's (`make bench-dpo-trl`, `bench-reward-trl`, `bench-kto-trl`
print them as tables). TRL's runs of every case share one process (`bench/trl_peer.py batch`: torch's,
transformers' and trl's imports, ~8-15 s of CPU, paid once), started by the module's fixture while ours run; the
three tasks' tests are one file so that `make test` (pytest-xdist, --dist loadfile) runs them on one worker with
that one process. .venv-trl is built here when missing (make)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from conftest import REPO, launch, load_bench, subprocess_env

BENCHES = {kind: load_bench(f"{kind}_vs_trl") for kind in ("dpo", "reward", "kto")}
common = load_bench("trl_compare")


def make_trl_venv() -> None:
    """.venv-trl as `make .venv-trl/.installed` makes it, typed in a shell (not nested in `make test`); .venv is
    this interpreter's, so taken as set up (-o)."""
    if (REPO / ".venv-trl" / ".installed").exists():
        return
    env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    command = ["make", "-o", ".venv/.installed", ".venv-trl/.installed"]
    make = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert make.returncode == 0, f"make .venv-trl/.installed failed:\n{(make.stdout + make.stderr)[-6000:]}"


def kinds_run(request) -> list[str]:
    """The kinds whose tests this session runs from this file (a test's name starts test_<kind>_), so that
    `-k dpo` runs TRL's DPO cases alone."""
    names = {item.originalname for item in request.session.items if item.path == request.path}
    return [kind for kind in BENCHES if any(name.startswith(f"test_{kind}_") for name in names)]


@pytest.fixture(scope="module")
def peer(request, tmp_path_factory, cache_dir):
    """`folders[kind]`: the kind's fixture folder (its bench's write_fixture); `compared(kind, case, ours_dir)`:
    the case's result (its bench's `compared`) once TRL has run it. One background process runs every case of
    every kind this file runs, awaited by the first `compared`."""
    make_trl_venv()
    from transformers import AutoTokenizer

    folders, outs, requests = {}, {}, []
    for kind in kinds_run(request):
        bench = BENCHES[kind]
        folders[kind] = bench.write_fixture(tmp_path_factory.mktemp(f"{kind}-trl"))
        for case in bench.CASES:
            outs[kind, case] = folders[kind] / f"trl-{common.label(case)}.json"
            requests.append(bench.trl_request(folders[kind], case, cache_dir, outs[kind, case]))
    proc = subprocess.Popen(
        common.batch_command(requests),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state: dict = {}

    def compared(kind: str, case, ours_dir) -> dict:
        if "output" not in state:
            try:
                state["output"] = proc.communicate(timeout=600)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                state["output"] = proc.communicate()[0] + "\n[timed out after 600 s]"
        if not outs[kind, case].exists():  # the peer writes a run's output only when the run succeeded
            failure = f"TRL's {kind} run of {common.label(case)} failed (the peer's exit code {proc.returncode})"
            pytest.fail(f"{failure}:\n{state['output'][-6000:]}")
        decode = AutoTokenizer.from_pretrained(folders[kind] / "model").decode
        return BENCHES[kind].compared(folders[kind], case, cache_dir, ours_dir, outs[kind, case], decode)

    yield SimpleNamespace(folders=folders, compared=compared)
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def ours_against_trl(peer, kind: str, case, cache_dir, tmp_path) -> dict:
    """Our one-process run of the case against TRL's: the tokens equal, every figure within its limit."""
    bench = BENCHES[kind]
    overrides = bench.ours_overrides(peer.folders[kind], case, cache_dir)
    run = launch(1, overrides, tmp_path / "ours", recipe=common.RECIPE)
    result = peer.compared(kind, case, run.output_dir)
    print("\n" + common.case_line(f"{kind} {common.label(case)}", result["rows"]))
    assert not result["token_differences"], "our tokens differ from TRL's:\n" + "\n".join(result["token_differences"])
    assert common.passed(result), [row for row in result["rows"] if not row["ok"]]
    return result


@pytest.mark.parametrize("case", BENCHES["dpo"].CASES, ids=common.label)
def test_dpo_step_one_equals_trls(peer, case, cache_dir, tmp_path):
    ours_against_trl(peer, "dpo", case, cache_dir, tmp_path)


@pytest.mark.parametrize("case", BENCHES["reward"].CASES)
def test_reward_step_one_equals_trls(peer, case, cache_dir, tmp_path):
    ours_against_trl(peer, "reward", case, cache_dir, tmp_path)


@pytest.mark.parametrize("case", BENCHES["kto"].CASES)
def test_kto_steps_equal_trls(peer, case, cache_dir, tmp_path):
    result = ours_against_trl(peer, "kto", case, cache_dir, tmp_path)
    if case == "conversational":  # step 2's KL estimate is not the clamp's 0: the estimate itself is compared
        assert next(r for r in result["rows"] if (r["step"], r["figure"]) == (2, "kl"))["trl"] > 0.1
