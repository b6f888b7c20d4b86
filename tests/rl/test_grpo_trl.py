"""task=grpo against TRL's GRPOTrainer end to end (trl==1.16.0 in .venv-trl, a test peer only, never a dependency):
on the same tiny Llama, 4 chat prompts x 4 GIVEN completions (TRL's _generate_single_turn replaced, ours in the
fixed-rollouts mode), the length reward and a user's reward file (the same function on both sides), steps 1 and 2
give the same loss, reward metrics, completion metrics, clip ratios, kl and gradient norm, from the same token ids,
for loss_type grpo, dr_grpo and dapo with beta 0 (full fine-tuning, num_iterations 2: step 2's ratio moves off 1 and
clips) and beta 0.04 (LoRA from the same adapter, num_iterations 1: step 2's kl > 0). All six TRL runs go in one
background process while ours run. The comparison is bench/grpo_vs_trl.py's (`make bench-grpo-trl`)."""

from __future__ import annotations

import json
import subprocess

from conftest import REPO, launch, load_bench, subprocess_env

bench = load_bench("grpo_vs_trl")


def test_grpo_steps_equal_trls(tmp_path, cache_dir):
    if not bench.TRL_PYTHON.exists():  # made as test_dpo_trl makes it (.venv taken as set up)
        env = {k: v for k, v in subprocess_env().items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
        command = ["make", "-o", ".venv/.installed", ".venv-trl/.installed"]
        make = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert make.returncode == 0, f"make .venv-trl/.installed failed:\n{(make.stdout + make.stderr)[-6000:]}"
    folder = bench.write_fixture(tmp_path / "fixture")
    trl_out = tmp_path / "trl.json"
    proc = subprocess.Popen(
        bench.trl_command(folder, trl_out),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for n, run in enumerate(bench.RUNS):
            overrides = bench.ours_overrides(folder, run, cache_dir)
            launch(1, overrides, tmp_path / f"ours-{n}", script=str(bench.WORKER), recipe=bench.RECIPE)
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"TRL's GRPOTrainer failed ({proc.returncode}):\n{output[-6000:]}"
    peer = json.loads(trl_out.read_text())
    results = [bench.result_of(run, tmp_path / f"ours-{n}", peer["runs"][n]) for n, run in enumerate(bench.RUNS)]
    print("\n" + bench.markdown_table(results, peer["trl_version"]))
    for result in results:
        assert not result["token_differences"], (result["run"], result["token_differences"])
        assert all(row["ok"] for row in result["rows"]), [row for row in result["rows"] if not row["ok"]]
        figures = {(row["step"], row["figure"]) for row in result["rows"]}
        assert (1, "reward") in figures and (2, "loss") in figures and (2, "grad_norm") in figures, figures
    by_run = {result["run"]: {(r["step"], r["figure"]): r["trl"] for r in result["rows"]} for result in results}
    # what makes the comparison test something: step 2 clips (beta 0) and measures a kl > 0 (beta 0.04)
    assert by_run["dapo beta 0"][2, "clip_ratio/region_mean"] > 0.1
    assert by_run[f"dapo beta {bench.BETA}"][2, "kl"] > 1e-3
