"""`python -m parallel_finetune.selftest` (`make selftest`): proves, on the machine it runs on, that every parallel
layout trains exactly like one process, before a cluster is paid for.

On a GPU node it runs with nccl on the GPUs, on a CPU with gloo; nothing else differs. Tiny models on the SST-2
sample shipped with the package, fp32, dropout off, a few steps each under torchrun: tensor, pipeline and sharded
data parallelism and pipeline x tensor against one process; fp16 with an overflow planted on one rank (every rank
must skip that step and halve the loss scale, as one process does); and a full-size-style load of a checkpoint
written here (random weights, safetensors), whose shards must equal the file. Prints a table and a verdict; exit
status 0 only if everything agrees.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .launch import torchrun_command

if TYPE_CHECKING:
    from .config import Config

TOLERANCE = 1e-5  # fp32: measured differences are ~1e-7 (summation order); a real bug moves losses by far more
FP16_TOLERANCE = 5e-3  # fp16 rounds each matmul to 11 significant bits: another reduction order differs more
INJECT_STEP = 2
WORKER_FLAG = "--worker"


@dataclass
class Check:
    name: str
    family: str
    nproc: int
    overrides: list[str]
    task: str = "classification"
    reference: str = ""  # the check this one is compared with ("" = it is a reference)
    fp16_overflow: bool = False
    full_size: bool = False


def checks() -> list[Check]:
    gptj, gpt2_lm = "gptj 1 process", "gpt2 causal_lm 1 process"
    rows = [
        Check(gptj, "gptj", 1, []),
        Check("gptj tp=2", "gptj", 2, ["tensor_parallel_degree=2"], reference=gptj),
        Check(
            "gptj pp=2 (1f1b)", "gptj", 2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"], reference=gptj
        ),
        Check("gptj fsdp dp=2", "gptj", 2, ["tensor_parallel_degree=1", "sharding=full"], reference=gptj),
        Check("gptj zero-1 dp=2", "gptj", 2, ["tensor_parallel_degree=1", "sharding=optimizer"], reference=gptj),
        Check(
            "gptj pp=2 x tp=2", "gptj", 4, ["tensor_parallel_degree=2", "pipeline_parallel_degree=2"], reference=gptj
        ),
        Check(gpt2_lm, "gpt2", 1, [], task="causal_lm"),
        Check(
            "gpt2 causal_lm pp=2 (tied embedding on both ends)",
            "gpt2",
            2,
            ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"],
            task="causal_lm",
            reference=gpt2_lm,
        ),
        Check("gpt2 causal_lm tp=2", "gpt2", 2, ["tensor_parallel_degree=2"], task="causal_lm", reference=gpt2_lm),
        Check("fp16 overflow 1 process", "gptj", 1, ["precision=fp16"], fp16_overflow=True),
        Check(
            "fp16 overflow tp=2",
            "gptj",
            2,
            ["precision=fp16", "tensor_parallel_degree=2"],
            fp16_overflow=True,
            reference="fp16 overflow 1 process",
        ),
        Check("full-size load 1 process", "gptj", 1, [], full_size=True),
        Check(
            "full-size load tp=2",
            "gptj",
            2,
            ["tensor_parallel_degree=2"],
            full_size=True,
            reference="full-size load 1 process",
        ),
        Check(
            "full-size load pp=2",
            "gptj",
            2,
            ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"],
            full_size=True,
            reference="full-size load 1 process",
        ),
    ]
    return rows


def sample_data() -> Path:
    return Path(__file__).resolve().parent / "sample_data"


def run_folder(check: Check, work: Path) -> Path:
    return work / "runs" / re.sub(r"[^a-z0-9]+", "-", check.name.lower()).strip("-")


def overrides(check: Check, work: Path, model: Path | None) -> list[str]:
    values = {
        "family": check.family,
        "task": check.task,
        "size": "full" if check.full_size else "tiny",
        "data_dir": sample_data(),
        "cache_dir": work / "cache",
        "precision": "fp32",
        "max_steps": 5,
        "batch_size": 8,
        "max_length": 64,
        "eval_batch_size": 32,
        "lr": 1e-3,
        "warmup_ratio": 0,
        "log_every": 1,
        "export": "false",
        "resume": "none",
        "output_dir": run_folder(check, work),
    }
    if model is not None:
        values["model"] = model
    dropout_off = (
        []
        if check.full_size or check.family != "gpt2"
        else ["model_config.resid_pdrop=0", "model_config.embd_pdrop=0", "model_config.attn_pdrop=0"]
    )
    return [f"{key}={value}" for key, value in values.items()] + dropout_off + check.overrides


def launch(check: Check, work: Path, model: Path | None) -> tuple[Path, str]:
    arguments = overrides(check, work, model)
    settings = {"overrides": arguments, "fp16_overflow": check.fp16_overflow, "export_loaded": check.full_size}
    command = torchrun_command(check.nproc, "-m", "parallel_finetune.selftest", WORKER_FLAG, json.dumps(settings))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{check.name}: exit {proc.returncode}\n" + (proc.stdout + proc.stderr)[-3000:])
    return run_folder(check, work), proc.stdout + proc.stderr


def export_as_loaded(built, config: Config) -> None:
    """Into the run folder's `loaded/`, the weights as loaded into every rank's shards (`built`: builder.BuiltRun):
    called after the first step's backward, before any update (the selftest and tests/test_full_size.py compare
    it with the file)."""
    from .outputs.export import ExportPlace, export_model

    trainer = built.trainer
    export_model(
        trainer.updates,
        built.data.tokenizer,
        trainer.layout,
        ExportPlace(built.output_dir, built.output_dir / "loaded"),
        model=config.model,
        peft=config.peft,
        resolved=built.resolved,
        saved_initial=built.saved_initial,
    )


def worker(spec: dict) -> int:
    """One torchrun rank: a normal run, with the selftest's hooks."""
    from .loop.run import run
    from .parallel.gradients import local
    from .resolve import load_config

    config = load_config(None, spec["overrides"])

    def after_backward(built, step: int) -> None:
        trainer = built.trainer
        if spec["export_loaded"] and step == 1:  # every rank still holds the pretrained values
            export_as_loaded(built, config)
        if spec["fp16_overflow"] and step == INJECT_STEP and trainer.layout.rank == trainer.layout.world_size - 1:
            # the last rank (last pipeline stage): an inf in a replicated weight's gradient, that no collective
            # of the model would carry to the other ranks; only the agreed skip decision can
            local(trainer.model.transformer.ln_f.weight.grad)[0] = float("inf")

    # As train.main: the imports' objects frozen, so the exit does not collect them (a rank once aborted there,
    # "terminate called without an active exception", after its run had finished and written everything)
    gc.freeze()
    run(config, after_backward=after_backward)
    gc.freeze()
    return 0


