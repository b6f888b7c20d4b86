#!/usr/bin/env bash
# The GPU check on a machine with one CUDA GPU, its own python3 and torch, and no network (docs/benchmarks.md, "The
# GPU check"): installs .gpu-bundle/ (made by `make gpu-bundle` on a networked machine) into a folder of its own,
# then runs bench/gpu.py on that machine's torch. Usage, from the checkout's root:
#     bash bench/gpu_check.sh [OUT_FOLDER] [bench/gpu.py options, e.g. --rows setup varlen-logits]
# OUT_FOLDER (default runs/bench/gpu) receives gpu.md, gpu.json and gpu.log; models and runs go to GPU_CHECK_WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/bench/gpu}
shift || true
python=${PYTHON:-python3}
site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
work=${GPU_CHECK_WORK:-/tmp/gpu-check-work}
if ! ls .gpu-bundle/wheels/*.whl >/dev/null 2>&1; then
	echo "error: no .gpu-bundle/wheels/*.whl here: run \`make gpu-bundle\` on a machine with network and copy the checkout" >&2
	exit 2
fi
# --no-deps: the bundle holds exactly what the machine lacks; the image's torch, numpy, pandas, pyarrow stay its own.
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu-bundle/wheels/*.whl
export PYTHONPATH="$PWD/src:$site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# What the bundle's wheels take from the image (their pins: datasets pyarrow>=24, fsspec<=2026.9.0; transformers
# huggingface-hub>=1.31, regex>=2025.10.22): said first, so that a mismatch reads as such in the log.
"$python" -m pip list 2>/dev/null | grep -iE '^(torch|numpy|pyarrow|fsspec|regex|huggingface.hub|accelerate|safetensors|pandas) ' || true
exec "$python" bench/gpu.py --out "$out" --work "$work" "$@"
