#!/usr/bin/env bash
# GPU verification on the CUDA host: parity tests on CUDA, the bandwidth profile, the decode benchmark.
# Usage: bash scripts/gpu_check.sh [decode-benchmark args...]; results land in $OUT (default ./gpu-out).
# Runs from a source checkout without installing (PYTHONPATH), with the host's own torch/transformers.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda)'
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3'
  free -g | head -2
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "== GPU tests + native CPU kernel tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_parity.py tests/gpu tests/test_cpu_kernels.py 2>&1 \
  | tee "$OUT/pytest.log" | tail -n 15

echo "== CPU executor benchmark (read bandwidth vs B_H, Qwen3-30B-A3B expert shape)"
timeout 240 python3 benchmarks/cpu_executor.py --threads 6,16 --batch 1,8 --experts-per-call 8 --out "$OUT/cpu_executor.json" \
  2>&1 | tee "$OUT/cpu_executor.log" | tail -n 14

echo "== decode benchmark (Qwen3-30B-A3B geometry, dummy weights)"
timeout 420 python3 benchmarks/decode.py --out "$OUT" "$@" 2>&1 | tee "$OUT/decode.log" | grep -v "^{'policy'"
