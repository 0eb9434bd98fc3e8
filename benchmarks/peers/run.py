"""Side by side with llama.cpp: one checkpoint, both engines, expert VRAM and threads matched.

Protocol. One random bf16 checkpoint with Qwen3-30B-A3B's layer geometry and ``--layers`` N layers
(``checkpoint.py``: the Hugging Face layout edgemoe loads and the GGUF llama.cpp loads, the same bytes),
``o_proj`` drawn small so each layer routes by the current token; both engines are fed random tokens, so
neither sees routing locality. llama.cpp: ``llama-bench -p 0 -n 64 -r 3`` (tg64, random tokens) with
``-ngl 99 -ncmoe K`` (the experts of K layers stay on the CPU, the rest on the GPU). edgemoe:
``benchmarks/decode.py --routing model --decode-input random`` (64 timed tokens after 8 warm-up ones)
with an expert cache of (N-K)·E slots, the same expert VRAM, under the policies ``auto`` (the default),
``qstar``, ``cpu-all`` and ``static``. Threads are matched (``-t T`` / ``--cpu-threads T``). Also every expert
resident (``-ncmoe 0`` / decode.py's all-resident run) and CPU-only (llama.cpp ``-ngl 0 -dev none`` /
edgemoe ``--device cpu``, ``cpu-all``).

Stages (``--stages``, comma-separated; default all), each doing only what is missing:

- ``build``: llama-bench (``build_llama_bench.sh cuda-native``, or ``cpu`` with ``--cpu-only``), started
  in the background so that it overlaps ``checkpoint``; the build folder is incremental, so a build
  stopped by ``--deadline`` resumes in the next call.
- ``checkpoint``: hf/ and model-bf16.gguf under ``--work`` (kept when its marker matches).
- ``llama``: one llama-bench process per expert-VRAM level (every thread count in it), then CPU-only.
- ``edgemoe``: one decode.py process per thread count (every level and policy in it), the first two
  thread counts, then CPU-only, then the other thread counts.

``--rounds R`` makes every run R times, round after round (each round: the llama.cpp runs, then edgemoe's), so
that a change in the machine's memory or PCIe rate during the session falls on both engines; ``--llama-bench``
may name several builds (comma-separated; the CPU and the CUDA build run their CPU paths at different rates on
different hosts), each run in every round. The table takes, per setting, the median over the rounds, and for
llama.cpp the build whose median is higher; a second table lists every round with its own ratio.

Every run writes its own result file under ``--results`` and is skipped when that file exists
(``--force`` reruns), so a session splits over calls. With ``--deadline S`` no run is started that the
remaining time cannot hold and each process gets the remaining time as its limit; a process stopped by
its limit keeps the results it printed. After every run ``peers.json`` (every figure) and ``peers.md``
(ratios edgemoe / llama.cpp and, beside each figure, its bytes bound: bytes moved per token over the
bandwidth that moves them, B_P and B_H as decode.py measured them at that thread count) are rewritten
and, when ``$OUT`` is set, copied there with ``peers-results.tar.gz`` (every result file and log).

    python benchmarks/peers/run.py --stages build,checkpoint,llama --deadline 540   # GPU host, call 1
    python benchmarks/peers/run.py --deadline 540                                   # GPU host, call 2
    python benchmarks/peers/run.py --cpu-only --layers 4 --cpu-threads 2 \\
        --llama-bench .peers/bin/llama-bench-cpu                                    # a CPU-only machine
    python benchmarks/peers/run.py --dry-run ...                                    # print the commands
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve().parent
PEERS = ROOT / ".peers"
STAGES = ("build", "checkpoint", "llama", "edgemoe")
MARKER = "peers_checkpoint.json"
# seconds a run needs at least to be worth starting (a stopped run keeps what it printed): a llama-bench
# level (a model load, 4 x 64 tokens per thread count), a decode.py process (load and pin the experts,
# B_P/B_H, 7 runs of 72 tokens)
MIN_S = {"llama": 25, "edgemoe": 60}


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_logged(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd``; a timeout becomes return code 124 with what it had printed (the session goes on)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return subprocess.CompletedProcess(cmd, 124, text(e.stdout),
                                           text(e.stderr) + f"\ntimed out after {timeout:.0f} s")


class Clock:
    """The session's remaining time (``--deadline`` seconds from the start; None: unlimited)."""

    def __init__(self, deadline_s: float | None):
        self.t0, self.deadline_s = time.monotonic(), deadline_s

    def left(self) -> float:
        return float("inf") if self.deadline_s is None else self.deadline_s - (time.monotonic() - self.t0)

    def allows(self, what: str, name: str) -> bool:
        if self.left() >= MIN_S[what]:
            return True
        log(f"{what} {name}: skipped, {self.left():.0f} s left (needs {MIN_S[what]} s)")
        return False

    def limit(self, per_run: float) -> float:
        return max(1.0, min(per_run, self.left() - 5))


# ------------------------------------------------------------------------------------------------ geometry


def model_config(layers: int, overrides: dict) -> dict:
    """HF config kwargs of the checkpoint: the ``qwen3-30b-a3b`` preset with ``layers`` layers and ``overrides``."""
    from edgemoe.synth import PRESETS

    return {**PRESETS["qwen3_moe"]["qwen3-30b-a3b"], "num_hidden_layers": layers, **overrides}


