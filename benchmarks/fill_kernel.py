"""The decode step's fill kernel against the copy engine, over a pool as large as a real one.

A decode step's fills run as one ``gather_fills`` launch per MoE layer: SM loads through the mapped address of
the page-locked host pool (zero-copy), the only way a CUDA graph can copy rows whose ids the device chose; the
start-up profile measures B_P through that kernel too (``edgemoe.experts.bandwidth.measure_fill``), and the prefill
stream copies whole layers with the copy engine (``cudaMemcpyAsync``). This measures both on the same
random rows of a pool of ``--pool-gb`` (a full-scale pool spans tens of GB; the host's IOMMU and the GPU's
translation of host pages see that span), ``--rows`` rows a call (one layer's fills), and sweeps the gather's
launch (programs per SM, warps per program, words per work item):

    python benchmarks/fill_kernel.py --pool-gb 40 --out results/

Prints GB/s per variant (1e9 bytes of packed rows a second, median of ``--rounds``) and writes
``fill_kernel.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from edgemoe.experts.pool import HostExpertPool
from edgemoe.kernels.gather import gather_fills

H, I = 2048, 768  # Qwen3-30B-A3B expert (9.44 MB bf16 rows)


def time_calls(copy, calls: int) -> float:
    """Seconds of ``calls`` calls of ``copy(i)`` on the current stream, synchronized before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        copy(i)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-gb", type=float, default=40.0, help="host pool the rows are drawn from (GB)")
    ap.add_argument("--rows", type=int, default=8, help="rows a call (a MoE layer's fills)")
    ap.add_argument("--calls", type=int, default=12, help="calls a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--programs", default="2,4,8", help="gather programs per SM")
    ap.add_argument("--warps", default="4,8,16", help="gather warps per program")
    ap.add_argument("--words", default="1024,2048,4096", help="gather 8-byte words per work item")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    pool = HostExpertPool.dense(int(a.pool_gb * 1e9 // (3 * H * I * 2)), H, I, torch.bfloat16)
    t0 = time.perf_counter()
    if not pool.pin():
        print("error: the pool could not be page-locked", file=sys.stderr)
        return 1
    print(f"pool {pool.num_ids} rows of {pool.row_bytes / 1e6:.2f} MB = {pool.nbytes / 1e9:.1f} GB, page-locked in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    bank = torch.empty((a.rows, pool.row_bytes), dtype=torch.uint8, device=dev)
    g = torch.Generator().manual_seed(0)
    n = a.calls * a.rounds
    fids = [torch.randperm(pool.num_ids, generator=g)[:a.rows] for _ in range(n)]
    fids_dev = [f.to(dev) for f in fids]
    slots = torch.arange(a.rows, device=dev)
    meta = torch.tensor([0, 0, a.rows, 0], dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    moved = a.calls * a.rows * pool.row_bytes

    def copier(launch: tuple[int, int, int] | None, r: int):
        """Call ``i`` of round ``r``: the copy engine row by row (``launch`` None) or one gather launch of
        ``(programs per SM, warps, words)``."""
        def copy(i):
            k = r * a.calls + i
            if launch is None:
                for j, f in enumerate(fids[k].tolist()):
                    bank[j].copy_(pool.bank[f], non_blocking=True)
            else:
                gather_fills(meta, fids_dev[k], slots, pool.bank, bank, num_programs=launch[0] * sms,
                             block_words=launch[2], num_warps=launch[1])
        return copy

    variants: dict[str, tuple[int, int, int] | None] = {"memcpy (copy engine)": None}
    for launch in itertools.product(*[[int(x) for x in s.split(",") if x] for s in (a.programs, a.warps, a.words)]):
        variants["gather {}/SM {} warps {} words".format(*launch)] = launch
    for launch in variants.values():
        time_calls(copier(launch, 0), 2)  # warm-up (compiles)
    results: dict[str, list[float]] = {}
    for r in range(a.rounds):  # variants alternate within a round
        for name, launch in variants.items():
            results.setdefault(name, []).append(moved / time_calls(copier(launch, r), a.calls) / 1e9)
    rows = {k: {"gbps": statistics.median(v), "rounds": v} for k, v in results.items()}
    best = max((k for k in rows if k.startswith("gather")), key=lambda k: rows[k]["gbps"])
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]["gbps"]):
        print(f"{k:40s} {v['gbps']:6.1f} GB/s" + ("   <- best gather" if k == best else ""))
    meta_out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(),
                "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
                "pool_gb": pool.nbytes / 1e9, "rows": a.rows, "row_bytes": pool.row_bytes, "sms": sms}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fill_kernel.json").write_text(json.dumps({"meta": meta_out, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
