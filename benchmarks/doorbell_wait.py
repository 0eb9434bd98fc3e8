"""The doorbell's two waits on the GPU: the polling kernel against stream memory operations.

The device decode step hands a layer's CPU experts to the native executor through a doorbell in
pinned memory and waits for the answer (``edgemoe/kernels/doorbell.py``): ``kernel`` polls the done
word from a one-program kernel (an SM kept busy for the whole wait), ``stream-op`` waits with
``cuStreamWaitValue32`` in the GPU's front end (no SM). Per wait mode this measures, on one GPU:

(a) wake-up: a CUDA graph of ring -> wait -> timestamp, answered by a host thread after a delay of
    0 / 50 / 200 / 500 µs: the round trip (``%globaltimer`` before the ring and after the wait) minus
    the host's measured delay is the hand-off's own cost (ring reaching the host, the host seeing it,
    the answer waking the device);
(b) the cost of waiting to other GPU work: a bf16 matmul's throughput on a second stream, alone and
    while waits of 50-500 µs are pending on the first; and, where ``pynvml`` is installed, the GPU's
    power draw and SM clock while waits are pending with nothing else running, against idle before and
    after (each sampled once the power reading has settled);
(c) end to end: greedy decode tokens/s of a small random-weight Qwen3-MoE checkpoint (made here with
    ``make_model``) on the device path in CUDA graphs, CPU branch on (qstar with a fixed B_P/B_H),
    and the tokens of both modes compared (they must be identical).

Writes ``doorbell_wait.json`` and ``doorbell_wait.md`` into ``--out``. About a minute on an H200.

    python benchmarks/doorbell_wait.py --out results/doorbell_wait

The realistic decode comparison is ``benchmarks/decode.py ... --doorbell-wait kernel`` against
``--doorbell-wait stream-op`` on the same checkpoint and budget.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ("kernel", "stream-op")


def _stamp_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stamp(ts_ptr, count_ptr, SLOT: tl.constexpr):
        """ts[2 i + SLOT] = %globaltimer (ns); the SLOT 1 stamp advances i."""
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        i = tl.load(count_ptr)
        tl.store(ts_ptr + 2 * i + SLOT, t)
        if SLOT == 1:
            tl.store(count_ptr, i + 1)

    return stamp


class Responder(threading.Thread):
    """Answers the doorbell from the host: on a new request word, waits ``delay_us`` (busy), then
    stores the done word and the release word, as the executor's server does. It spins holding the
    GIL; the main thread only needs it to enqueue replays (``main`` shortens the switch interval)."""

    def __init__(self, bell: torch.Tensor, delay_us: float):
        from edgemoe.kernels import doorbell

        super().__init__(daemon=True)
        self.words = bell.numpy()  # int64 view of the pinned doorbell
        self.release = doorbell.release_word(bell).numpy()
        self.delay_s = delay_us * 1e-6
        self.stop = threading.Event()
        self.delays: list[float] = []  # µs from seeing a request to answering it

    def __enter__(self) -> "Responder":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()

    def run(self):
        last = int(self.words[0])
        words, clock, stop = self.words, time.perf_counter, self.stop
        while not stop.is_set():
            req = int(words[0])
            if req == last:
                continue
            t0 = clock()
            while clock() - t0 < self.delay_s:
                pass
            words[8] = req
            self.release[0] = 1
            self.delays.append((time.perf_counter() - t0) * 1e6)
            last = req


class Bench:
    """One doorbell per mode, and a CUDA graph of ``per_graph`` ring -> wait -> stamp iterations."""

    def __init__(self, mode: str, device: torch.device, per_graph: int, capacity: int):
        from edgemoe.kernels import cuda_driver, doorbell

        self.mode, self.device, self.per_graph, self.capacity = mode, device, per_graph, capacity
        self.bell = torch.zeros(doorbell.BELL_WORDS, dtype=torch.int64, pin_memory=True)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        self.ts = torch.zeros(2 * capacity, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.address = cuda_driver.host_device_pointer(doorbell.release_word(self.bell), device) \
            if mode == "stream-op" else None
        self.stamp = _stamp_kernel()
        self.stream = torch.cuda.Stream(device)
        with Responder(self.bell, 0.0):  # one eager iteration compiles the kernels outside the capture
            with torch.cuda.stream(self.stream):
                self._iteration()
            self.stream.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=self.stream):
            for _ in range(self.per_graph):
                self._iteration()

    def _iteration(self):
        from edgemoe.kernels import doorbell

        self.stamp[(1,)](self.ts, self.count, SLOT=0, num_warps=1)
        doorbell.ring(self.seq, self.bell, release=self.address is not None)
        if self.address is not None:
            doorbell.wait_stream_op(self.address, torch.cuda.current_stream(self.device).cuda_stream)
        else:
            doorbell.wait(self.seq, self.bell)
        self.stamp[(1,)](self.ts, self.count, SLOT=1, num_warps=1)

    def enqueue(self, iterations: int) -> None:
        """Replay the graph on this bench's stream for at least ``iterations`` iterations (no sync)."""
        replays = -(-iterations // self.per_graph)
        if replays * self.per_graph > self.capacity:
            raise ValueError(f"{iterations} iterations exceed the timestamp buffer ({self.capacity})")
        with torch.cuda.stream(self.stream):
            self.count.zero_()
            for _ in range(replays):
                self.graph.replay()

    def round_trips_us(self) -> list[float]:
        n = int(self.count[0])
        ts = self.ts[: 2 * n].view(n, 2).cpu()
        return ((ts[:, 1] - ts[:, 0]).double() / 1e3).tolist()


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def wakeup(benches: dict[str, Bench], delays: list[float], iterations: int) -> list[dict]:
    rows = []
    for d in delays:
        for mode, b in benches.items():
            with Responder(b.bell, d) as r:
                b.enqueue(iterations)
                b.stream.synchronize()
            rt = b.round_trips_us()[4:]  # the first ones overlap the host enqueueing the replays
            host = statistics.median(r.delays) if r.delays else float("nan")
            rows.append({"mode": mode, "delay_us": d, "n": len(rt), "round_trip_us_p50": _q(rt, 0.5),
                         "round_trip_us_p90": _q(rt, 0.9), "host_delay_us_p50": host,
                         "handoff_us_p50": _q(rt, 0.5) - host})
    return rows


def _matmul_tflops(device: torch.device, n: int, reps: int, stream: torch.cuda.Stream,
                   before=None) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        torch.matmul(a, b, out=c)  # warm
    stream.synchronize()
    if before is not None:
        before()
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) * 1e-3) / 1e12