def geometry(c: dict) -> dict:
    """Sizes the bounds need, from a config dict: bytes per expert, per token, per format."""
    h, i, e, k = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"], c["num_experts_per_tok"]
    n = c["num_hidden_layers"]
    hd, nh, nkv, v = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    attn = (2 * nh * hd + 2 * nkv * hd) * h * 2  # q, k, v, o in bf16
    expert = 3 * h * i * 2
    return {"layers": n, "experts": e, "top_k": k, "expert_bytes": expert,
            "dense_bytes_per_token": n * (attn + e * h * 2) + v * h * 2,  # attention + router per layer, LM head
            "checkpoint_bytes": n * (attn + e * h * 2 + e * expert) + 2 * v * h * 2, "vocab": v, "hidden": h}


def checkpoint_complete(work: Path, want: dict) -> bool:
    marker = work / "hf" / MARKER  # written after the last shard
    have = json.loads(marker.read_text()) if marker.exists() else {}
    return all(have.get(k) == v for k, v in want.items()) and (work / "model-bf16.gguf").exists()


def pick_work_dir(a, want: dict, need: int) -> Path:
    """``--work``; else where a complete checkpoint with this marker already is (else where one was begun);
    else ``.peers/ckpt`` when its file system holds both formats (it survives between calls of a warm
    machine), else ``/dev/shm/edgemoe-peers`` when that tmpfs holds them with room left for the engines
    (one format's bytes for edgemoe's host expert pool, plus 16 GiB)."""
    if a.work:
        return Path(a.work)
    disk, shm = PEERS / "ckpt", Path("/dev/shm/edgemoe-peers")
    for d in (disk, shm):
        if checkpoint_complete(d, want):
            return d
    for d in (disk, shm):
        if (d / "hf").exists():  # a write an earlier call began: resumed or replaced there
            return d
    PEERS.mkdir(exist_ok=True)
    log(f"free: {shutil.disk_usage(PEERS).free / 1e9:.1f} GB in {PEERS}, "
        f"{shutil.disk_usage('/dev/shm').free / 1e9:.1f} GB in /dev/shm; the checkpoint pair needs "
        f"{2 * need / 1e9:.1f} GB")
    if shutil.disk_usage(PEERS).free >= 2 * need + (4 << 30):
        return disk
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        if shutil.disk_usage("/dev/shm").free >= 2.05 * need and avail >= 3 * need + (16 << 30):
            return shm
    except (OSError, StopIteration):
        pass
    raise SystemExit(f"no room for the checkpoint pair ({2 * need / 1e9:.1f} GB): {PEERS} has "
                     f"{shutil.disk_usage(PEERS).free / 1e9:.1f} GB free; pass --work")


# ------------------------------------------------------------------------------------------------ llama.cpp


def cuda_library_dirs() -> list[str]:
    """Folders holding libcudart/libcublas/libcublasLt .so.13: pip's nvidia-* packages on this Python's
    path, then the CUDA toolkit's."""
    import glob

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


def binary_problem(path: Path, env: dict, cuda: bool) -> str | None:
    """Why ``path`` cannot run here (a missing file, an unresolved library, a CPU feature its CPU backend
    was compiled for, listed in ``PATH.needs`` by build_llama_bench.sh, with ``cuda`` no CUDA device in its
    ``--list-devices``), or None."""
    if not path.is_file():
        return f"{path} is missing"
    ldd = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env, check=False)
    missing = [ln.split()[0] for ln in ldd.stdout.splitlines() if "not found" in ln]
    if missing:
        return f"{path}: libraries not found: {', '.join(missing)}"
    needs = Path(str(path) + ".needs")
    need = needs.read_text().split() if needs.exists() else []
    flags: set[str] = set()
    with open("/proc/cpuinfo") as f:
        for ln in f:
            if ln.startswith("flags"):
                flags = set(ln.split(":", 1)[1].split())
                break
    lacking = [f for f in need if f not in flags]
    if lacking:
        return f"{path}: built for CPU features this CPU lacks: {', '.join(lacking)}"
    if cuda:
        p = run_logged([str(path), "--list-devices"], env, 60)
        if p.returncode != 0 or "CUDA0" not in p.stdout + p.stderr:
            return f"{path} --list-devices (rc {p.returncode}) shows no CUDA device: {(p.stdout + p.stderr)[-500:]}"
    return None


