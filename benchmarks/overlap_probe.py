"""Copy/compute overlap probe: does a host-to-device copy on a side stream run while kernels run?

Streamed prefill and the decode fills rely on the GPU running a pinned host-to-device copy on its copy
engine while kernels run on the compute stream. This probe times, with CUDA events, a copy of ``--mb``
MB from pinned host memory alone, a chain of bf16 matmuls sized to take about as long alone, and the two
issued together: the copy on a side stream (``torch.cuda.Stream()``, as the engine's copy stream) with
the matmuls on the default stream (as the engine's compute), then with the matmuls on a second side
stream. Overlap = (copy + compute − together) / min(copy, compute): 1 when the shorter one hides
entirely under the other, 0 when they run one after the other.

    python benchmarks/overlap_probe.py [--mb 512] [--repeats 3] [--out overlap.json]

Prints one line per arrangement and a summary line; exits 0 (the probe measures, it does not judge).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, the device synchronized around each."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def probe(mb: int = 512, repeats: int = 3) -> dict:
    """The probe (module docstring) on the current CUDA device; seconds and overlap fractions.

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("the overlap probe needs a CUDA device")
    dev = torch.device("cuda")
    src = torch.empty(mb << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(mb << 20, dtype=torch.uint8, device=dev)
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev)
    side, side2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def copy():
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream(dev))
            dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(dev).wait_stream(side)

    def matmuls(n):
        b = a
        for _ in range(n):
            b = a @ b
        return b

    _timed(copy, 1)
    t_one = _timed(lambda: matmuls(4), repeats) / 4
    t_copy = _timed(copy, repeats)
    n = max(1, round(t_copy / t_one))
    t_compute = _timed(lambda: matmuls(n), repeats)

    def together_default():
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream(dev))
            dst.copy_(src, non_blocking=True)
        matmuls(n)
        torch.cuda.current_stream(dev).wait_stream(side)

    def together_side():
        cur = torch.cuda.current_stream(dev)
        for s in (side, side2):
            s.wait_stream(cur)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        with torch.cuda.stream(side2):
            matmuls(n)
        for s in (side, side2):
            cur.wait_stream(s)

    res = {"mb": mb, "copy_s": t_copy, "copy_gbps": (mb << 20) / t_copy / 1e9, "matmuls": n, "compute_s": t_compute}
    for name, fn in (("default", together_default), ("side", together_side)):
        t = _timed(fn, repeats)
        res[f"together_{name}_s"] = t
        res[f"overlap_{name}"] = (t_copy + t_compute - t) / min(t_copy, t_compute)
    props = torch.cuda.get_device_properties(dev)
    res["gpu"] = props.name
    res["async_engine_count"] = getattr(props, "async_engine_count", None)
    res["cuda_device_max_connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512, help="MB copied from pinned host memory")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the result as JSON here")
    a = ap.parse_args(argv)
    try:
        r = probe(a.mb, a.repeats)
    except RuntimeError as e:
        print(f"overlap probe: {e}")
        return 0
    print(f"overlap probe ({r['gpu']}): copy {r['mb']} MB {r['copy_s'] * 1e3:.1f} ms ({r['copy_gbps']:.1f} GB/s), "
          f"{r['matmuls']} matmuls {r['compute_s'] * 1e3:.1f} ms; together, compute on the default stream "
          f"{r['together_default_s'] * 1e3:.1f} ms (overlap {r['overlap_default']:.2f}), on a side stream "
          f"{r['together_side_s'] * 1e3:.1f} ms (overlap {r['overlap_side']:.2f}); CUDA_DEVICE_MAX_CONNECTIONS="
          f"{r['cuda_device_max_connections']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