def records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def overflow_skipped(ours: list[dict]) -> tuple[str, bool]:
    """The planted overflow's step, and it alone, skipped; the loss scale halved there."""
    skipped = [r["step"] for r in ours if r["skipped"]]
    scales = [r["loss_scale"] for r in ours]
    halved = len(scales) > INJECT_STEP and scales[INJECT_STEP] == scales[INJECT_STEP - 1] / 2
    return f"skipped steps {skipped}, loss scale {scales[0]:g} -> {scales[-1]:g}", skipped == [INJECT_STEP] and halved


def check_reference(check: Check, mine: Path, model: Path | None) -> tuple[str, bool]:
    """A one-process run proves what it can alone: the planted overflow skipped, the loaded weights the file's."""
    details, ok = ["reference"], True
    if check.fp16_overflow:
        detail, skipped = overflow_skipped(records(mine))
        details.append(detail)
        ok = ok and skipped
    if check.full_size:
        equal, total = weights_equal_file(mine / "loaded", model)
        details.append(f"{equal}/{total} tensors equal the file")
        ok = ok and equal == total
    return "; ".join(details), ok


def compare(check: Check, mine: Path, theirs: Path, model: Path | None) -> tuple[str, bool]:
    ours, reference = records(mine), records(theirs)
    difference = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, reference))
    tolerance = FP16_TOLERANCE if check.fp16_overflow else TOLERANCE
    summary, reference_summary = (json.loads((p / "summary.json").read_text()) for p in (mine, theirs))
    eval_difference = abs(summary["eval_loss"] - reference_summary["eval_loss"])
    ok = len(ours) == len(reference) and difference < tolerance and eval_difference < tolerance
    detail = f"max |loss difference| {difference:.1e}, eval loss {eval_difference:.1e} (< {tolerance:g})"
    if check.fp16_overflow:
        skip_detail, skipped = overflow_skipped(ours)
        same_scales = [r["loss_scale"] for r in ours] == [r["loss_scale"] for r in reference]
        ok = ok and skipped and same_scales
        detail += "; " + skip_detail
    if check.full_size:
        equal, total = weights_equal_file(mine / "loaded", model)
        ok = ok and equal == total
        detail += f"; {equal}/{total} tensors equal the file"
    return detail, ok