class Build:
    """llama-bench: ``--llama-bench``, else ``.peers/bin/llama-bench-{cuda,cpu}``, built in the background
    (``build_llama_bench.sh``, log in RESULTS/build.log) when it is missing or cannot run here."""

    def __init__(self, a, env: dict):
        self.a, self.env, self.proc, self.log_file = a, env, None, None
        self.kind = "cpu" if a.cpu_only else "cuda-native"
        default = PEERS / "bin" / ("llama-bench-cpu" if a.cpu_only else "llama-bench-cuda")
        self.path = Path(a.llama_bench.split(",")[0]) if a.llama_bench else default
        self.cmd = ["nice", "-n", str(a.build_nice), "bash", str(HERE / "build_llama_bench.sh"), self.kind]

    def start(self) -> None:
        why = binary_problem(self.path, self.env, not self.a.cpu_only)
        if why is None:
            log(f"build: {self.path} runs here")
            return
        if self.a.llama_bench:
            raise SystemExit(why)
        log(f"build: {why}; " + " ".join(self.cmd))
        self.t0 = time.perf_counter()
        self.log_file = open(Path(self.a.results) / "build.log", "a")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def wait(self, clock: Clock) -> Path | None:
        """The binary, once built; None when the build failed or ``clock`` ran out (the build is stopped and
        resumes in the next call)."""
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout=None if clock.deadline_s is None else max(1.0, clock.left() - 10))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 15)
                self.proc.wait()
                rc = None
            self.log_file.close()
            tail = (Path(self.a.results) / "build.log").read_text().splitlines()[-15:]
            if rc is None:
                log(f"build: stopped at the deadline after {time.perf_counter() - self.t0:.0f} s, at: " + tail[-1])
            elif rc != 0:
                log(f"build failed (rc {rc}):\n" + "\n".join(tail))
            else:
                log(f"build: {time.perf_counter() - self.t0:.0f} s")
            self.proc = None
        why = binary_problem(self.path, self.env, not self.a.cpu_only)
        if why is not None:
            log(f"build: {why}")
            return None
        return self.path


def salvage_jsonl(text: str) -> str:
    """The complete JSON lines of a llama-bench ``-o jsonl`` output (a stopped run's last line may be cut)."""
    good = []
    for ln in text.splitlines():
        try:
            json.loads(ln)
            good.append(ln)
        except json.JSONDecodeError:
            pass
    return "\n".join(good) + ("\n" if good else "")


def run_name(base: str, build: str = "", rnd: int = 1) -> str:
    """A run's result name: ``base`` (gpu-ncmoe14, cpu-t6, ...), then ``.build`` where several llama-bench
    builds run, then ``@rN`` from the second round on."""
    return base + (f".{build}" if build else "") + (f"@r{rnd}" if rnd > 1 else "")


def parse_run_name(name: str) -> tuple[str, str, int]:
    """(base, build, round) of a result name written by :func:`run_name`."""
    head, _, rnd = name.partition("@r")
    base, _, build = head.partition(".")
    return base, build, int(rnd) if rnd else 1


def llama_cmd(a, binary: Path, gguf: Path, extra: list[str], threads: list[int]) -> list[str]:
    return [str(binary), "-m", str(gguf), "-p", "0", "-n", str(a.tokens), "-r", str(a.reps),
            "-t", ",".join(map(str, threads)), *extra, "-o", "jsonl"]


def run_llama(a, clock: Clock, binary: Path, env: dict, gguf: Path, name: str, cmd: list[str]) -> bool:
    """One llama-bench process (one model load per level, every thread count) -> RESULTS/llama/NAME.jsonl."""
    out = Path(a.results) / "llama" / f"{name}.jsonl"
    if out.exists() and not a.force:
        log(f"llama {name}: done ({out})")
        return False
    if not clock.allows("llama", name):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"llama {name}: " + " ".join(cmd))
    t0 = time.perf_counter()
    p = run_logged(cmd, env, clock.limit(a.timeout))
    (out.parent / f"{name}.log").write_text(" ".join(cmd) + f"\nrc {p.returncode}\n" + p.stderr)
    lines = salvage_jsonl(p.stdout)
    if p.returncode != 0:
        log(f"llama {name} failed (rc {p.returncode}), {len(lines.splitlines())} results kept:\n" + p.stderr[-3000:])
        if not lines:
            return True
        out = out.with_name(f"{name}.partial.jsonl")
    out.write_text(lines)
    if p.returncode == 0:
        out.with_name(f"{name}.partial.jsonl").unlink(missing_ok=True)
    for ln in lines.splitlines():
        r = json.loads(ln)
        log(f"  t={r['n_threads']} ngl={r['n_gpu_layers']} ncmoe={r.get('n_cpu_moe')}: {r['avg_ts']:.1f} tokens/s")
    log(f"llama {name}: {time.perf_counter() - t0:.0f} s")
    return True


# ------------------------------------------------------------------------------------------------ edgemoe


def budget_gb(slots: int, expert_bytes: int) -> str:
    """decode.py's --budgets value for exactly ``slots`` slots (it takes ⌊GB·1e9 / row⌋)."""
    return f"{(slots + 0.5) * expert_bytes / 1e9:.6f}" if slots else "0"


def edgemoe_cmd(a, hf: Path, out: Path, args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "benchmarks" / "decode.py"), "--model", str(hf), "--load-format", "auto",
            "--routing", "model", "--decode-input", "random", "--tokens", str(a.tokens), "--warmup", "8",
            "--out", str(out), *args]