def contention(benches: dict[str, Bench], delays: list[float], device: torch.device, n: int,
               reps: int, handoff_us: dict[str, float]) -> list[dict]:
    side = torch.cuda.Stream(device)
    alone = _matmul_tflops(device, n, reps, side)
    alone_s = 2 * n**3 * reps / (alone * 1e12)
    rows = [{"mode": "none", "delay_us": None, "tflops": alone, "relative": 1.0}]
    for d in delays:
        for mode, b in benches.items():
            per = d + handoff_us.get(mode, 20.0)
            iterations = int(1.5 * alone_s * 1e6 / per) + b.per_graph
            with Responder(b.bell, d):
                tf = _matmul_tflops(device, n, reps, side, before=lambda b=b, it=iterations: b.enqueue(it))
                b.stream.synchronize()
            rows.append({"mode": mode, "delay_us": d, "tflops": tf, "relative": tf / alone})
    return rows


def power(benches: dict[str, Bench], device: torch.device, seconds: float, delay_us: float) -> dict:
    if importlib.util.find_spec("pynvml") is None:
        return {"skipped": "pynvml is not installed (pip install nvidia-ml-py)"}
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)

    def sample(until: float) -> dict:
        w, clk = [], []
        while time.perf_counter() < until:
            w.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1e3)
            clk.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
            time.sleep(0.05)
        return {"watts_mean": statistics.fmean(w), "sm_mhz_mean": statistics.fmean(clk), "samples": len(w)}

    def settle(limit_s: float = 15.0) -> None:
        # the power reading is an average over about a second and lags the work before it (the matmuls of
        # part (b)): wait until it stops falling (under 2 % over half a second), at most limit_s
        end, last = time.perf_counter() + limit_s, pynvml.nvmlDeviceGetPowerUsage(h)
        while time.perf_counter() < end:
            time.sleep(0.5)
            now = pynvml.nvmlDeviceGetPowerUsage(h)
            if now > 0.98 * last:
                return
            last = now

    torch.cuda.synchronize(device)
    settle()
    out = {"idle": sample(time.perf_counter() + seconds), "delay_us": delay_us}
    for mode, b in benches.items():
        with Responder(b.bell, delay_us):
            b.enqueue(int(seconds * 1e6 / (delay_us + 20)))
            out[mode] = sample(time.perf_counter() + seconds)
            b.stream.synchronize()
    settle()
    out["idle after"] = sample(time.perf_counter() + seconds)
    return out


