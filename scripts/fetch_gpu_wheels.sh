#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels of the Python packages the GPU host lacks, so that
# `scripts/gpu_check.sh` can install them there without a network (carry `.whl` with the run).
# The GPU host has python3.12 with torch, Triton, transformers (and their dependencies: numpy, jinja2,
# safetensors, tokenizers, huggingface_hub, httpx, ...) but not the server stack: FastAPI and what it
# imports, uvicorn, prometheus-client, nvidia-ml-py (NVML). (llguidance, for structured output only, is
# left out: the release the tests use is not on the package index.)
# Every dependency is listed explicitly (--no-deps), pinned to the versions the CPU tests run with;
# binary wheels for CPython 3.12 on x86_64 Linux, pure-Python ones for any platform. About 3 MB.
#
# Usage: bash scripts/fetch_gpu_wheels.sh [DEST]      (default DEST: .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
PY=${PYTHON:-python3}
# compiled packages: CPython 3.12, manylinux x86_64
binary=(
  pydantic-core==2.46.4
)
# pure Python (py3-none-any)
pure=(
  fastapi==0.165.0
  starlette==1.10.0
  pydantic==2.13.4
  annotated-types==0.7.0
  annotated-doc==0.0.7
  typing-inspection==0.4.2
  typing-extensions==4.16.0
  opentelemetry-api==1.45.3
  anyio==4.16.0
  idna==3.20
  sniffio==1.3.1
  uvicorn==0.55.0
  h11==0.16.0
  click==8.5.1
  prometheus-client==0.26.0
  nvidia-ml-py==13.615.71
)
common=(download --quiet --no-deps --only-binary=:all: --dest "$dest" --python-version 3.12 --implementation cp)
"$PY" -m pip "${common[@]}" --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  "${binary[@]}"
"$PY" -m pip "${common[@]}" --platform any "${pure[@]}"
ls -1 "$dest"/*.whl
du -sh "$dest"
