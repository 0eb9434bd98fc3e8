#!/usr/bin/env bash
# One command from a fresh clone: install edgemoe, build the tiny random-weight Qwen3-MoE model, and
# serve it on http://127.0.0.1:8000 (OpenAI-compatible). Extra arguments go to `edgemoe serve`.
#
# Installs into $PYTHON (default: the python3 first on PATH; a virtualenv is a good idea). On Linux
# without an NVIDIA GPU, PyTorch's CPU build is installed first (a plain `pip install` would bring
# the CUDA build, several GB a CPU cannot use): a CPU wheel pip already has locally (its find-links)
# if there is one, else from $EDGEMOE_TORCH_INDEX_URL (default: PyTorch's CPU wheel index).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CPU_INDEX=${EDGEMOE_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
TORCH_REQ='torch>=2.11'  # as in pyproject.toml
say() { echo "quickstart: $*" >&2; }

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
  say "edgemoe needs Python >= 3.11 ($PY is $("$PY" -V 2>&1)); set PYTHON=/path/to/python3.11"; exit 1; }

# Installed already? edgemoe must import from this checkout with every dependency present. -P keeps the
# current directory (this checkout, where `import edgemoe` always works) off sys.path.
installed() {
  "$PY" -P - <<'EOF' 2>/dev/null
import importlib.metadata as md, os, re, sys
import edgemoe
if os.path.realpath(os.path.dirname(edgemoe.__file__)) != os.path.realpath("edgemoe"):
    sys.exit(1)
for req in md.requires("edgemoe") or []:
    if "extra ==" not in req:
        md.version(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])  # raises PackageNotFoundError
EOF
}

has_nvidia_gpu() {
  [ -e /proc/driver/nvidia/version ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
}

install_cpu_torch() {
  local wheels
  wheels=$(mktemp -d)
  if "$PY" -m pip download -q --no-index --no-deps --only-binary=:all: -d "$wheels" "$TORCH_REQ" >/dev/null 2>&1 \
      && ls "$wheels"/torch-*+cpu-*.whl >/dev/null 2>&1; then
    say "installing PyTorch's CPU build from pip's local wheels ($(basename "$wheels"/torch-*.whl))"
    "$PY" -m pip install -q "$wheels"/torch-*+cpu-*.whl
  else
    say "no NVIDIA GPU: installing PyTorch's CPU build from $CPU_INDEX (about 200 MB)"
    "$PY" -m pip install -q "$TORCH_REQ" --index-url "$CPU_INDEX"
  fi
  rm -rf "$wheels"
}

if ! installed; then
  if ! "$PY" -P -c 'import torch' 2>/dev/null && [ "$(uname -s)" = Linux ] && ! has_nvidia_gpu; then
    install_cpu_torch
  fi
  say "installing edgemoe and its dependencies (pip install -e .)"
  "$PY" -m pip install -q -e .
fi
MODEL=${EDGEMOE_DEMO_MODEL:-models/tiny}
[ -f "$MODEL/config.json" ] || "$PY" -m edgemoe make-model --arch qwen3_moe --preset tiny --out "$MODEL"
exec "$PY" -m edgemoe serve "$MODEL" "$@"