def salvage_decode(text: str) -> dict | None:
    """decode.json's content from a stopped decode.py's output: its ``profile:`` line and the result
    dicts it printed as each run finished (their ``repr``; an enum member such as ``<DecodePath.EAGER:
    'eager'>`` is read as its value); None when it printed no result."""
    def literal(s: str):
        return ast.literal_eval(re.sub(r"<[\w.]+: ('[^']*'|\d+)>", r"\1", s))

    prof, results = None, []
    for ln in text.splitlines():
        try:
            if ln.startswith("profile: isolated ") and ", concurrent " in ln:
                iso, conc = ln[len("profile: isolated "):].split(", concurrent ", 1)
                prof = {"isolated": literal(iso), "concurrent": literal(conc)}
            elif ln.startswith("{'policy'"):
                results.append(literal(ln))
        except (ValueError, SyntaxError):  # a line cut by the stop
            continue
    return {"meta": {"profile": prof, "salvaged": True}, "results": results} if results else None


def run_edgemoe(a, clock: Clock, name: str, cmd: list[str]) -> bool:
    """One benchmarks/decode.py process -> RESULTS/edgemoe/NAME/decode.json."""
    out = Path(a.results) / "edgemoe" / name
    if (out / "decode.json").exists() and not a.force:
        log(f"edgemoe {name}: done ({out})")
        return False
    if not clock.allows("edgemoe", name):
        return False
    out.mkdir(parents=True, exist_ok=True)
    log(f"edgemoe {name}: " + " ".join(cmd))
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    p = run_logged(cmd, env, clock.limit(a.timeout))
    (out / "decode.log").write_text(" ".join(cmd) + f"\nrc {p.returncode}\n" + p.stdout + p.stderr)
    if p.returncode != 0:
        part = salvage_decode(p.stdout)
        log(f"edgemoe {name} failed (rc {p.returncode}), {len(part['results']) if part else 0} results kept:\n"
            + (p.stdout + p.stderr)[-3000:])
        if part is None:
            return True
        (out / "decode.partial.json").write_text(json.dumps(part, indent=2))
        results = part["results"]
    else:
        results = json.loads((out / "decode.json").read_text())["results"]
        (out / "decode.partial.json").unlink(missing_ok=True)
    for r in results:
        log(f"  {r['budget_gb']} GB {r['policy']}: {r['tokens_per_s']:.1f} tokens/s, hit rate {r['hit_rate']:.3f}")
    log(f"edgemoe {name}: {time.perf_counter() - t0:.0f} s")
    return True


# ------------------------------------------------------------------------------------------------ table


def _load_llama(results: Path) -> list[dict]:
    rows = []
    for f in sorted((results / "llama").glob("*.jsonl")):
        for ln in f.read_text().splitlines():
            r = json.loads(ln)
            samples = r.get("samples_ts") or [r["avg_ts"]]
            # the median of the repetitions: the first one may page the mmapped GGUF back in (an edgemoe run
            # before it can have evicted it from the page cache), an outlier the mean would keep
            base, build, rnd = parse_run_name(f.name.removesuffix(".jsonl").removesuffix(".partial"))
            rows.append({"run": f.name, "base": base, "build": build, "round": rnd,
                         "threads": r["n_threads"], "ngl": r["n_gpu_layers"],
                         "ncmoe": r.get("n_cpu_moe", 0), "devices": r.get("devices"),
                         "tokens_per_s": statistics.median(samples), "mean": r["avg_ts"], "samples": samples,
                         "stddev": r["stddev_ts"], "backends": r.get("backends"), "build_commit": r.get("build_commit"),
                         "cpu_info": r.get("cpu_info"), "gpu_info": r.get("gpu_info")})
    return rows


def _load_edgemoe(results: Path) -> dict[str, dict]:
    out = {}
    for d in sorted((results / "edgemoe").glob("*")):
        for f in ("decode.json", "decode.partial.json"):
            if (d / f).exists():
                out[d.name] = json.loads((d / f).read_text())
                break
    return out


def _fmt(x: float | None, bound: float | None = None) -> str:
    if x is None:
        return "–"
    return f"{x:.1f}" + (f" ({bound:.0f})" if bound else "")


def _ratio(x: float | None, y: float | None) -> str:
    return f"{x / y:.2f}×" if x and y else "–"


