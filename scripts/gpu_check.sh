#!/usr/bin/env bash
# GPU verification on the CUDA host: CUDA tests, kernel tests, and the benchmarks, results under $OUT.
# Usage: bash scripts/gpu_check.sh [stage ...]   stages: tests cpu decode prefill prefill-profile grouped agent policy (default: tests decode prefill)
# Extra decode-benchmark flags go in $DECODE_ARGS, prefill flags in $PREFILL_ARGS, agent flags in $AGENT_ARGS.
# Runs from a source checkout without installing (PYTHONPATH), with the host's own torch/transformers/Triton.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests decode prefill)
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3'
  free -g | head -2
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

for stage in "${stages[@]}"; do
  case "$stage" in
  tests)
    echo "== GPU tests (device decode path, Triton kernels, CUDA parity) + native CPU kernel tests"
    timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 tests/gpu \
      tests/test_parity.py tests/test_cpu_kernels.py tests/test_qwen3_5_moe.py tests/test_deepseek_v3.py ${TEST_ARGS:-} 2>&1 \
      | tee "$OUT/pytest.log" | grep -v "^SKIPPED" | tail -n 60 ;;
  cpu)
    echo "== CPU executor benchmark (read bandwidth vs B_H, Qwen3-30B-A3B expert shape)"
    timeout 240 python3 benchmarks/cpu_executor.py --threads 6,16 --batch 1,8 --experts-per-call 8 \
      --out "$OUT/cpu_executor.json" 2>&1 | tee "$OUT/cpu_executor.log" | tail -n 14 ;;
  decode)
    echo "== decode benchmark (Qwen3-30B-A3B geometry, dummy weights)"
    timeout ${DECODE_TIMEOUT:-540} python3 benchmarks/decode.py --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" \
      | grep -v "^{'policy'" | tail -n 40 ;;
  prefill)
    echo "== prefill benchmark (double-buffered layer streaming vs serialized)"
    timeout 400 python3 benchmarks/prefill.py --out "$OUT" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.log" | tail -n 30 ;;
  prefill-profile)
    echo "== prefill profile (torch.profiler, one 2-chunk prompt at the first budget)"
    timeout 300 python3 benchmarks/prefill.py --out "$OUT" --profile ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill-profile.log" | tail -n 100 ;;
  grouped)
    echo "== grouped expert GEMM (Triton kernel pair vs per-expert torch loop, Qwen3-30B-A3B geometry)"
    timeout 300 python3 benchmarks/grouped_gemm.py --out "$OUT" 2>&1 | tee "$OUT/grouped_gemm.log" | tail -n 10 ;;
  agent)
    echo "== agentic replay (Qwen3.6-35B-A3B geometry, dummy weights)"
    timeout 540 python3 benchmarks/agent_replay.py --out "$OUT" ${AGENT_ARGS:-} 2>&1 | tee "$OUT/agent.log" | tail -n 40 ;;
  policy)
    # expert-policy study: every miss policy in three routing regimes, budgets 2/6/16 GB, 6 and 16 CPU threads;
    # one decode-benchmark process per (regime, threads), realistic first, all within POLICY_SECONDS (default 540)
    echo "== expert policies x routing regimes (Qwen3-30B-A3B geometry, dummy weights)"
    traces=${POLICY_TRACES:-}
    for d in shared/fixtures/routing_traces ../shared/fixtures/routing_traces; do
      [ -z "$traces" ] && [ -d "$d" ] && traces=$(ls "$d"/*.jsonl | paste -sd, -)
    done
    common="--budgets ${POLICY_BUDGETS:-2,6,16} --policies ${POLICY_POLICIES:-qstar,auto,fill-all,cpu-all,static} \
      --tokens ${POLICY_TOKENS:-32} --warmup 8 --profile-seconds 0.5 --no-resident ${POLICY_ARGS:-}"
    deadline=$(( $(date +%s) + ${POLICY_SECONDS:-540} ))
    mkdir -p "$OUT/policy"
    for regime in realistic no-locality degenerate; do
      case "$regime" in
        realistic) [ -z "$traces" ] && { echo "   realistic: no routing traces (POLICY_TRACES), skipped"; continue; }
                   flags="--routing trace --trace $traces" ;;
        no-locality) flags="--routing model --decode-input random" ;;
        degenerate) flags="--routing model --decode-input greedy" ;;
      esac
      for threads in ${POLICY_THREADS:-6 16}; do
        left=$(( deadline - $(date +%s) ))
        [ "$left" -lt 30 ] && { echo "   $regime t$threads: out of time, skipped"; continue; }
        per=$(( left < ${POLICY_RUN_SECONDS:-110} ? left : ${POLICY_RUN_SECONDS:-110} ))
        dir="$OUT/policy/$regime-t$threads"
        echo "-- $regime, $threads threads (limit ${per}s)"
        timeout "$per" python3 benchmarks/decode.py $common $flags --cpu-threads "$threads" --out "$dir" \
          > "$dir.log" 2>&1 || echo "   exit $? (see $dir.log)"
        tail -n 17 "$dir.log" | grep "^|" || true
      done
    done
    python3 benchmarks/policy_summary.py "$OUT/policy" ;;
  *) echo "unknown stage $stage" ;;
  esac
done
