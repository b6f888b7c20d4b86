"""Loading a ~1B-parameter checkpoint: time and per-rank peak memory, one process, TP=2 and PP=2, before and
after sharded loading. GPT-J by default; `--family llama` (or qwen3, mistral, any family) a model of that
family: for the families made from transformers' plans, Llama 3.2 1B's blocks (hidden 2048, 16 blocks, 32 heads,
MLP 8192) with 2 key/value heads.

`make bench-load` (`make bench-load ARGS="--family llama"`): writes the checkpoint once (random weights, fp16
safetensors as GPT-J's float16 revision, a tokenizer learned from the SST-2 sample) into .cache/, then under
torchrun each layout loads it twice:
- before: what the trainer did until sharded loading existed: `from_pretrained(dtype=float32)` on every rank, the
  whole model moved to the device, then tensor-parallelised (or, with pipeline stages, cut) there;
- after: the trainer's own setup (built on meta, each rank allocates and reads only its shards).
Memory is the peak RSS of each rank (VmHWM) when the model is ready, above the same process just before loading.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from parallel_finetune.launch import torchrun_command  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# hidden, blocks, heads of the written checkpoint: GPT-J's ~1B as before; any other family Llama 3.2 1B's blocks
SHAPES = {"gptj": (2048, 20, 16)}
DEFAULT_SHAPE = (2048, 16, 32)
LAYOUTS = {
    "1 process": (1, []),
    "TP=2": (2, ["tensor_parallel_degree=2"]),
    "PP=2": (2, ["tensor_parallel_degree=1", "pipeline_parallel_degree=2"]),
}


def worker(mode: str, family_name: str, folder: str, out: str, overrides: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from parallel_finetune.loop.builder import RunBuilder
    from parallel_finetune.parallel.hardware import peak_memory_mib
    from parallel_finetune.resolve import load_config

    config = load_config(
        None,
        [
            f"family={family_name}",
            "size=full",
            f"model={folder}",
            "precision=fp32",
            "export=false",
            f"output_dir={out}",
            "overwrite=true",
            "resume=none",
            *overrides,
        ],
    )
    if mode == "after":
        parts = RunBuilder(config).build()
        ready = parts.ready
        before, after, seconds = ready.memory_before_load_mib, ready.load_peak_mib, ready.load_seconds
        layout = parts.layout
    else:
        from transformers import AutoModelForSequenceClassification

        from parallel_finetune.families import get_family
        from parallel_finetune.parallel.layout import init_distributed
        from parallel_finetune.parallel.pipeline import cut_model, plan_stages
        from parallel_finetune.parallel.tensor import apply_tp

        layout = init_distributed("auto", config.tensor_parallel_degree, pp=config.pipeline_parallel_degree)
        family = get_family(family_name)
        before, started = peak_memory_mib(layout.device), time.perf_counter()
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=torch.float32, num_labels=2, trust_remote_code=False
        )
        model.to(layout.device)
        if layout.pp > 1:
            stages = plan_stages(model, family, layout.pp, 1, "auto")
            cut_model(model, family, [s for s in stages if s.index % layout.pp == layout.pp_rank])
        apply_tp(model, family, layout.tp_mesh)
        seconds, after = time.perf_counter() - started, peak_memory_mib(layout.device)
    result = [None] * layout.world_size
    dist.all_gather_object(result, {"extra_mib": after - before, "seconds": seconds})
    if layout.rank == 0:
        Path(out, "load.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure(mode: str, family: str, layout: str, folder: Path, work: Path) -> list[dict]:
    nproc, overrides = LAYOUTS[layout]
    out = work / f"{family}-{mode}-{layout.replace(' ', '').replace('=', '')}"
    out.mkdir(parents=True, exist_ok=True)
    data = [f"data_dir={REPO / 'src' / 'parallel_finetune' / 'sample_data'}", f"cache_dir={work / 'cache'}"]
    command = torchrun_command(nproc, __file__, "--worker", mode, family, str(folder), str(out), *overrides, *data)
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"{mode} {layout} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads((out / "load.json").read_text())


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gptj", help="the family of the checkpoint (default gptj)")
    parser.add_argument("--hidden", type=int, help="width (default 2048)")
    parser.add_argument("--layers", type=int, help="blocks (default 20 for GPT-J, 16 otherwise)")
    parser.add_argument("--heads", type=int, help="attention heads (default 16 for GPT-J, 32 otherwise)")
    parser.add_argument("--work", type=Path, default=REPO / ".cache" / "bench-load")
    args = parser.parse_args()
    shape = SHAPES.get(args.family, DEFAULT_SHAPE)
    hidden, layers, heads = (given or default for given, default in zip((args.hidden, args.layers, args.heads), shape))
    from parallel_finetune.data.prepare import column, read_glue_dir
    from parallel_finetune.model.synthetic import write_checkpoint
    from parallel_finetune.tools.planner import model_shape

    folder = args.work / f"{args.family}-h{hidden}-l{layers}-a{heads}-float16"
    if not (folder / "config.json").is_file():
        print(f"writing {folder} ...", flush=True)
        sentences = column(read_glue_dir(REPO / "src" / "parallel_finetune" / "sample_data")["train"], "text")
        write_checkpoint(
            folder, args.family, sentences, hidden=hidden, layers=layers, heads=heads, dtype="float16", vocab_size=512
        )
    whole = 4 * model_shape(str(folder), "classification").total
    config = json.loads((folder / "config.json").read_text())
    print(
        f"{config['model_type']} {model_shape(str(folder)).total / 1e9:.2f}B parameters "
        f"(hidden {hidden}, {layers} blocks, {heads} heads, "
        f"{config.get('num_key_value_heads', heads)} key/value heads), fp16 files "
        f"({sum(f.stat().st_size for f in folder.glob('*.safetensors')) / 2**30:.2f} GiB), "
        f"{whole / 2**30:.2f} GiB as fp32 master weights\n"
    )
    print(f"{'layout':<10} {'loading':<7} {'seconds':>8} {'peak extra per rank (MiB)':>28} {'x model':>8}")
    for layout in LAYOUTS:
        for mode in ("before", "after"):
            ranks = measure(mode, args.family, layout, folder, args.work)
            extra = [rank["extra_mib"] for rank in ranks]
            print(
                f"{layout:<10} {mode:<7} {max(r['seconds'] for r in ranks):>8.1f} "
                f"{', '.join(f'{e:,.0f}' for e in extra):>28} {max(extra) * 2**20 / whole:>8.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