def end_to_end(device: torch.device, tokens: int, warmup: int, slots: int) -> list[dict]:
    from edgemoe.config import EngineConfig
    from edgemoe.core import Phase, StepInput
    from edgemoe.engine.model_runner import ModelRunner
    from edgemoe.synth import make_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp) / "m", "qwen3_moe", "small", seed=5, dtype="bfloat16")
        for mode in MODES:
            cfg = EngineConfig(device=str(device), expert_policy="qstar", expert_cache_slots=slots,
                               bandwidth_pcie_gbps=10.0, bandwidth_cpu_gbps=25.0, doorbell_wait=mode)
            runner = ModelRunner(Path(tmp) / "m", cfg, progress=False)
            prompt = list(range(5, 45))
            tok = [int(runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)[0].argmax())]
            t0 = None
            for s in range(warmup + tokens):
                if s == warmup:
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                logits = runner.execute([StepInput(0, [tok[-1]], len(prompt) + s)], Phase.DECODE)
                tok.append(int(logits[0].argmax()))
            dt = time.perf_counter() - t0
            st = runner.experts.stats()["decode"]
            rows.append({"mode": mode, "tokens_per_s": tokens / dt, "decode_path": runner.experts.decode_path.value,
                         "doorbell_wait": runner.experts.doorbell_wait, "cpu_experts": st["cpu"],
                         "tokens": tok})
            runner.free(0)
            del runner
            torch.cuda.empty_cache()
    return rows


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Doorbell wait: polling kernel vs stream memory operations ({m['gpu']}, driver {m['driver']})", "",
             "## (a) wake-up: ring -> wait round trip, host answering after a delay", "",
             "| wait | host delay µs | round trip p50 µs | p90 µs | hand-off p50 µs (round trip - delay) |",
             "|---|---|---|---|---|"]
    for r in res["wakeup"]:
        lines.append(f"| {r['mode']} | {r['delay_us']:.0f} | {r['round_trip_us_p50']:.1f} | "
                     f"{r['round_trip_us_p90']:.1f} | {r['handoff_us_p50']:.1f} |")
    lines += ["", f"## (b) cost to a concurrent bf16 matmul ({m['matmul_n']}³) on another stream", "",
              "| wait | pending wait µs | TFLOP/s | vs no wait |", "|---|---|---|---|"]
    for r in res["contention"]:
        d = "–" if r["delay_us"] is None else f"{r['delay_us']:.0f}"
        lines.append(f"| {r['mode']} | {d} | {r['tflops']:.1f} | {r['relative']:.3f} |")
    p = res.get("power", {})
    if "skipped" not in p and p:
        lines += ["", f"GPU with waits of {p['delay_us']:.0f} µs pending and nothing else running (NVML):", "",
                  "| state | W | SM MHz |", "|---|---|---|"]
        for k in ("idle", *MODES, "idle after"):
            if k in p:
                lines.append(f"| {k} | {p[k]['watts_mean']:.1f} | {p[k]['sm_mhz_mean']:.0f} |")
    elif p:
        lines += ["", f"Power: {p['skipped']}."]
    if res.get("end_to_end"):
        lines += ["", "## (c) decode tokens/s, qwen3_moe small (bf16), qstar with a CPU branch, CUDA graphs", "",
                  "| wait | tokens/s | decode path | CPU experts |", "|---|---|---|---|"]
        for r in res["end_to_end"]:
            lines.append(f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['decode_path']} | {r['cpu_experts']} |")
        lines.append("")
        lines.append(f"Tokens identical across modes: {res['tokens_identical']}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default=",".join(MODES), help="wait modes to measure, comma-separated")
    ap.add_argument("--delays-us", default="0,50,200,500", help="host answer delays of (a)")
    ap.add_argument("--pending-us", default="50,200,500", help="pending-wait lengths of (b)")
    ap.add_argument("--iterations", type=int, default=400, help="round trips per (mode, delay) in (a)")
    ap.add_argument("--per-graph", type=int, default=16, help="ring -> wait iterations per captured graph")
    ap.add_argument("--matmul-n", type=int, default=8192, help="square bf16 matmul size of (b)")
    ap.add_argument("--matmul-reps", type=int, default=100, help="matmuls per measurement of (b)")
    ap.add_argument("--power-seconds", type=float, default=2.0, help="NVML sampling per state (0: skip)")
    ap.add_argument("--tokens", type=int, default=64, help="timed decode tokens of (c) (0: skip (c))")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--slots", type=int, default=48, help="expert-cache slots of (c) (of 224 experts)")
    ap.add_argument("--out", default=".", help="folder for doorbell_wait.json and doorbell_wait.md")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    if bad := sorted(set(modes) - set(MODES)):
        ap.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from edgemoe.kernels import cuda_driver

    device = torch.device(a.device)
    if "stream-op" in modes and (why := cuda_driver.unavailable_reason(device)) is not None:
        print(f"stream-op left out: {why}", flush=True)
        modes.remove("stream-op")
    delays = [float(d) for d in a.delays_us.split(",") if d]
    pending = [float(d) for d in a.pending_us.split(",") if d]
    sys.setswitchinterval(1e-4)  # the spinning responder hands the GIL over within 0.1 ms
    t_start = time.perf_counter()
    cap = max(a.iterations, 200_000) + a.per_graph
    benches = {m: Bench(m, device, a.per_graph, cap) for m in modes}
    res: dict = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                          "driver": cuda_driver.driver_version(), "cuda_runtime": torch.version.cuda,
                          "matmul_n": a.matmul_n, "modes": modes}}
    res["wakeup"] = wakeup(benches, delays, a.iterations)
    print(f"(a) done at {time.perf_counter() - t_start:.0f} s", flush=True)
    handoff = {r["mode"]: r["handoff_us_p50"] for r in res["wakeup"] if r["delay_us"] == min(delays)}
    res["contention"] = contention(benches, pending, device, a.matmul_n, a.matmul_reps, handoff)
    print(f"(b) done at {time.perf_counter() - t_start:.0f} s", flush=True)
    if a.power_seconds > 0:
        res["power"] = power(benches, device, a.power_seconds, max(pending))
    if a.tokens > 0 and len(modes) == len(MODES):
        res["end_to_end"] = end_to_end(device, a.tokens, a.warmup, a.slots)
        res["tokens_identical"] = len({tuple(r["tokens"]) for r in res["end_to_end"]}) == 1
        print(f"(c) done at {time.perf_counter() - t_start:.0f} s", flush=True)
    res["meta"]["seconds"] = time.perf_counter() - t_start
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "doorbell_wait.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (out / "doorbell_wait.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
