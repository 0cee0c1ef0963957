#!/usr/bin/env bash
# The GPU check (docs/gpu.md): the trainer, a data-parallel rank, a LoRA adapter and the model-mode stand-in server
# on CUDA, checked against the CPU; results in $OUT/gpu-check.json and gpu-check.log ($OUT: runs/gpu-check if unset).
#   scripts/gpu-check.sh --prepare      here, before a GPU machine is lent: the wheels its image lacks (Python 3.12)
#                                       into .gpu-check/wheels, the folder a device call carries
#   scripts/gpu-check.sh                on the GPU machine: unpacks those wheels beside the image's packages (no
#                                       network, no pip needed) and runs the check (a few minutes)
#   scripts/gpu-check.sh --cpu-dry-run  here: the same check on the CPU with tiny sizes (.venv; CI runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu-check}
wheels=.gpu-check/wheels
# What the GPU image (torch, transformers, peft, pyarrow, safetensors, aiohttp, numpy) lacks of what the checked
# modules import; the versions are this checkout's venv's, so both sides run the same code.
missing=(pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson xxhash prometheus-client)

case "${1:-}" in
  --prepare)
    rm -rf "$wheels" && mkdir -p "$wheels"
    pins=$(.venv/bin/python -c 'import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' "${missing[@]}")
    # shellcheck disable=SC2086
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$wheels" $pins
    echo "[gpu-check] $(ls "$wheels" | wc -l) wheels, $(du -sh "$wheels" | cut -f1) in $wheels: carry .gpu-check"
    ;;
  --cpu-dry-run)
    PYTHONPATH=$PWD exec .venv/bin/python scripts/gpu_check.py --cpu-dry-run --out "$out"
    ;;
  "")
    site=$(mktemp -d)
    [ -d "$wheels" ] || { echo "[gpu-check] no $wheels: run scripts/gpu-check.sh --prepare where PyPI is reachable" >&2; exit 2; }
    for wheel in "$wheels"/*.whl; do python3 -m zipfile -e "$wheel" "$site"; done
    PYTHONPATH=$PWD:$site exec python3 scripts/gpu_check.py --out "$out"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh [--prepare | --cpu-dry-run]" >&2; exit 2 ;;
esac
