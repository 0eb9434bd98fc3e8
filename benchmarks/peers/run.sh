#!/usr/bin/env bash
# The llama.cpp comparison on the GPU host (a stage of scripts/gpu_check.sh): runs benchmarks/peers/run.py
# from a source checkout with the host's own torch/transformers; arguments go to run.py (see its --help).
# Needs, carried into .peers/carry/: llama.cpp-src.tar.gz (benchmarks/peers/fetch_llama_cpp.sh), tokenizer/
# (a real Qwen3 tokenizer) and, optionally, llama-bench-cuda (benchmarks/peers/build_llama_bench.sh cuda;
# without it, or where it cannot run, llama-bench is built on the host first, ~4.5 min on 16 cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 benchmarks/peers/run.py "$@"
