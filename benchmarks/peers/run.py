"""Side by side with llama.cpp: one checkpoint, both engines, expert VRAM and threads matched.

Protocol. One random bf16 checkpoint with Qwen3-30B-A3B's layer geometry and ``--layers`` N layers
(``checkpoint.py``: the Hugging Face layout edgemoe loads and the GGUF llama.cpp loads, the same bytes),
``o_proj`` drawn small so each layer routes by the current token; both engines are fed random tokens, so
neither sees routing locality. llama.cpp: ``llama-bench -p 0 -n 64 -r 3`` (tg64, random tokens) with
``-ngl 99 -ncmoe K`` (the experts of K layers stay on the CPU, the rest on the GPU). edgemoe:
``benchmarks/decode.py --routing model --decode-input random`` (64 timed tokens after 8 warm-up ones)
with an expert cache of (N-K)·E slots, the same expert VRAM. Threads are matched (``-t T`` /
``--cpu-threads T``). Also: every expert on the CPU (``-ncmoe N`` / ``cpu-all`` with 0 slots), every
expert resident (``-ncmoe 0`` / decode.py's all-resident run), and CPU-only (llama.cpp ``-ngl 0 -dev
none`` / edgemoe ``--device cpu``, cpu-all).

Stages (``--stages``, comma-separated; default all): ``checkpoint`` (write hf/ and model-bf16.gguf under
``--work``; kept when its marker matches), ``llama`` and ``edgemoe`` (GPU runs), ``cpu-llama`` and
``cpu-edgemoe`` (CPU-only runs), ``table``. Every run writes its own result file under ``--results`` and
is skipped when that file exists (``--force`` reruns), so a session can be split over several calls.
``table`` writes ``peers.json`` (every figure) and ``peers.md`` (ratios edgemoe / llama.cpp and, beside
each figure, its bytes bound: bytes moved per token over the bandwidth that moves them, B_P and B_H as
decode.py measured them at that thread count).

    python benchmarks/peers/run.py        # the GPU host: 16 layers, -ncmoe 14,11, threads 6,12,15,16, CPU-only 6,16
    python benchmarks/peers/run.py --layers 4 --cpu-threads 1,2 --stages checkpoint,cpu-llama,cpu-edgemoe,table \
        --llama-bench .peers/bin/llama-bench-cpu      # a CPU-only machine

Time on the GPU host (16 layers, 21.2 GB per format), estimated from sizes and rates: checkpoint ~1.5 min
(42 GB written, into tmpfs when it has room; the converter's lazy pass over 6200 tensors and the 151936-token
vocabulary ~30 s); llama ~1.5 min (4 model loads, 16 tg64 runs of 4 x 64 tokens at 35-470 tokens/s);
edgemoe ~3.5 min (4 processes, each loading and pinning 19.3 GB, measuring B_P/B_H and timing 10 runs of
72 tokens); cpu-llama ~1 min; cpu-edgemoe ~1.5 min (2 processes). About 9 min in all: split it over two
calls (``--stages checkpoint,llama,cpu-llama`` then ``--stages edgemoe,cpu-edgemoe,table``) when a call
is limited to 10 min, or when llama-bench must be built on the host first (~4.5 min on 16 cores).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve().parent
PEERS = ROOT / ".peers"
STAGES = ("checkpoint", "llama", "edgemoe", "cpu-llama", "cpu-edgemoe", "table")
# what the carried llama-bench-cuda was compiled for (build_llama_bench.sh cuda): the GPU host's Xeon
XEON_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_tile", "amx_int8", "amx_bf16")


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_logged(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """Run ``cmd``; a timeout becomes return code 124 with what it had printed (the session goes on)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return subprocess.CompletedProcess(cmd, 124, text(e.stdout), text(e.stderr) + f"\ntimed out after {timeout} s")


def publish(results: Path) -> None:
    """Mirror the result files to $OUT/peers (when $OUT is set), after every run, so that a session
    stopped by its time limit still returns what it finished."""
    if os.environ.get("OUT"):
        shutil.copytree(results, Path(os.environ["OUT"]) / "peers", dirs_exist_ok=True)


