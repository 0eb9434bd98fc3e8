#!/usr/bin/env bash
# The llama.cpp comparison on the GPU host (a stage of scripts/gpu_check.sh): runs benchmarks/peers/run.py
# from a source checkout with the host's own torch/transformers; arguments go to run.py (see its --help).
# Needs, carried into .peers/carry/: llama.cpp-src.tar.gz and tokenizer/ (a real Qwen3 tokenizer), both written by
# benchmarks/peers/fetch_llama_cpp.sh. llama-bench is .peers/bin/llama-bench-cuda where it exists and runs here
# (unpacked first from .peers/xfer/llama-bench-cuda.xz, the compressed form `build_llama_bench.sh cuda` writes for
# carrying, where only that was carried), else it is built here (build_llama_bench.sh cuda-native, about 4.5 min
# on 16 cores) while the checkpoint is written.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
x=.peers/xfer/llama-bench-cuda
if [ ! -e .peers/bin/llama-bench-cuda ] && [ -f "$x.xz" ]; then
  mkdir -p .peers/bin
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    "$x.xz" .peers/bin/llama-bench-cuda
  chmod +x .peers/bin/llama-bench-cuda
  [ -f "$x.needs" ] && cp "$x.needs" .peers/bin/llama-bench-cuda.needs
fi
# the engine's packages the host lacks (pydantic, ...) travel as wheels in .whl/ (scripts/fetch_gpu_wheels.sh), as
# for scripts/gpu_check.sh: installed here when the engine does not import without them
if ! python3 -c 'import edgemoe.engine.model_runner' 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c 'import edgemoe.engine.model_runner' \
  || echo "run.sh: edgemoe does not import here (carry .whl/, filled by scripts/fetch_gpu_wheels.sh): its runs will fail" >&2
exec python3 benchmarks/peers/run.py "$@"