def build_table(a, geo: dict) -> str:
    """RESULTS/peers.json (every figure, with bounds) and RESULTS/peers.md; returns the markdown."""
    res = Path(a.results)
    llama, edge = _load_llama(res), _load_edgemoe(res)
    n, k, row, e = geo["layers"], geo["top_k"], geo["expert_bytes"], geo["experts"]

    rounds: dict[tuple, dict[int, dict]] = {}  # (kind, threads, ncmoe) -> round -> {"llama": {build: ts}, "edgemoe"}

    def llama_match(ncmoe: int, t: int, cpu_only: bool) -> list[dict]:
        return [r for r in llama if r["threads"] == t and (r["ngl"] == 0) == cpu_only
                and (cpu_only or r["ncmoe"] == ncmoe)]

    def llama_at(ncmoe: int, t: int, cpu_only: bool = False) -> dict | None:
        """The setting's llama.cpp figure: per build the median over the rounds, the better build's."""
        by_build: dict[str, list[float]] = {}
        for r in llama_match(ncmoe, t, cpu_only):
            by_build.setdefault(r["build"], []).append(r["tokens_per_s"])
        if not by_build:
            return None
        medians = {b: statistics.median(v) for b, v in by_build.items()}
        best = max(medians, key=medians.get)
        return {"tokens_per_s": medians[best], "build": best, "by_build": medians}

    def edge_runs(name: str) -> list[tuple[int, dict]]:
        return sorted((parse_run_name(n)[2], d) for n, d in edge.items() if parse_run_name(n)[0] == name)

    def edge_pick(d: dict, slots: int | None, policy: str) -> dict | None:
        for r in d["results"]:
            resident = r["budget_gb"] == "all (resident)"
            if r["policy"] == policy and (resident if slots is None else not resident and r["slots"] == slots):
                return r
        return None

    def edge_at(name: str, slots: int | None, policy: str) -> dict | None:
        """The setting's edgemoe result, its tokens/s the median over the rounds (the other fields: the
        round whose tokens/s is nearest that median)."""
        found = [r for _, d in edge_runs(name) if (r := edge_pick(d, slots, policy)) is not None]
        if not found:
            return None
        med = statistics.median(r["tokens_per_s"] for r in found)
        return {**min(found, key=lambda r: abs(r["tokens_per_s"] - med)), "tokens_per_s": med,
                "rounds": len(found)}

    def profile(d: dict) -> dict | None:
        """decode.py's start-up profile: ``profile`` (a stopped run's salvage), else its one ``profiles`` entry
        (keyed by thread count; a run here has one count)."""
        meta = d.get("meta", {})
        return meta.get("profile") or next(iter((meta.get("profiles") or {}).values()), None)

    def b_h(name: str) -> float | None:
        vals = [p["isolated"]["b_h_gbps"] for _, d in edge_runs(name) if (p := profile(d))]
        return statistics.median(vals) if vals else None

    def pool_threads(name: str) -> int | None:
        """The CPU executor's threads in that run: a request above the cores free of the threads that run
        beside the pool is capped (on CUDA one core stays for the Python and driver threads)."""
        runs = edge_runs(name)
        t = runs[0][1].get("meta", {}).get("machine", {}).get("cpu_threads") if runs else None
        return t[0] if isinstance(t, list) and len(t) == 1 else t  # decode.py lists one count per setting

    def note_rounds(key: tuple, ncmoe: int, t: int, cpu_only: bool, name: str, slots: int | None,
                    policy: str) -> None:
        for r in llama_match(ncmoe, t, cpu_only):
            rounds.setdefault(key, {}).setdefault(r["round"], {}).setdefault("llama", {})[r["build"]] = \
                r["tokens_per_s"]
        for rnd, d in edge_runs(name):
            if (er := edge_pick(d, slots, policy)) is not None:
                rounds.setdefault(key, {}).setdefault(rnd, {})["edgemoe"] = er["tokens_per_s"]

    def threads_cell(r: dict) -> str:
        t, pool = r["threads"], r["edgemoe_pool_threads"]
        return f"{t} (edgemoe pool {pool})" if pool is not None and pool != t else str(t)

    rows = []
    levels = [(c, (n - c) * e) for c in a.ncmoe_levels]
    for t in [] if a.cpu_only else a.thread_list:
        name, bh = f"gpu-t{t}", b_h(f"gpu-t{t}")
        lres = llama_at(0, t)
        res_ms = 1e3 / lres["tokens_per_s"] if lres else None
        for ncmoe, slots in levels:
            lr = llama_at(ncmoe, t)
            cpu_gb = ncmoe * k * row / 1e9  # per token, llama.cpp's CPU experts
            row_out = {"kind": "gpu", "threads": t, "edgemoe_pool_threads": pool_threads(name), "ncmoe": ncmoe,
                       "slots": slots, "expert_vram_gb": slots * row / 1e9,
                       "llama": lr and lr["tokens_per_s"], "llama_cpu_gb_per_token": cpu_gb,
                       "llama_bound": 1e3 / (res_ms + cpu_gb / bh * 1e3) if res_ms and bh else None}
            note_rounds(("gpu", t, ncmoe), ncmoe, t, False, name, slots, a.policy_list[0])
            for pol in a.policy_list:
                # with 0 slots every policy serves every miss on the CPU: only the cpu-all run is reported
                r = edge_at(name, slots, pol) if slots or pol == "cpu-all" else None
                row_out[pol] = r and r["tokens_per_s"]
                row_out[pol + "_bound"] = r and r.get("bound_ms") and 1e3 / r["bound_ms"]
                row_out[pol + "_hit_rate"] = r and r["hit_rate"]
                row_out[pol + "_q_over_m"] = r and r["q_over_m_observed"]
            rows.append(row_out)
        er = edge_at(name, None, "static")
        rows.append({"kind": "resident", "threads": t, "edgemoe_pool_threads": pool_threads(name), "ncmoe": 0,
                     "slots": n * e, "expert_vram_gb": n * e * row / 1e9,
                     "llama": lres and lres["tokens_per_s"], "resident": er and er["tokens_per_s"]})
    for t in a.cpu_thread_list:
        lr = llama_at(n, t, cpu_only=True)
        er = edge_at(f"cpu-t{t}", 0, "cpu-all")
        note_rounds(("cpu-only", t, n), n, t, True, f"cpu-t{t}", 0, "cpu-all")
        bh = b_h(f"cpu-t{t}")
        gb = (geo["dense_bytes_per_token"] + n * k * row) / 1e9
        rows.append({"kind": "cpu-only", "threads": t, "edgemoe_pool_threads": pool_threads(f"cpu-t{t}"),
                     "llama": lr and lr["tokens_per_s"],
                     "cpu-all": er and er["tokens_per_s"], "gb_per_token": gb, "bound": bh and bh / gb})

    version = PEERS / "llama.cpp" / "PEERS_VERSION"
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": platform.platform(),
            "command": " ".join(sys.argv), "geometry": geo, "tokens": a.tokens, "reps": a.reps,
            "llama_cpp": version.read_text().splitlines() if version.exists() else None,
            "llama_build": next(({"commit": r["build_commit"], "cpu": r["cpu_info"], "gpu": r["gpu_info"]}
                                 for r in llama), None),
            "edgemoe_meta": {name: d["meta"] for name, d in edge.items()}}
    meta["rounds"] = {f"{k0} t{k1} ncmoe{k2}": per for (k0, k1, k2), per in rounds.items()}
    (res / "peers.json").write_text(json.dumps({"meta": meta, "rows": rows, "llama": llama,
                                                "edgemoe": {k2: v["results"] for k2, v in edge.items()}}, indent=2))
    md = [f"Tokens/s, tg{a.tokens}, batch 1; in parentheses the bytes bound in tokens/s (inputs in peers.json). "
          f"{n} layers, {geo['checkpoint_bytes'] / 1e9:.1f} GB per format; {meta['date']}.", ""]
    pols = a.policy_list
    if any(r["kind"] == "gpu" for r in rows):
        md += ["| expert VRAM | threads | llama.cpp | " + "".join(f"edgemoe {p} | ratio | " for p in pols)
               + f"{pols[0]} hit rate |", "|---|---|---|" + "---|---|" * len(pols) + "---|"]
    for r in rows:
        if r["kind"] == "gpu":
            vram = (f"{r['expert_vram_gb']:.2f} GB (-ncmoe {r['ncmoe']})" if r["slots"]
                    else f"none: all on CPU (-ncmoe {r['ncmoe']})")
            hit = r[pols[0] + "_hit_rate"]
            md.append(f"| {vram} | {threads_cell(r)} | {_fmt(r['llama'], r['llama_bound'])} | "
                      + "".join(f"{_fmt(r[p], r[p + '_bound'])} | {_ratio(r[p], r['llama'])} | " for p in pols)
                      + ("–" if hit is None else f"{hit:.3f}") + " |")
        elif r["kind"] == "resident":
            md.append(f"| all resident ({r['expert_vram_gb']:.1f} GB, -ncmoe 0) | "
                      f"{threads_cell(r)} | "
                      f"{_fmt(r['llama'])} | {_fmt(r['resident'])} | {_ratio(r['resident'], r['llama'])} | "
                      + "| | " * (len(pols) - 1) + "|")
    cpu_rows = [r for r in rows if r["kind"] == "cpu-only"]
    if cpu_rows:
        md += ["", (f"CPU-only (llama.cpp -ngl 0 -dev none; edgemoe --device cpu, cpu-all), "
                    f"{cpu_rows[0]['gb_per_token']:.2f} GB read per token; in parentheses the bound at decode.py's "
                    "B_H:"), "",
               "| threads | llama.cpp | edgemoe | ratio |", "|---|---|---|---|"]
        for r in cpu_rows:
            md.append(f"| {threads_cell(r)} | {_fmt(r['llama'])} | "
                      f"{_fmt(r['cpu-all'], r['bound'])} | "
                      f"{_ratio(r['cpu-all'], r['llama'])} |")
    if any(len(per) > 1 or any(len(v.get("llama", {})) > 1 for v in per.values()) for per in rounds.values()):
        builds = sorted({b for per in rounds.values() for v in per.values() for b in v.get("llama", {})})
        which = "cpu-all" if a.cpu_only else f"{pols[0]} offloaded, cpu-all CPU-only"
        md += ["", f"Every round (edgemoe: {which}; ratio: edgemoe over the round's faster llama.cpp build):", "",
               "| setting | threads | round | " + "".join(f"llama.cpp {b or 'build'} | " for b in builds)
               + "edgemoe | ratio |", "|---|---|---|" + "---|" * len(builds) + "---|---|"]
        for (kind, t, c), per in rounds.items():
            setting = "CPU-only" if kind == "cpu-only" else f"-ncmoe {c}"
            for rnd in sorted(per):
                lv, ev = per[rnd].get("llama", {}), per[rnd].get("edgemoe")
                md.append(f"| {setting} | {t} | {rnd} | " + "".join(f"{_fmt(lv.get(b))} | " for b in builds)
                          + f"{_fmt(ev)} | {_ratio(ev, max(lv.values()) if lv else None)} |")
    partial = [f.name for f in (res / "llama").glob("*.partial.jsonl")] + [
        d.name for d in (res / "edgemoe").glob("*")
        if (d / "decode.partial.json").exists() and not (d / "decode.json").exists()]
    if partial:
        md += ["", f"Runs stopped part-way (their finished results are in the table): {', '.join(sorted(partial))}."]
    text = "\n".join(md) + "\n"
    (res / "peers.md").write_text(text)
    return text