def checkpoint_bytes(layers: int) -> int:
    """Bytes of one format of the checkpoint (Qwen3-30B-A3B geometry, ``layers`` layers, bf16)."""
    from edgemoe.weights.make_model import PRESETS

    c = PRESETS["qwen3_moe"]["qwen3-30b-a3b"]
    h, hd, e, i, v = c["hidden_size"], c["head_dim"], c["num_experts"], c["moe_intermediate_size"], c["vocab_size"]
    layer = (2 * c["num_attention_heads"] * hd + 2 * c["num_key_value_heads"] * hd) * h + e * h + e * 3 * h * i
    return 2 * (layers * layer + 2 * v * h)


def pick_work_dir(layers: int) -> Path:
    """``/dev/shm/edgemoe-peers`` when that tmpfs holds both formats with room left for the engines (the
    checkpoint is then written and read at memory speed, and llama.cpp's mmap shares its pages), else
    ``.peers/ckpt`` on disk."""
    need = 2 * checkpoint_bytes(layers)
    shm = Path("/dev/shm")
    try:
        free = shutil.disk_usage(shm).free
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return PEERS / "ckpt"
    # the engines need about one format's bytes besides (edgemoe's host expert pool), plus headroom
    if free >= 1.05 * need and avail >= need + checkpoint_bytes(layers) + (16 << 30):
        return shm / "edgemoe-peers"
    return PEERS / "ckpt"


def geometry(hf: Path) -> dict:
    """Sizes the bounds need, from the checkpoint's config.json: bytes per expert, per token."""
    c = json.loads((hf / "config.json").read_text())
    h, i, e, k, n = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["num_experts_per_tok"], c["num_hidden_layers"]
    hd, nh, nkv, v = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    attn = (2 * nh * hd + 2 * nkv * hd) * h * 2  # q, k, v, o in bf16
    return {"layers": n, "experts": e, "top_k": k, "expert_bytes": 3 * h * i * 2,
            "dense_bytes_per_token": n * (attn + e * h * 2) + v * h * 2,  # attention + router per layer, LM head
            "vocab": v, "hidden": h}


# ------------------------------------------------------------------------------------------------ llama.cpp


def cuda_library_dirs() -> list[str]:
    """Folders holding libcudart/libcublas/libcublasLt .so.13: pip's nvidia-* packages on this Python's
    path, then the CUDA toolkit's."""
    dirs = []
    for p in sys.path:
        dirs += sorted(glob.glob(os.path.join(p, "nvidia", "*", "lib")))
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        if os.path.isdir(d):
            dirs.append(d)
    return [d for d in dict.fromkeys(dirs) if glob.glob(os.path.join(d, "lib*.so*"))]


