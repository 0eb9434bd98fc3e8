#!/usr/bin/env bash
# The llama.cpp comparison on the GPU host (a stage of scripts/gpu_check.sh): runs benchmarks/peers/run.py
# from a source checkout with the host's own torch/transformers; arguments go to run.py (see its --help).
# Needs, carried into .peers/carry/: llama.cpp-src.tar.gz and tokenizer/ (a real Qwen3 tokenizer), both written by
# benchmarks/peers/fetch_llama_cpp.sh. llama-bench is .peers/bin/llama-bench-cuda where it exists and runs here,
# else it is built here (build_llama_bench.sh cuda-native, about 4.5 min on 16 cores) while the checkpoint is written.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 benchmarks/peers/run.py "$@"