def publish(a, geo: dict | None) -> None:
    """Rewrite the table and, when $OUT is set, copy peers.md, peers.json and peers-results.tar.gz (every
    result file and log) there: after every run, so a call stopped by its time limit returns what it did."""
    res = Path(a.results)
    if geo is not None:
        build_table(a, geo)
    out = os.environ.get("OUT")
    if not out:
        return
    for f in ("peers.md", "peers.json"):
        if (res / f).exists():
            shutil.copy(res / f, Path(out) / f)
    tmp = Path(out) / "peers-results.tar.gz.part"
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(res, arcname="peers-results")
    os.replace(tmp, Path(out) / "peers-results.tar.gz")


# ------------------------------------------------------------------------------------------------ main


def plan(a, hf: Path, gguf: Path, binaries: list[Path], geo: dict) -> list[tuple[str, str, Path | None, list[str]]]:
    """The runs in the order they are made: (engine, name, llama-bench binary or None, command); round after
    round, each round's llama.cpp runs (every build) before its edgemoe runs."""
    n, e = geo["layers"], geo["experts"]
    budgets = ",".join(budget_gb((n - c) * e, geo["expert_bytes"]) for c in a.ncmoe_levels)
    res = Path(a.results) / "edgemoe"
    runs = []

    def edgemoe(base: str, rnd: int, args: list[str]):
        name = run_name(base, "", rnd)
        return ("edgemoe", name, None, edgemoe_cmd(a, hf, res / name, args))
    for rnd in range(1, a.rounds + 1):
        for binary in binaries:
            build = binary.name if len(binaries) > 1 else ""
            levels = [] if a.cpu_only else [*a.ncmoe_levels, 0]
            for c in levels:
                cmd = llama_cmd(a, binary, gguf, ["-ngl", "99", "-ncmoe", str(c)], a.thread_list)
                runs.append(("llama", run_name(f"gpu-ncmoe{c}", build, rnd), binary, cmd))
            runs.append(("llama", run_name("cpu", build, rnd), binary,
                         llama_cmd(a, binary, gguf, ["-ngl", "0", "-dev", "none"], a.cpu_thread_list)))
        gpu_runs = [] if a.cpu_only else [edgemoe(f"gpu-t{t}", rnd, [
            "--device", "cuda", "--budgets", budgets, "--policies", a.policies, "--cpu-threads", str(t)])
            for t in a.thread_list]
        cpu_runs = [edgemoe(f"cpu-t{t}", rnd, ["--device", "cpu", "--budgets", "0", "--policies", "cpu-all",
                                          "--no-resident", "--cpu-threads", str(t)]) for t in a.cpu_thread_list]
        runs += gpu_runs[:2] + cpu_runs + gpu_runs[2:]
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    ap.add_argument("--work", help="checkpoint folder (hf/, model-bf16.gguf); default: .peers/ckpt when its file "
                                   "system holds both formats, else /dev/shm/edgemoe-peers")
    ap.add_argument("--results", default=str(PEERS / "results"), help="result files and logs")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--config-overrides", default="{}",
                    help="JSON of HF config kwargs over the qwen3-30b-a3b preset (a smaller geometry, for tests)")
    ap.add_argument("--ncmoe", default="14,11",
                    help="expert VRAM levels as layers whose experts stay on the CPU (at 16 layers: 2.42 and 6.04 GB)")
    ap.add_argument("--threads", default="6,16,15",
                    help="thread counts of the GPU runs, in the order edgemoe runs them")
    ap.add_argument("--cpu-threads", default="16", help="thread counts of the CPU-only runs")
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU-only runs (a machine without a GPU)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="make every run this many times, round after round (the table takes the medians)")
    ap.add_argument("--policies", default="auto,qstar,cpu-all,static",
                    help="edgemoe policies of the GPU runs (the first one's hit rate is shown)")
    ap.add_argument("--tokenizer", default=str(PEERS / "carry" / "tokenizer"),
                    help="tokenizer folder for the checkpoint (a real Qwen3 tokenizer: llama.cpp's converter must "
                         "recognise it)")
    ap.add_argument("--no-token-routing", action="store_true", help="o_proj at the init std (degenerate routing)")
    ap.add_argument("--llama-bench", help="llama-bench binary (default: .peers/bin/llama-bench-cuda, or -cpu with "
                                          "--cpu-only, built when missing); several, comma-separated, run in turn")
    ap.add_argument("--llama-cpp", default=str(PEERS / "llama.cpp"), help="the stripped llama.cpp tree (for gguf-py)")
    ap.add_argument("--build-nice", type=int, default=0, help="nice level of the llama-bench build")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per llama-bench / decode.py process")
    ap.add_argument("--deadline", type=float, help="seconds for the whole session: no run starts that cannot fit")
    ap.add_argument("--force", action="store_true", help="rerun runs whose result file exists")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    a = ap.parse_args(argv)
    stages = [s for s in a.stages.split(",") if s]
    if bad := [s for s in stages if s not in STAGES]:
        raise SystemExit(f"--stages: unknown {bad}; choose from {STAGES}")
    try:
        overrides = json.loads(a.config_overrides)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--config-overrides: not JSON: {err}") from None
    a.ncmoe_levels = [int(c) for c in a.ncmoe.split(",") if c]
    a.thread_list = [int(t) for t in a.threads.split(",") if t]
    a.policy_list = [p for p in a.policies.split(",") if p]
    a.cpu_thread_list = [int(t) for t in a.cpu_threads.split(",") if t]
    if bad := [] if a.cpu_only else [c for c in a.ncmoe_levels if not 0 < c <= a.layers]:
        raise SystemExit(f"--ncmoe: {bad} outside 1..{a.layers} (--layers)")
    clock = Clock(a.deadline)
    geo = geometry(model_config(a.layers, overrides))
    want = {"layers": a.layers, "token_routing": not a.no_token_routing, "overrides": overrides}
    work = pick_work_dir(a, want, geo["checkpoint_bytes"])
    hf, gguf = work / "hf", work / "model-bf16.gguf"
    results = Path(a.results)
    restore = PEERS / "carry" / "peers-results.tar.gz"
    if restore.exists() and not (results / "llama").exists() and not (results / "edgemoe").exists() and not a.dry_run:
        # a machine that went cold between calls: the runs an earlier call returned in $OUT are not made again
        with tarfile.open(restore) as tar:
            tar.extractall(results.parent / "restore", filter="data")
        shutil.rmtree(results, ignore_errors=True)
        (results.parent / "restore" / "peers-results").rename(results)
        shutil.rmtree(results.parent / "restore")
        log(f"results restored from {restore}")
    results.mkdir(parents=True, exist_ok=True)
    env = bench_env()
    build = Build(a, env)
    extra = [Path(b) for b in (a.llama_bench or "").split(",")[1:] if b]  # builds beside the first, none built here
    ckpt_cmd = [sys.executable, str(HERE / "checkpoint.py"), "--out", str(work), "--layers", str(a.layers),
                "--llama-cpp", a.llama_cpp, "--tokenizer", a.tokenizer, "--config-overrides", json.dumps(overrides),
                *([] if a.no_token_routing else ["--token-routing"])]
    log(f"checkpoint folder {work} ({geo['checkpoint_bytes'] / 1e9:.1f} GB per format), results {results}, "
        f"{'no deadline' if a.deadline is None else f'deadline {a.deadline:.0f} s'}")
    if a.dry_run:
        print("build:", " ".join(build.cmd), f"(when {build.path} is missing or cannot run)")
        print("checkpoint:", " ".join(ckpt_cmd), "(when", work, "holds no complete checkpoint)")
        for engine, name, _, cmd in plan(a, hf, gguf, [build.path, *extra], geo):
            print(f"{engine} {name}:", " ".join(cmd))
        return 0

    if not (Path(a.llama_cpp) / "convert_hf_to_gguf.py").exists():
        tarball = PEERS / "carry" / "llama.cpp-src.tar.gz"
        if not tarball.exists():
            raise SystemExit(f"no {a.llama_cpp} and no {tarball}: run benchmarks/peers/fetch_llama_cpp.sh")
        subprocess.run(["tar", "-C", str(PEERS), "-xzf", str(tarball)], check=True)
    if "build" in stages:
        build.start()
    if "checkpoint" in stages:
        if checkpoint_complete(work, want) and not a.force:
            log(f"checkpoint: kept {work}")
        else:
            have = json.loads((hf / MARKER).read_text()) if (hf / MARKER).exists() else {}
            keep_hf = all(have.get(k) == v for k, v in want.items())
            if not keep_hf:
                shutil.rmtree(work, ignore_errors=True)
            log("checkpoint: " + " ".join(ckpt_cmd + (["--skip-hf"] if keep_hf else [])))
            t0 = time.perf_counter()
            rc = subprocess.run(ckpt_cmd + (["--skip-hf"] if keep_hf else []), check=False).returncode
            os.sync()  # the write-back of 2 x 21 GB must not run under the measurements
            log(f"checkpoint: rc {rc}, {time.perf_counter() - t0:.0f} s, {shutil.disk_usage(work).free / 1e9:.0f} GB "
                f"left in {work}")
    binary = build.wait(clock) if "build" in stages or "llama" in stages else None
    if not checkpoint_complete(work, want):
        log(f"no complete checkpoint in {work}: no runs (add the checkpoint stage)")
        publish(a, None)
        return 1
    if "llama" in stages:
        for b in extra:
            if (why := binary_problem(b, env, not a.cpu_only)) is not None:
                raise SystemExit(why)
    publish(a, geo)
    for engine, name, exe, cmd in plan(a, hf, gguf, [binary or build.path, *extra], geo):
        if engine not in stages:
            continue
        if engine == "llama" and binary is None:
            log(f"llama {name}: skipped, no llama-bench")
            continue
        ran = (run_llama(a, clock, exe, env, gguf, name, cmd) if engine == "llama"
               else run_edgemoe(a, clock, name, cmd))
        if ran:
            publish(a, geo)
    publish(a, geo)
    print((results / "peers.md").read_text(), flush=True)
    log(f"total {time.monotonic() - clock.t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