def bench_env() -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join([*cuda_library_dirs(), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    return env


def binary_problem(path: Path, env: dict, need_flags: tuple[str, ...]) -> str | None:
    """Why ``path`` cannot run here (a missing file, an unresolved library, a CPU feature), or None."""
    if not path.is_file():
        return f"{path} is missing"
    ldd = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env, check=False)
    missing = [ln.split()[0] for ln in ldd.stdout.splitlines() if "not found" in ln]
    if missing:
        return f"{path}: libraries not found: {', '.join(missing)}"
    flags = set()
    with open("/proc/cpuinfo") as f:
        for ln in f:
            if ln.startswith("flags"):
                flags = set(ln.split(":", 1)[1].split())
                break
    lacking = [f for f in need_flags if f not in flags]
    return f"{path}: built for CPU features this CPU lacks: {', '.join(lacking)}" if lacking else None


def llama_bench_binary(a: argparse.Namespace, env: dict) -> Path:
    """The llama-bench to run: ``--llama-bench``; else the carried CUDA build when it runs here; else
    build one for this machine (``build_llama_bench.sh cuda-native``, ~4.5 min on 16 cores)."""
    if a.llama_bench:
        path = Path(a.llama_bench)
        if (why := binary_problem(path, env, ())) is not None:
            raise SystemExit(why)
        return path
    path = PEERS / "carry" / "llama-bench-cuda"
    why = binary_problem(path, env, XEON_FLAGS)
    if why is None:
        return path
    log(f"{why}; building llama-bench here")
    t0 = time.perf_counter()
    subprocess.run(["bash", str(HERE / "build_llama_bench.sh"), "cuda-native"], check=True, env=env)
    log(f"built in {time.perf_counter() - t0:.0f} s")
    if (why := binary_problem(path, env, ())) is not None:
        raise SystemExit(why)
    return path


def run_llama(a, binary: Path, env: dict, gguf: Path, name: str, extra: list[str], threads: list[int]) -> None:
    """One llama-bench invocation (one model load, every thread count) -> results/llama/NAME.jsonl."""
    out = Path(a.results) / "llama" / f"{name}.jsonl"
    if out.exists() and not a.force:
        log(f"llama {name}: done ({out})")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(a.tokens), "-r", str(a.reps),
           "-t", ",".join(map(str, threads)), *extra, "-o", "jsonl"]
    log("llama " + name + ": " + " ".join(cmd))
    t0 = time.perf_counter()
    p = run_logged(cmd, env, a.timeout)
    (out.parent / f"{name}.log").write_text(" ".join(cmd) + "\n" + p.stderr)
    if p.returncode != 0:
        log(f"llama {name} failed (rc {p.returncode}):\n" + p.stderr[-3000:])
        return
    out.write_text(p.stdout)
    for ln in p.stdout.splitlines():
        r = json.loads(ln)
        log(f"  t={r['n_threads']} ngl={r['n_gpu_layers']} ncmoe={r.get('n_cpu_moe')}: {r['avg_ts']:.1f} tokens/s")
    log(f"llama {name}: {time.perf_counter() - t0:.0f} s")
    publish(Path(a.results))


# ------------------------------------------------------------------------------------------------ edgemoe


def budget_gb(slots: int, expert_bytes: int) -> str:
    """decode.py's --budgets value for exactly ``slots`` slots (it takes ⌊GB·1e9 / row⌋)."""
    return f"{(slots + 0.5) * expert_bytes / 1e9:.6f}"


def run_edgemoe(a, hf: Path, name: str, args: list[str]) -> None:
    """One benchmarks/decode.py process -> results/edgemoe/NAME/decode.json."""
    out = Path(a.results) / "edgemoe" / name
    if (out / "decode.json").exists() and not a.force:
        log(f"edgemoe {name}: done ({out})")
        return
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--model", str(hf), "--load-format", "auto",
           "--routing", "model", "--decode-input", "random", "--tokens", str(a.tokens), "--warmup", "8",
           "--out", str(out), *args]
    log("edgemoe " + name + ": " + " ".join(cmd))
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = run_logged(cmd, env, a.timeout)
    (out / "decode.log").write_text(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    if p.returncode != 0:
        log(f"edgemoe {name} failed (rc {p.returncode}):\n" + (p.stdout + p.stderr)[-3000:])
        return
    for r in json.loads((out / "decode.json").read_text())["results"]:
        log(f"  {r['budget_gb']} GB {r['policy']}: {r['tokens_per_s']:.1f} tokens/s, hit rate {r['hit_rate']:.3f}")
    log(f"edgemoe {name}: {time.perf_counter() - t0:.0f} s")
    publish(Path(a.results))


# ------------------------------------------------------------------------------------------------ table


def _load_llama(results: Path) -> list[dict]:
    rows = []
    for f in sorted((results / "llama").glob("*.jsonl")):
        for ln in f.read_text().splitlines():
            r = json.loads(ln)
            rows.append({"run": f.stem, "threads": r["n_threads"], "ngl": r["n_gpu_layers"], "ncmoe": r.get("n_cpu_moe", 0),
                         "tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"], "backends": r.get("backends"),
                         "build_commit": r.get("build_commit"), "cpu_info": r.get("cpu_info"), "gpu_info": r.get("gpu_info")})
    return rows


