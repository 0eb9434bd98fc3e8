"""Fill bandwidth under CPU-executor load: zero-copy Triton gather vs copy-engine memcpy.

The q* split assumes host→GPU fills keep B_P while the CPU executor streams other experts from the
same DRAM. This measures, for Qwen3-30B-A3B-shaped experts (9.44 MB), the
fill bandwidth of ``gather_fills`` (SM loads through the host pointer) and of per-row
``cudaMemcpyAsync`` (copy engine), each alone and while the native CPU executor runs steps in a
background thread; and the CPU executor's bandwidth alone and under each kind of fill.

    python benchmarks/fill_contention.py --threads 12 --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.experts.native import NativeCpuExecutor
from edgemoe.experts.pool import HostExpertPool
from edgemoe.kernels.gather import gather_fills

H, I = 2048, 768


class CpuLoad:
    """Runs 8-expert decode steps on the native executor over a rotating pool until stopped."""

    def __init__(self, pool: HostExpertPool, threads: int):
        self.ex = NativeCpuExecutor(pool, threads)
        self.pool = pool
        self.bytes = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        x = torch.randn(1, H, dtype=torch.bfloat16)
        out = torch.zeros(1, H)
        tok, wt = torch.zeros(1, dtype=torch.int64), torch.ones(1)
        fid = 0
        while not self.stop.is_set():
            work = [((fid + j) % self.pool.num_ids, tok, wt) for j in range(8)]
            self.ex.run(x, work, out)
            fid = (fid + 8) % self.pool.num_ids
            self.bytes += 8 * self.pool.row_bytes

    def __enter__(self):
        self.thread.start()
        time.sleep(0.2)
        self.t0, self.b0 = time.perf_counter(), self.bytes
        return self

    def __exit__(self, *exc):
        self.gbps = (self.bytes - self.b0) / (time.perf_counter() - self.t0) / 1e9
        self.stop.set()
        self.thread.join()


def time_fills(kind: str, src: HostExpertPool, bank: torch.Tensor, q: int, reps: int) -> float:
    """GB/s of copying ``q`` packed expert rows per call into ``bank``, ``reps`` calls, rotating over the source
    rows."""
    dev = bank.device
    meta = torch.tensor([0, 0, q, 0], dtype=torch.int32, device=dev)
    slots = torch.arange(q, dtype=torch.int64, device=dev)
    fids = [torch.arange(i * q, (i + 1) * q, dtype=torch.int64, device=dev) % src.num_ids for i in range(reps)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(reps):
        if kind == "gather":
            gather_fills(meta, fids[i], slots, src.bank, bank)
        else:
            for j in range(q):
                f = (i * q + j) % src.num_ids
                bank[j].copy_(src.bank[f], non_blocking=True)
    torch.cuda.synchronize()
    return reps * q * src.row_bytes / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=12, help="CPU executor threads")
    ap.add_argument("--fill-gb", type=float, default=4.0, help="host pool the fills read (GB)")
    ap.add_argument("--cpu-gb", type=float, default=3.0, help="host pool the CPU executor reads (GB)")
    ap.add_argument("--q", type=int, default=8, help="experts per fill call (a layer's fills)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    row = 3 * H * I * 2
    fill_pool = HostExpertPool.dense(int(a.fill_gb * 1e9 // row), H, I, torch.bfloat16)
    cpu_pool = HostExpertPool.dense(int(a.cpu_gb * 1e9 // row), H, I, torch.bfloat16)
    for p in (fill_pool, cpu_pool):
        p.fill_random(0)
    fill_pool.pin()
    banks = torch.empty((a.q, fill_pool.row_bytes), dtype=torch.uint8, device="cuda")
    for kind in ("gather", "memcpy"):  # warm up (Triton compiles)
        time_fills(kind, fill_pool, banks, a.q, 2)
    res = {}
    with CpuLoad(cpu_pool, a.threads) as load:
        time.sleep(1.0)
    res["cpu_alone_gbps"] = load.gbps
    for kind in ("gather", "memcpy"):
        res[f"{kind}_alone_gbps"] = time_fills(kind, fill_pool, banks, a.q, a.reps)
        with CpuLoad(cpu_pool, a.threads) as load:
            res[f"{kind}_under_cpu_gbps"] = time_fills(kind, fill_pool, banks, a.q, a.reps)
        res[f"cpu_under_{kind}_gbps"] = load.gbps
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
            "gpu": torch.cuda.get_device_name(), "threads": a.threads, "q": a.q, "expert_mb": row / 1e6}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fill_contention.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2))
    for k, v in res.items():
        print(f"{k:28s} {v:7.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
