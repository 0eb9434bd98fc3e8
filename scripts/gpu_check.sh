#!/usr/bin/env bash
# GPU verification on the CUDA host: CUDA tests, kernel tests, and the benchmarks, results under $OUT.
# Usage: bash scripts/gpu_check.sh [stage ...]   stages: tests cpu cpu-formats threads threads-decode batches decode
#        formats formats-prefill gemv-sweep cpu-profile cpu-decode prefill prefill-profile profile-decode grouped agent structured families peers doorbell elastic policy contention
#        laptop   (default: tests decode prefill)
# peers (the llama.cpp comparison; carry .peers/carry and .whl) does what is still missing within $PEERS_DEADLINE seconds
# (default 540): builds llama-bench (resuming a stopped build) while it writes the checkpoint pair into .peers/,
# then the llama-bench and decode.py runs; results go to $OUT (peers.md, peers.json, peers-results.tar.gz) as runs
# finish. Two calls of one warm machine complete it (docs/benchmarks/peers.md).
# Extra decode-benchmark flags go in $DECODE_ARGS, prefill flags in $PREFILL_ARGS, agent flags in $AGENT_ARGS,
# llama.cpp-comparison flags (benchmarks/peers/run.py) in $PEERS_ARGS, per-format decode flags in $FORMATS_ARGS
# (formats: bf16 / FP8 / MXFP4 / NVFP4 experts at equal expert VRAM, those in $FORMATS_QUANTS, within $FORMATS_TIMEOUT
# seconds, default 520),
# elastic flags in $ELASTIC_ARGS, laptop-case flags (benchmarks/laptop.py) in $LAPTOP_ARGS.
# laptop (Qwen3.6-35B-A3B geometry, NVFP4 experts, an 8 GB budget for all the GPU memory, 6 CPU threads, served
# over HTTP): carry .whl (scripts/fetch_gpu_wheels.sh fills it: the host lacks the server's packages).
# policy (the expert-policy study, docs/benchmarks/policy.md): $POLICY_* variables, see the stage.
# Runs from a source checkout without installing (PYTHONPATH), with the host's own torch/transformers/Triton.
# More than 8 result files are packed into $OUT/results.tar.gz at the end (the device tool returns 8 at most).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# packages the host lacks (pydantic, FastAPI, uvicorn, llguidance...) travel as wheels in .whl/ (carried)
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" || { echo "installing .whl/ failed" >&2; exit 1; }
fi
# a result folder of its own for a tree named twice in a stage: $1 if it does not exist yet, else $1-2, $1-3, ...
fresh_dir() { local n=2; [ -e "$1" ] || { echo "$1"; return; }; while [ -e "$1-$n" ]; do n=$((n + 1)); done; echo "$1-$n"; }
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests decode prefill)
{
  date -u +%FT%TZ
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|NUMA node\(s\)|L3'
  free -g | head -2
  echo "kernel $(uname -r)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# the native CPU kernels compile once, here, outside any stage's timeout (a stage killed mid-build wasted its time)
python3 -c 'from edgemoe.experts import native; r = native.build()
print("native CPU kernels:", r.error or "%.1f s, cached %s, %s" % (r.seconds, r.cached, r.builder))' 2>&1 \
  | tee -a "$OUT/machine.txt"
# whether this host's GPU runs a side-stream copy under kernels at all (streamed prefill and fills rely on it;
# on 2026-12-05 the same streamed prefill ran at its copy bound on one H100 host and at about copies plus compute
# on another)
timeout 60 python3 benchmarks/overlap_probe.py 2>&1 | tail -n 1 | tee -a "$OUT/machine.txt"

for stage in "${stages[@]}"; do
  case "$stage" in
  tests)
    echo "== GPU tests (device decode path, Triton kernels, CUDA parity) + native CPU kernel tests"
    # $TEST_PATHS replaces the default selection (e.g. only the files a change touches); the whole default
    # selection was 92 % done after 420 s on an H200 host (2026-12-05): run it alone in a call of 600 s
    timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -rfE --durations=15 ${TEST_PATHS:-tests/gpu \
      tests/test_parity.py tests/test_cpu_kernels.py tests/test_cpu_quant_kernels.py tests/test_qwen3_5_moe.py \
      tests/test_deepseek_v3.py} ${TEST_ARGS:-} 2>&1 \
      | tee "$OUT/pytest.log" | grep -v "^SKIPPED" | tail -n 60 ;;
  cpu)
    echo "== CPU executor benchmark (read bandwidth vs B_H, Qwen3-30B-A3B expert shape)"
    timeout 240 python3 benchmarks/cpu_executor.py --threads 6,16 --batch 1,8 --experts-per-call 8 \
      --out "$OUT/cpu_executor.json" 2>&1 | tee "$OUT/cpu_executor.log" | tail -n 14 ;;
  cpu-formats)
    echo "== native CPU kernels per expert format: tests, then B_H in packed GB/s vs the read test at 6 and 15 threads"
    # $CPU_FORMATS_TESTS=0 skips the kernel tests (a call that measures a tree whose tests ran already)
    [ "${CPU_FORMATS_TESTS:-1}" = 0 ] || timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_cpu_quant_kernels.py \
      2>&1 | tee "$OUT/cpu-formats-tests.log" | tail -n 3
    # $CPU_FORMATS_TREES: source trees measured in turn, each with its own kernels (as $CPU_PROFILE_TREES; a tree
    # named twice is measured twice); $CPU_FORMATS_VARIANTS: ';'-separated build flag sets (EDGEMOE_NATIVE_CFLAGS)
    # measured in turn within each tree ('-': the caller's own, if any); $CPU_FORMATS_ARGS replaces the thread and batch lists;
    # $CPU_FORMATS_EXPERTS: experts per call, a list (default 8; a decode layer sends 1-4 to the CPU)
    i=0
    IFS=';' read -r -a variants <<< "${CPU_FORMATS_VARIANTS:--}"
    for tree in ${CPU_FORMATS_TREES:-.}; do
      for variant in "${variants[@]}"; do
        i=$((i + 1)); name=$(basename "$(realpath "$tree")")
        [ "$variant" = "-" ] && variant="${EDGEMOE_NATIVE_CFLAGS:-}"  # '-': the caller's flags, if any
        echo "-- tree $tree, build flags '${variant}' (run $i)"
        EDGEMOE_NATIVE_CFLAGS="$variant" timeout ${CPU_FORMATS_TIMEOUT:-150} python3 "$tree/benchmarks/cpu_executor.py" \
          --format ${CPU_FORMATS_FORMATS:-bf16,fp8,mxfp4,nvfp4} ${CPU_FORMATS_ARGS:---threads 6,15 --batch 1,8} \
          --experts-per-call ${CPU_FORMATS_EXPERTS:-8} --executors native \
          --out "$OUT/cpu_formats$( [ -n "${CPU_FORMATS_TREES:-}${CPU_FORMATS_VARIANTS:-}" ] && echo "-$i-$name").json" 2>&1 \
          | tee -a "$OUT/cpu-formats.log" | grep -E '^ *(bf16|fp8|mxfp4|nvfp4) |pool:|trace \('
      done
    done ;;
  threads)
    echo "== native executor B_H per thread count (1..cores), planned vs as asked, alone and beside 1 busy process"
    for sp in 0 1; do
      timeout 280 python3 benchmarks/thread_scaling.py executor --spinners $sp --seconds 0.5 --out "$OUT/threads-exec-s$sp" \
        2>&1 | tee "$OUT/threads-exec-s$sp.log" | tail -n 70
    done ;;
  threads-decode)
    echo "== decode tokens/s per CPU thread count (16-layer Qwen3-30B-A3B geometry, 2.42 GB expert cache)"
    timeout ${THREADS_TIMEOUT:-580} python3 benchmarks/thread_scaling.py decode --layers 16 --budgets 2.42 \
      --policies qstar,cpu-all --plans planned,as-asked --tokens 32 --warmup 8 --out "$OUT/threads-decode" ${THREADS_ARGS:-} 2>&1 \
      | tee "$OUT/threads-decode.log" | tail -n 45 ;;
  batches)
    echo "== decode throughput at batch 1/4/16/64 (16-layer Qwen3-30B-A3B geometry, uniform routing)"
    timeout ${BATCHES_TIMEOUT:-580} python3 benchmarks/decode.py --layers 16 --budgets 2.42,6.04 --policies qstar \
      --batch-sizes 1,4,16,64 --tokens 32 --out "$OUT/batches" ${BATCHES_ARGS:-} 2>&1 | tee "$OUT/batches.log" \
      | grep -v "^{'policy'" | tail -n 20 ;;
  decode)
    echo "== decode benchmark (Qwen3-30B-A3B geometry, dummy weights)"
    timeout ${DECODE_TIMEOUT:-540} python3 benchmarks/decode.py --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" \
      | grep -v "^{'policy'" | tail -n 40 ;;
  formats)
    echo "== decode per expert format at equal expert VRAM (Qwen3-30B-A3B geometry, dummy weights, uniform routing)"
    deadline=$((SECONDS + ${FORMATS_TIMEOUT:-520}))  # the whole stage, comparison included
    runs=()
    # $FORMATS_TREES: source trees run in turn per format (default this one; another, e.g. an earlier kernel's
    # `git archive` in an ignored folder, gives a before/after on one GPU: its folders are FORMAT@TREE)
    for q in ${FORMATS_QUANTS:-bf16 fp8 mxfp4 nvfp4-modelopt}; do
      for tree in ${FORMATS_TREES:-.}; do
        left=$((deadline - SECONDS - 15)); [ $left -gt 200 ] && left=200
        [ $left -lt 30 ] && { echo "formats: no time left for $q ($tree)"; continue; }
        flag=(); [ "$q" != bf16 ] && flag=(--quant "$q")
        name=$q; [ "$tree" != . ] && name="$q@$(basename "$(realpath "$tree")")"
        name=$(basename "$(fresh_dir "$OUT/formats/$name")")
        timeout $left python3 "$tree/benchmarks/decode.py" "${flag[@]}" --budgets 2,4,8 --policies qstar,fill-all \
          --cpu-threads 6,15 --tokens 24 --warmup 6 --profile-seconds 0.5 --out "$OUT/formats/$name" ${FORMATS_ARGS:-} \
          2>&1 | tee "$OUT/formats-$name.log" | grep -v "^{'policy'" | tail -n 16
        [ -f "$OUT/formats/$name/decode.json" ] && runs+=("$OUT/formats/$name")
      done
    done
    [ ${#runs[@]} -gt 0 ] && python3 benchmarks/decode.py --compare "${runs[@]}" --out "$OUT/formats" 2>&1 \
      | tee "$OUT/formats.log" ;;
  gemv-sweep)
    echo "== decode expert GEMV tiles (Qwen3-30B-A3B MoE layer, batch 1): float and packed formats"
    # $GEMV_QUANTS: formats (default all four); $GEMV_TREES: source trees run in turn (default this one; another,
    # e.g. an earlier kernel in an ignored folder, gives a before/after on one GPU); $GEMV_ARGS: more flags
    for tree in ${GEMV_TREES:-.}; do
      echo "-- tree $tree"
      timeout ${GEMV_TIMEOUT:-240} python3 "$tree/benchmarks/expert_gemv_sweep.py" --quant "${GEMV_QUANTS:-bf16,fp8,mxfp4,nvfp4}" \
        --out "$(fresh_dir "$OUT/gemv-sweep-$(basename "$(realpath "$tree")")")" ${GEMV_ARGS:-} 2>&1 | tee -a "$OUT/gemv-sweep.log" | tail -n 80
    done ;;
  cpu-profile)
    echo "== CPU-only decode, where a step's time goes (16 layers of Qwen3-30B-A3B geometry, dummy weights), by context"
    # $CPU_PROFILE_TREES: source trees to profile in turn (default this one; another, e.g. a copy of an earlier
    # commit's edgemoe/ and benchmarks/ in an ignored folder, gives a before/after on one machine)
    for tree in ${CPU_PROFILE_TREES:-.}; do
      for pl in ${CPU_PROFILE_PROMPTS:-32 4096}; do
        echo "-- tree $tree, context $pl"
        timeout ${CPU_PROFILE_TIMEOUT:-150} python3 "$tree/benchmarks/peers/profile_cpu.py" --layers 16 \
          --threads ${CPU_PROFILE_THREADS:-16} --tokens 16 --prompt-len "$pl" --torch-profile 0 \
          --out "$OUT/cpu-profile-$(basename "$(realpath "$tree")")-p$pl.json" 2>&1 | tr '\r' '\n' | grep -E '^[0-9]+ decode|^[a-zA-Z ]+ +[0-9]' \
          | tee -a "$OUT/cpu-profile.log"
      done
    done ;;
  cpu-decode)
    echo "== CPU-only decode tokens/s (16 layers of Qwen3-30B-A3B geometry, dummy weights, cpu-all), trees side by side"
    # $CPU_DECODE_TREES as $CPU_PROFILE_TREES; each tree runs its own benchmarks/decode.py
    for tree in ${CPU_DECODE_TREES:-.}; do
      for t in ${CPU_DECODE_THREADS:-6 16}; do
        echo "-- tree $tree, $t threads"
        timeout ${CPU_DECODE_TIMEOUT:-150} python3 "$tree/benchmarks/decode.py" --layers 16 --device cpu --budgets 0 \
          --policies cpu-all --no-resident --routing model --decode-input random --tokens 32 --warmup 8 --cpu-threads "$t" \
          --out "$OUT/cpu-decode-$(basename "$(realpath "$tree")")-t$t" 2>&1 | grep -aoE "'tokens_per_s': [0-9.]+|^profile: .*" \
          | tee -a "$OUT/cpu-decode.log"
      done
    done ;;
  formats-prefill)
    echo "== prefill per quantized expert format: an 8192-token chunk against (packed expert bytes / B_P)"
    for q in ${FORMATS_PREFILL_QUANTS:-fp8 mxfp4 nvfp4-modelopt}; do
      timeout ${FORMATS_PREFILL_TIMEOUT:-150} python3 benchmarks/prefill.py --quant "$q" --budgets 8 --modes overlap \
        --out "$OUT/prefill-$q" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill-$q.log" | grep -E '^(B_P|\| [0-9])'
    done ;;
  prefill)
    echo "== prefill benchmark (double-buffered layer streaming vs serialized)"
    timeout 400 python3 benchmarks/prefill.py --out "$OUT" ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill.log" | tail -n 30 ;;
  prefill-profile)
    echo "== prefill profile (torch.profiler, one 2-chunk prompt at the first budget)"
    timeout 300 python3 benchmarks/prefill.py --out "$OUT" --profile ${PREFILL_ARGS:-} 2>&1 | tee "$OUT/prefill-profile.log" | tail -n 100 ;;
  grouped)
    echo "== grouped expert GEMM (Triton kernel pair vs per-expert torch loop, Qwen3-30B-A3B geometry)"
    timeout 300 python3 benchmarks/grouped_gemm.py --out "$OUT" 2>&1 | tee "$OUT/grouped_gemm.log" | tail -n 10 ;;
  elastic)
    echo "== elastic GPU memory: GPU tests, then decode while a second process takes 10 GB and gives it back"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_elastic_gpu.py tests/test_gpu_memory.py \
      2>&1 | tee "$OUT/elastic-pytest.log" | tail -n 20
    timeout ${ELASTIC_TIMEOUT:-300} python3 benchmarks/elastic.py --out "$OUT" ${ELASTIC_ARGS:-} 2>&1 \
      | tee "$OUT/elastic.log" | tail -n 25 ;;
  profile-decode)
    # where the resident decode step's time goes (16-layer Qwen3-30B-A3B geometry, the model's own routing):
    # $PROFILE_MODES (default "graphs eager"); $PROFILE_ARGS adds flags (e.g. --budget-gb 2.42 --policy qstar);
    # $PROFILE_TAG names the results (profile-decode-<tag><mode>), so that one call can profile several setups
    echo "== decode step profile: host time, kernel time, GPU gaps, kernels by time"
    for mode in ${PROFILE_MODES:-graphs eager}; do
      flag=""; [ "$mode" = eager ] && flag="--eager"
      name="profile-decode-${PROFILE_TAG:-}$mode"
      timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/profile_decode.py --layers ${PROFILE_LAYERS:-16} $flag \
        --out "$OUT/$name" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/$name.log" | tail -n 60
    done ;;
  agent)
    echo "== agentic replay (Qwen3.6-35B-A3B geometry, dummy weights)"
    timeout 540 python3 benchmarks/agent_replay.py --out "$OUT" ${AGENT_ARGS:-} 2>&1 | tee "$OUT/agent.log" | tail -n 40 ;;
  families)
    # the newer families at full geometry (dummy weights): gpt-oss-120b with MXFP4 experts at 8 / 16 / 32 GB of
    # expert cache, DeepSeek-V3 with FP8 experts and fewer layers (host RAM), uniform routing, $FAMILIES_THREADS
    echo "== gpt-oss-120b (MXFP4) and DeepSeek-V3 (FP8, ${DEEPSEEK_LAYERS:-8} layers) decode, uniform routing"
    mkdir -p "$OUT/families"
    common="--routing uniform --tokens ${FAMILIES_TOKENS:-32} --warmup 8 --profile-seconds 0.5 \
      --policies ${FAMILIES_POLICIES:-qstar} --cpu-threads ${FAMILIES_THREADS:-6} ${FAMILIES_ARGS:-}"
    timeout ${GPT_OSS_TIMEOUT:-150} python3 benchmarks/decode.py --arch gpt_oss --preset gpt-oss-120b --quant mxfp4 \
      --budgets ${GPT_OSS_BUDGETS:-8,16,32} $common --out "$OUT/families/gpt-oss-120b" 2>&1 \
      | tee "$OUT/families/gpt-oss-120b.log" | grep -E '^\|' ;
    timeout ${DEEPSEEK_TIMEOUT:-150} python3 benchmarks/decode.py --arch deepseek_v3 --preset deepseek-v3 --quant fp8 \
      --layers ${DEEPSEEK_LAYERS:-8} --budgets ${DEEPSEEK_BUDGETS:-4,8,16} $common --out "$OUT/families/deepseek-v3" 2>&1 \
      | tee "$OUT/families/deepseek-v3.log" | grep -E '^\|'
    grep -ho '"kv_\(bytes_per_token\|layout\)": [^,]*' "$OUT"/families/*/decode.json ;;
  structured)
    echo "== structured output: per-token cost of the llguidance grammar on the decode path (CUDA)"
    timeout ${STRUCTURED_TIMEOUT:-240} python3 benchmarks/structured_output.py --device cuda \
      ${STRUCTURED_TOKENIZER:+--tokenizer $STRUCTURED_TOKENIZER} --out "$OUT/structured_output" ${STRUCTURED_ARGS:-} 2>&1 \
      | tee "$OUT/structured_output.log" | tail -n 30 ;;
  doorbell)
    # the decode step's two waits for its CPU experts: the polling kernel (one SM busy while the CPU computes) and
    # the driver's stream memory operations (cuStreamWaitValue32, no SM): wake-up latency, the cost to other GPU work
    # and power (NVML, from the carried nvidia-ml-py wheel) in benchmarks/doorbell_wait.py, then the offloaded decode
    # step with each wait, alternated in $DOORBELL_ROUNDS rounds (default 2), 16 layers at 2.42 GB (the side-by-side
    # checkpoint's geometry, no locality)
    echo "== doorbell waits: polling kernel against stream memory operations"
    timeout ${DOORBELL_TIMEOUT:-150} python3 benchmarks/doorbell_wait.py --out "$OUT/doorbell_wait" ${DOORBELL_ARGS:-} 2>&1 \
      | tee "$OUT/doorbell_wait.log" | tail -n 40
    for round in $(seq 1 ${DOORBELL_ROUNDS:-2}); do
      for wait in kernel stream-op; do
        timeout ${DOORBELL_DECODE_TIMEOUT:-90} python3 benchmarks/decode.py --layers 16 --budgets 2.42 --routing uniform \
          --policies ${DOORBELL_POLICIES:-qstar,auto} --cpu-threads ${DOORBELL_THREADS:-6,15} --tokens 64 --warmup 8 \
          --no-resident --doorbell-wait $wait --out "$OUT/doorbell_decode/$wait-$round" > "$OUT/doorbell_decode-$wait-$round.log" 2>&1 \
          || echo "   $wait round $round: exit $? (see its log)"
        echo "-- wait $wait, round $round"; grep "^|" "$OUT/doorbell_decode/$wait-$round/decode.md" 2>/dev/null | tail -n +3
      done
    done ;;
  peers)
    echo "== side by side with llama.cpp (benchmarks/peers: llama-bench build, checkpoint pair, llama-bench tg64, decode.py)"
    timeout $(( ${PEERS_DEADLINE:-540} + 30 )) bash benchmarks/peers/run.sh --deadline ${PEERS_DEADLINE:-540} \
      ${PEERS_ARGS:-} 2>&1 | tee "$OUT/peers.log" | tail -n 60 ;;
  laptop)
    echo "== laptop case: Qwen3.6-35B-A3B geometry, NVFP4 experts, 8 GB GPU budget (everything), 6 CPU threads, served"
    timeout ${LAPTOP_TIMEOUT:-480} python3 benchmarks/laptop.py --out "$OUT/laptop" ${LAPTOP_ARGS:-} 2>&1 \
      | tee "$OUT/laptop.log" | tail -n 75 ;;
  contention)
    echo "== decode while a PCIe copy loop, then a DRAM copy process, runs mid-run (16 layers, uniform routing)"
    timeout ${CONTENTION_TIMEOUT:-300} python3 benchmarks/contention.py --layers 16 --budget ${CONTENTION_BUDGET:-2} \
      --cpu-threads ${CONTENTION_THREADS:-6} --out "$OUT/contention" ${CONTENTION_ARGS:-} 2>&1 \
      | tee "$OUT/contention.log" | grep -v "^{" | tail -n 20 ;;
  policy)
    # expert-policy study: every miss policy in three routing regimes, budgets 2/6/16 GB, 6 and 16 CPU threads;
    # one decode-benchmark process per regime (both thread counts in it), realistic first, within POLICY_SECONDS;
    # $POLICY_TREES: source trees run in turn per regime (default this one; another, e.g. an earlier commit's
    # `git archive` in an ignored folder, gives a before/after on one machine: its folders are REGIME@TREE);
    # $POLICY_TREE_POLICIES: the policies of every tree after the first (default the same; e.g. `auto` alone, the
    # summary then compares it with the first tree's fixed policies)
    echo "== expert policies x routing regimes (Qwen3-30B-A3B geometry, dummy weights)"
    traces=${POLICY_TRACES:-}
    for d in shared/fixtures/routing_traces ../shared/fixtures/routing_traces; do
      [ -z "$traces" ] && [ -d "$d" ] && traces=$(ls "$d"/*.jsonl | paste -sd, -)
    done
    policies=${POLICY_POLICIES:-qstar,auto,fill-all,cpu-all,static}
    common="--budgets ${POLICY_BUDGETS:-2,6,16} \
      --tokens ${POLICY_TOKENS:-32} --warmup 8 --profile-seconds 0.5 --no-resident ${POLICY_ARGS:-}"
    deadline=$(( $(date +%s) + ${POLICY_SECONDS:-540} ))
    mkdir -p "$OUT/policy"
    for regime in ${POLICY_REGIMES:-realistic no-locality degenerate}; do
      case "$regime" in
        realistic) [ -z "$traces" ] && { echo "   realistic: no routing traces (POLICY_TRACES), skipped"; continue; }
                   flags="--routing trace --trace $traces" ;;
        no-locality) flags="--routing uniform" ;;  # random weights' own routing is local (hit rate 0.98 at 6 GB)
        degenerate) flags="--routing model --decode-input greedy" ;;
      esac
      pols=$policies
      for tree in ${POLICY_TREES:-.}; do
        left=$(( deadline - $(date +%s) ))
        [ "$left" -lt 60 ] && { echo "   $regime ($tree): out of time, skipped"; continue; }
        per=$(( left < ${POLICY_RUN_SECONDS:-200} ? left : ${POLICY_RUN_SECONDS:-200} ))
        dir="$OUT/policy/$regime"; [ "$tree" != . ] && dir="$dir@$(basename "$(realpath "$tree")")"
        echo "-- $regime, tree $tree (limit ${per}s)"
        timeout "$per" python3 "$tree/benchmarks/decode.py" $common $flags --policies "$pols" \
          --cpu-threads "${POLICY_THREADS:-6,16}" --out "$dir" > "$dir.log" 2>&1 || echo "   exit $? (see $dir.log)"
        pols=${POLICY_TREE_POLICIES:-$policies}
        grep "^|" "$dir/decode.md" 2>/dev/null | tail -n +3 || true
      done
    done
    python3 benchmarks/policy_summary.py "$OUT/policy" ;;
  *) echo "unknown stage $stage" ;;
  esac
done

# The device tool brings back at most 8 files from its $OUT (each under 16 MiB, two folders deep at most): more, or
# any file in a folder of a folder of this $OUT (too deep once this $OUT is itself a folder of the tool's, as when one
# call runs the script several times with OUT=$OUT/a, $OUT/b), are packed into one results.tar.gz beside machine.txt
# (tar -xzf it here), unless the archive itself would be too large.
n=$(find "$OUT" -type f | wc -l)
deep=$(find "$OUT" -mindepth 3 -type f | head -n 1)
if { [ "$n" -gt 8 ] || [ -n "$deep" ]; } && tar -czf /tmp/gpu-check-results.tar.gz -C "$OUT" . \
    && [ "$(stat -c %s /tmp/gpu-check-results.tar.gz)" -lt 15000000 ]; then
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name machine.txt -exec rm -rf {} +
  mv /tmp/gpu-check-results.tar.gz "$OUT/results.tar.gz"
  echo "$n files under \$OUT packed into results.tar.gz (the device tool returns at most 8, two folders deep)"
fi