def _load_edgemoe(results: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "decode.json").read_text()) for d in sorted((results / "edgemoe").glob("*"))
            if (d / "decode.json").exists()}


def _fmt(x: float | None, bound: float | None = None) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}" + (f" ({bound:.0f})" if bound else "")


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}×" if x and y else "–"


def build_table(a, geo: dict) -> None:
    """results/peers.json (every figure, with bounds) and results/peers.md."""
    res = Path(a.results)
    llama, edge = _load_llama(res), _load_edgemoe(res)
    n, k, row, e = geo["layers"], geo["top_k"], geo["expert_bytes"], geo["experts"]

    def llama_at(ncmoe: int, t: int, cpu_only: bool = False) -> dict | None:
        want_ngl = 0 if cpu_only else 99
        return next((r for r in llama if r["ncmoe"] == ncmoe and r["threads"] == t and (r["ngl"] == 0) == (want_ngl == 0)), None)

    def edge_at(name: str, slots: int | None, policy: str) -> dict | None:
        d = edge.get(name)
        if d is None:
            return None
        for r in d["results"]:
            if r["policy"] == policy and (slots is None and r["budget_gb"] == "all (resident)" or
                                          slots is not None and r["budget_gb"] != "all (resident)" and r["slots"] == slots):
                return r
        return None

    def profile(name: str) -> dict | None:
        d = edge.get(name)
        return d["meta"]["profile"] if d else None

    rows = []
    threads = [int(t) for t in a.threads.split(",")] if any(r["ngl"] for r in llama) or any(
        name.startswith("gpu-") for name in edge) else []
    levels = [(int(c), (n - int(c)) * e) for c in a.ncmoe.split(",") if 0 < int(c) < n]
    for t in threads:
        name = f"gpu-t{t}"
        prof = profile(name)
        bh = prof["isolated"]["b_h_gbps"] if prof else None
        lres = llama_at(0, t)
        res_ms = 1e3 / lres["tokens_per_s"] if lres else None
        for ncmoe, slots in [*levels, (n, 0)]:
            lr = llama_at(ncmoe, t)
            cpu_gb = ncmoe * k * row / 1e9  # per token, llama.cpp's CPU experts
            l_bound = 1e3 / (res_ms + cpu_gb / bh * 1e3) if res_ms and bh else None
            row_out = {"kind": "gpu", "threads": t, "ncmoe": ncmoe, "slots": slots, "expert_vram_gb": slots * row / 1e9,
                       "llama": lr and lr["tokens_per_s"], "llama_bound": l_bound, "llama_cpu_gb_per_token": cpu_gb}
            for pol in ("qstar", "cpu-all", "static"):
                # with 0 slots every policy serves every miss on the CPU: only the cpu-all run is reported
                r = edge_at(name, slots, pol) if slots or pol == "cpu-all" else None
                row_out[pol] = r and r["tokens_per_s"]
                row_out[pol + "_bound"] = r and r.get("bound_ms") and 1e3 / r["bound_ms"]
                row_out[pol + "_hit_rate"] = r and r["hit_rate"]
                row_out[pol + "_q_over_m"] = r and r["q_over_m_observed"]
            rows.append(row_out)
        er = edge_at(name, None, "static")
        rows.append({"kind": "resident", "threads": t, "ncmoe": 0, "slots": n * e, "expert_vram_gb": n * e * row / 1e9,
                     "llama": lres and lres["tokens_per_s"], "resident": er and er["tokens_per_s"]})
    for t in [int(x) for x in a.cpu_threads.split(",")]:
        lr = llama_at(n, t, cpu_only=True) or llama_at(0, t, cpu_only=True)
        d = edge.get(f"cpu-t{t}")
        er = next((r for r in d["results"] if r["policy"] == "cpu-all"), None) if d else None
        bh = d["meta"]["profile"]["isolated"]["b_h_gbps"] if d else None
        gb = (geo["dense_bytes_per_token"] + n * k * row) / 1e9
        rows.append({"kind": "cpu-only", "threads": t, "llama": lr and lr["tokens_per_s"],
                     "cpu-all": er and er["tokens_per_s"], "gb_per_token": gb, "bound": bh and bh / gb})

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
            "geometry": geo, "tokens": a.tokens, "reps": a.reps,
            "llama_cpp": (PEERS / "llama.cpp" / "PEERS_VERSION").read_text().split("\n")
            if (PEERS / "llama.cpp" / "PEERS_VERSION").exists() else None,
            "llama_build": next(({"commit": r["build_commit"], "cpu": r["cpu_info"], "gpu": r["gpu_info"]} for r in llama), None),
            "profiles": {name: d["meta"]["profile"] for name, d in edge.items()}}
    (res / "peers.json").write_text(json.dumps({"meta": meta, "rows": rows, "llama": llama,
                                                "edgemoe": {k2: v["results"] for k2, v in edge.items()}}, indent=2))
    md = [f"Tokens/s, tg{a.tokens}; in parentheses the bytes bound in tokens/s (see peers.json for the inputs).", ""]
    if threads:
        md += [("| expert VRAM | threads | llama.cpp | edgemoe qstar | ratio | edgemoe cpu-all | ratio | edgemoe static | ratio "
               "| qstar hit rate |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "gpu":
            vram = f"{r['expert_vram_gb']:.2f} GB (-ncmoe {r['ncmoe']})" if r["slots"] else f"none: all on CPU (-ncmoe {r['ncmoe']})"
            hit = "–" if r["qstar_hit_rate"] is None else f"{r['qstar_hit_rate']:.3f}"
            md.append(f"| {vram} | {r['threads']} | {_fmt(r['llama'], r['llama_bound'])} | "
                      f"{_fmt(r['qstar'], r['qstar_bound'])} | {_ratio(r['qstar'], r['llama'])} | "
                      f"{_fmt(r['cpu-all'], r['cpu-all_bound'])} | {_ratio(r['cpu-all'], r['llama'])} | "
                      f"{_fmt(r['static'], r['static_bound'])} | {_ratio(r['static'], r['llama'])} | {hit} |")
        elif r["kind"] == "resident":
            md.append(f"| all resident ({r['expert_vram_gb']:.1f} GB) | {r['threads']} | {_fmt(r['llama'])} | "
                      f"{_fmt(r['resident'])} | {_ratio(r['resident'], r['llama'])} | | | | | |")
    cpu_rows = [r for r in rows if r["kind"] == "cpu-only"]
    if cpu_rows:
        md += ["", (f"CPU-only (llama.cpp -ngl 0 -dev none; edgemoe --device cpu, cpu-all), {cpu_rows[0]['gb_per_token']:.2f} GB "
                    "read per token; in parentheses the bound at decode.py's B_H:"), "",
               "| threads | llama.cpp | edgemoe | ratio |", "|---|---|---|---|"]
        for r in cpu_rows:
            md.append(f"| {r['threads']} | {_fmt(r['llama'])} | {_fmt(r['cpu-all'], r['bound'])} | {_ratio(r['cpu-all'], r['llama'])} |")
    (res / "peers.md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)


# ------------------------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--work", help="checkpoint folder (hf/, model-bf16.gguf); default: /dev/shm/edgemoe-peers when "
                                   "that tmpfs has room for both formats and the engines, else .peers/ckpt")
    ap.add_argument("--results", default=str(PEERS / "results"), help="result files; mirrored to $OUT/peers after each run")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ncmoe", default="14,11", help="expert VRAM levels as layers whose experts stay on the CPU")
    ap.add_argument("--threads", default="6,12,15,16", help="thread counts of the GPU runs")
    ap.add_argument("--cpu-threads", default="6,16", help="thread counts of the CPU-only runs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policies", default="qstar,cpu-all,static", help="edgemoe policies of the GPU runs")
    ap.add_argument("--tokenizer", default=str(PEERS / "carry" / "tokenizer"),
                    help="tokenizer folder for the checkpoint (a real Qwen3 tokenizer: llama.cpp's converter must recognise it)")
    ap.add_argument("--no-token-routing", action="store_true", help="o_proj at the init std (degenerate routing)")
    ap.add_argument("--llama-bench", help="llama-bench binary (default: .peers/carry/llama-bench-cuda, built if it cannot run)")
    ap.add_argument("--llama-cpp", default=str(PEERS / "llama.cpp"), help="the stripped llama.cpp tree (for gguf-py)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per llama-bench / decode.py process")
    ap.add_argument("--force", action="store_true", help="rerun runs whose result file exists")
    a = ap.parse_args(argv)
    stages = [s for s in a.stages.split(",") if s]
    if bad := [s for s in stages if s not in STAGES]:
        raise SystemExit(f"--stages: unknown {bad}; choose from {STAGES}")
    work, results = Path(a.work) if a.work else pick_work_dir(a.layers), Path(a.results)
    log(f"checkpoint folder {work}")
    hf, gguf = work / "hf", work / "model-bf16.gguf"
    results.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    if "checkpoint" in stages:
        want = {"layers": a.layers, "token_routing": not a.no_token_routing}
        marker = hf / "peers_checkpoint.json"  # written after the last shard
        have = json.loads(marker.read_text()) if marker.exists() else {}
        keep_hf = not a.force and all(have.get(k2) == v for k2, v in want.items())
        if keep_hf and gguf.exists():
            log(f"checkpoint: kept {work} ({have})")
        else:
            if not (Path(a.llama_cpp) / "convert_hf_to_gguf.py").exists() and (PEERS / "carry" / "llama.cpp-src.tar.gz").exists():
                subprocess.run(["tar", "-C", str(PEERS), "-xzf", str(PEERS / "carry" / "llama.cpp-src.tar.gz")], check=True)
            if not keep_hf:
                shutil.rmtree(work, ignore_errors=True)
            cmd = [sys.executable, str(HERE / "checkpoint.py"), "--out", str(work), "--layers", str(a.layers),
                   "--llama-cpp", a.llama_cpp, "--tokenizer", a.tokenizer, *([] if a.no_token_routing else ["--token-routing"]),
                   *(["--skip-hf"] if keep_hf else [])]
            log("checkpoint: " + " ".join(cmd))
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True)
            log(f"checkpoint: {time.perf_counter() - t0:.0f} s, {shutil.disk_usage(work).free / 1e9:.0f} GB left in {work}")
    geo = geometry(hf)
    n, e = geo["layers"], geo["experts"]
    threads = [int(t) for t in a.threads.split(",")]
    cpu_threads = [int(t) for t in a.cpu_threads.split(",")]

    if "llama" in stages or "cpu-llama" in stages:
        env = bench_env()
        binary = llama_bench_binary(a, env)
        if "llama" in stages:
            for c in [*[int(x) for x in a.ncmoe.split(",")], n, 0]:
                run_llama(a, binary, env, gguf, f"gpu-ncmoe{c}", ["-ngl", "99", "-ncmoe", str(c)], threads)
        if "cpu-llama" in stages:
            run_llama(a, binary, env, gguf, "cpu", ["-ngl", "0", "-dev", "none"], cpu_threads)
    if "edgemoe" in stages:
        budgets = ",".join(budget_gb((n - int(c)) * e, geo["expert_bytes"]) for c in a.ncmoe.split(",")) + ",0"
        for t in threads:
            run_edgemoe(a, hf, f"gpu-t{t}", ["--device", "cuda", "--budgets", budgets, "--policies", a.policies,
                                              "--cpu-threads", str(t)])
    if "cpu-edgemoe" in stages:
        for t in cpu_threads:
            run_edgemoe(a, hf, f"cpu-t{t}", ["--device", "cpu", "--budgets", "0", "--policies", "cpu-all", "--no-resident",
                                              "--cpu-threads", str(t)])
    if "table" in stages:
        build_table(a, geo)
    publish(results)
    log(f"total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