def weights_equal_file(exported: Path, model: Path) -> tuple[int, int]:
    import torch
    from safetensors.torch import load_file

    ours, source = load_file(exported / "model.safetensors"), load_file(model / "model.safetensors")
    shared = [key for key in source if key in ours]
    return sum(torch.equal(ours[key], source[key].float()) for key in shared), len(shared)


def write_model(work: Path) -> Path:
    from .data.prepare import column, read_glue_dir
    from .model.synthetic import write_checkpoint

    sentences = column(read_glue_dir(sample_data())["train"], "text")
    return write_checkpoint(work / "pretrained-gptj", "gptj", sentences, hidden=128, layers=4, heads=4, vocab_size=512)


def devices_here() -> tuple[int, str]:
    """How many processes a check may start here (nccl gives each its own GPU), and what to call this machine."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count(), f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, nccl"
    return 4, f"CPU ({os.cpu_count()} cores), gloo, 4 processes at most"


def run_checks(rows: list[Check], devices: int, work: Path) -> list[tuple[Check, str, bool | None]]:
    """(check, detail, ok) per row; ok None: not run, the check needs more GPUs than this machine has."""
    model = write_model(work)
    done: dict[str, Path] = {}
    results: list[tuple[Check, str, bool | None]] = []
    for check in rows:
        if check.nproc > devices:
            results.append((check, f"not run: needs {check.nproc} GPUs, this machine has {devices}", None))
            continue
        begun = time.perf_counter()
        try:
            done[check.name], _ = launch(check, work, model if check.full_size else None)
        except RuntimeError as exc:
            results.append((check, "run failed: " + str(exc).splitlines()[0], False))
            print(str(exc), file=sys.stderr)
            continue
        if not check.reference:
            detail, ok = check_reference(check, done[check.name], model)
        elif check.reference not in done:
            results.append((check, f"no reference ({check.reference} failed)", False))
            continue
        else:
            detail, ok = compare(check, done[check.name], done[check.reference], model)
        results.append((check, f"{detail} [{time.perf_counter() - begun:.0f} s]", ok))
        print(f"  {'ok  ' if ok else 'FAIL'} {check.name}: {detail}", flush=True)
    return results


def verdict(results: list[tuple[Check, str, bool | None]], seconds: float, where: str) -> tuple[str, bool]:
    ran = [ok for _, _, ok in results if ok is not None]
    not_run = len(results) - len(ran)
    layouts_checked = any(check.reference and ok is not None for check, _, ok in results)
    passed = all(ran)
    if not passed:
        what = "see the rows marked FAIL"
    elif not layouts_checked:
        what = (
            f"the one-process runs train here, but no parallel layout was checked ({not_run} need 2 or 4 GPUs): "
            "run it on a node with them"
        )
    else:
        what = "every layout trains like one process" + (
            f" ({not_run} layouts not run: they need more GPUs than this machine has)" if not_run else ""
        )
    return f"verdict: {'PASS' if passed else 'FAIL'} ({len(ran)} runs in {seconds:.0f} s on {where}): {what}", passed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKER_FLAG]:
        return worker(json.loads(argv[1]))
    parser = argparse.ArgumentParser(prog="parallel_finetune.selftest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", type=Path, help="keep the runs in this folder (default: a temporary one)")
    args = parser.parse_args(argv)
    devices, where = devices_here()
    rows = checks()
    started = time.perf_counter()
    print(f"selftest on {where}: {sum(row.nproc <= devices for row in rows)} of {len(rows)} runs", flush=True)
    with tempfile.TemporaryDirectory(prefix="selftest-") as temporary:
        work = args.keep or Path(temporary)
        work.mkdir(parents=True, exist_ok=True)
        results = run_checks(rows, devices, work)
    width = max(len(check.name) for check, _, _ in results)
    marks = {True: "ok  ", False: "FAIL", None: "--  "}
    print(
        "\n"
        + "\n".join(
            f"{check.name:<{width}}  {check.nproc} proc  {marks[ok]}  {detail}" for check, detail, ok in results
        )
    )
    line, passed = verdict(results, time.perf_counter() - started, where)
    print("\n" + line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
