"""Tile sweep of the decode expert GEMVs (``edgemoe.kernels.expert_gemv``) at batch 1: bandwidth per config.

At Qwen3-30B-A3B geometry (H=2048, I=768, top-8, bf16) a decode step's ``_gate_up_kernel`` reads 50.3 MB
and ``_down_kernel`` 25.2 MB per MoE layer; profiled in the CUDA-graph step they take 18.0 and 15.4 us
(~2.3 TB/s of the H200's ~4.8). This script times each kernel over a set of tiles (rows per program,
columns per iteration, warps, pipeline stages) the way the decode step runs them: ``--layers`` launches
captured in one CUDA graph, each reading the 8 experts of its own layer's bank (distinct weights every
launch, so nothing is served from L2), replayed ``--iters`` times. It reports us per launch, GB/s of
weight bytes, the share of a device-to-device copy's bandwidth, and how far each config's output is from
the current tiles' (other tiles change the float32 summation order: bits may differ, values agree to
rounding). The current tiles come first; ``route sum`` rows time the down launch with the in-kernel
``Σ_k`` on and off.

    python benchmarks/expert_gemv_sweep.py                  # ~30-60 s on an H200, most of it compiling
    python benchmarks/expert_gemv_sweep.py --tokens 1,4 --out results/
    python benchmarks/expert_gemv_sweep.py --quant fp8,mxfp4,nvfp4   # the packed formats' kernels

``--quant`` times ``expert_gemv_quant`` (weights dequantized in registers) over tiles of (rows per program,
elements of a row per iteration, warps) at the same geometry, weights in the cache's slot-row layout with random
codes and ordinary scales; GB/s count packed bytes (codes and scales). ``bf16`` in the list is the float sweep.

Needs CUDA. Results go to stdout and, with ``--out`` (or ``$OUT``), ``expert_gemv_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, I, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B MoE layer

# (rows per program, columns per iteration, warps, stages or None for Triton's default); the first is current
GATE_UP = [(4, 256, 4, None), (8, 256, 4, None), (16, 256, 4, None), (8, 128, 4, None), (8, 512, 4, None),
           (4, 512, 4, None), (16, 512, 8, None), (8, 256, 8, None), (8, 256, 2, None), (32, 256, 8, None),
           (16, 128, 4, None), (8, 256, 4, 2), (8, 256, 4, 4)]
DOWN = [(16, 256, 2, None), (16, 256, 4, None), (8, 256, 4, None), (32, 256, 4, None), (16, 128, 4, None),
        (16, 512, 4, None), (8, 512, 4, None), (32, 256, 8, None), (64, 256, 8, None), (4, 256, 2, None),
        (32, 128, 4, None), (16, 256, 4, 2), (16, 256, 4, 4)]
QUICK = 5  # --quick: the first configs of each list only
# (rows per program, elements per iteration, warps) of the packed formats' launches, added to each format's
# current tiles (QUANT_TILES, run first)
QUANT_GATE_UP = [(4, 512, 4), (16, 512, 4), (8, 256, 4), (8, 1024, 4), (8, 512, 8), (16, 512, 8), (4, 256, 2),
                 (16, 1024, 8), (32, 512, 8), (8, 512, 2)]
QUANT_DOWN = [(8, 256, 4), (32, 256, 4), (16, 512, 4), (16, 128, 4), (16, 256, 2), (32, 256, 8), (64, 256, 8),
              (8, 256, 2), (16, 1024, 4)]


def graph_seconds(launch, layers: int, iters: int) -> float:
    """Seconds per launch: ``launch(layer)`` for every layer captured in one CUDA graph, replayed ``iters`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for layer in range(layers):  # compile and warm up outside the capture
            launch(layer)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(layers):
            launch(layer)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters / layers


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3)


def step_inputs(T: int, layers: int, dev: torch.device) -> tuple:
    """A decode step's inputs at ``T`` tokens: per layer the routes' slots (``T·k`` distinct experts of that layer's
    128 per token), the hidden states, the router weights, and per layer the activation and output buffers."""
    P = T * K
    g = torch.Generator().manual_seed(0)
    slots = [torch.stack([torch.randperm(E, generator=g)[:K] + layer * E for _ in range(T)]).to(torch.int32)
             .flatten().to(dev) for layer in range(layers)]
    x = torch.randn(T, H, generator=g).to(dev, torch.bfloat16)
    wts = torch.rand(T, K, generator=g).to(dev)
    acts = [torch.empty(P, I, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    outs = [torch.empty(T, K, H, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    return slots, x, wts, acts, outs


def sweep(T: int, a: argparse.Namespace, w13: torch.Tensor, w2: torch.Tensor, copy_bps: float) -> list[dict]:
    import triton

    from edgemoe.kernels.expert_gemv import _down_kernel, _gate_up_kernel, route_sum_counters

    dev, L, P = w13.device, a.layers, T * K
    slots, x, wts, acts, outs = step_inputs(T, L, dev)
    y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    counters = route_sum_counters(T, H, dev)
    rows = []

    def gate_up(bi, bh, nw, ns):
        def launch(layer):
            extra = {} if ns is None else {"num_stages": ns}
            _gate_up_kernel[(P, triton.cdiv(I, bi))](x, slots[layer], w13, w13, acts[layer], K, H, I, x.stride(0),
                                                     w13.stride(0), 0, 1.0, 0.0, OAI=False, HAS_BIAS=False, BLOCK_I=bi,
                                                     BLOCK_H=bh, num_warps=nw, **extra)
        return launch

    def down(bo, bk, nw, ns, summed=False):
        def launch(layer):
            extra = {} if ns is None else {"num_stages": ns}
            _down_kernel[(P, triton.cdiv(H, bo))](acts[layer], slots[layer], w2, w2, wts, outs[layer], y, counters, H,
                                                  I, w2.stride(0), 0, y.stride(0), HAS_BIAS=False, BLOCK_O=bo,
                                                  BLOCK_K=bk, SUM=summed, TOPK=K if summed else 1, num_warps=nw,
                                                  **extra)
        return launch

    def run(kind, cfg, launch, nbytes, result):
        try:
            s = graph_seconds(launch, L, a.iters)
        except Exception as exc:  # a tile that does not compile (registers, shared memory) is reported, not fatal
            rows.append({"tokens": T, "kernel": kind, "config": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
            return None
        out = result().float()
        rows.append({"tokens": T, "kernel": kind, "config": cfg, "us": s * 1e6, "gbps": nbytes / s / 1e9,
                     "pct_of_copy": 100 * nbytes / s / copy_bps, "out": out})
        return out

    gu_bytes, dn_bytes = P * 2 * I * H * 2, P * H * I * 2
    gate_cfgs, down_cfgs = (GATE_UP[:QUICK], DOWN[:QUICK]) if a.quick else (GATE_UP, DOWN)
    for cfg in gate_cfgs:
        run("gate_up", cfg, gate_up(*cfg), gu_bytes, lambda: acts[0].clone())
    gate_up(*GATE_UP[0])(0)  # the current tiles' activations feed every down config
    for layer in range(1, L):
        gate_up(*GATE_UP[0])(layer)
    for cfg in down_cfgs:
        run("down", cfg, down(*cfg), dn_bytes, lambda: outs[0].clone())
    run("down + route sum", DOWN[0], down(*DOWN[0], summed=True), dn_bytes, lambda: outs[0].clone())
    for kind in ("gate_up", "down"):  # distance of every config's output from the current tiles'
        mine = [r for r in rows if r["kernel"] == kind and "out" in r]
        if mine:
            ref = mine[0]["out"]
            for r in mine:
                r["bitwise_current"] = bool(torch.equal(r["out"], ref))
                r["max_abs_diff"] = float((r["out"] - ref).abs().max())
    for r in rows:
        r.pop("out", None)
    return rows


def quant_bank(fmt: str, S: int, dev: torch.device):
    """``(layout, bank)``: ``S`` slot rows of ``fmt`` at the sweep's geometry on ``dev``, random codes (FP8 from
    normal draws, FP4 every byte) and ordinary scales (FP8 ~1e-3, MXFP4 2^-8 .. 2^-1, NVFP4 ~0.5 times 1e-3)."""
    from edgemoe.quant.layout import ExpertLayout
    from edgemoe.quant.weights import WeightFormat

    lay = ExpertLayout.build(WeightFormat(fmt), H, I, block_size=(128, 128))
    g = torch.Generator(device=dev).manual_seed(2)
    bank = torch.randint(0, 256, (S, lay.row_bytes), dtype=torch.uint8, device=dev, generator=g)
    for role in ("w13", "w2"):
        w, sc = lay.view(bank, role), lay.view(bank, f"{role}_scale")
        if fmt == "fp8_block":
            w.copy_(torch.randn(w.shape, device=dev, generator=g).to(w.dtype))
            sc.copy_(torch.rand(sc.shape, device=dev, generator=g) * 2e-3)
        elif fmt == "mxfp4":
            sc.copy_(torch.randint(119, 127, sc.shape, dtype=torch.uint8, device=dev, generator=g))
        else:
            sc.copy_((torch.rand(sc.shape, device=dev, generator=g) + 0.25).to(sc.dtype))
            lay.view(bank, f"{role}_scale2").fill_(1e-3)
    return lay, bank


def quant_sweep(T: int, fmt: str, a: argparse.Namespace, copy_bps: float) -> list[dict]:
    """The packed-format GEMVs of ``fmt`` at ``T`` tokens, both launches timed together (one
    ``expert_gemv_quant`` call per layer): the current tiles, then each gate/up tile with the current down tile
    (rows ``gate_up``), each down tile with the current gate/up tile (rows ``down``), and the fastest of each
    together (row ``best pair``). GB/s count both launches' packed bytes."""
    from edgemoe.experts.compute import quant_slots
    from edgemoe.kernels.expert_gemv import FORMAT_CODES, QUANT_TILES, expert_gemv_quant

    dev, L, P = torch.device("cuda"), a.layers, T * K
    lay, bank = quant_bank(fmt, L * E, dev)
    slots = quant_slots(lay, bank)
    routes, x, wts, acts, outs = step_inputs(T, L, dev)
    nbytes = P * sum(s.nbytes for s in lay.sections)  # every section is read (FP4 / FP8 codes and scales)
    cur_gu, cur_dn = QUANT_TILES[FORMAT_CODES[fmt]]
    rows = []

    def run(kind, gu, dn):
        def launch(layer):
            expert_gemv_quant(x, routes[layer], wts, slots, outs[layer], acts[layer], tiles=(gu, dn))
        row = {"tokens": T, "format": fmt, "kernel": kind, "tiles": [gu, dn],
               "config": gu if kind == "gate_up" else dn if kind == "down" else (*gu, "/", *dn)}
        try:
            sec = graph_seconds(launch, L, a.iters)
        except Exception as exc:  # a tile that does not compile (registers, shared memory) is reported, not fatal
            rows.append(row | {"error": f"{type(exc).__name__}: {exc}"[:200]})
            return
        rows.append(row | {"us": sec * 1e6, "gbps": nbytes / sec / 1e9, "pct_of_copy": 100 * nbytes / sec / copy_bps,
                           "out": outs[0].float().clone()})

    gu_cfgs = [cur_gu] + [c for c in QUANT_GATE_UP if c != cur_gu]
    dn_cfgs = [cur_dn] + [c for c in QUANT_DOWN if c != cur_dn]
    if a.quick:
        gu_cfgs, dn_cfgs = gu_cfgs[:QUICK], dn_cfgs[:QUICK]
    for cfg in gu_cfgs:
        run("gate_up", cfg, cur_dn)
    for cfg in dn_cfgs:
        run("down", cur_gu, cfg)
    timed = [r for r in rows if "us" in r]
    best_gu = min((r for r in timed if r["kernel"] == "gate_up"), key=lambda r: r["us"], default=None)
    best_dn = min((r for r in timed if r["kernel"] == "down"), key=lambda r: r["us"], default=None)
    if best_gu and best_dn:
        run("best pair", best_gu["config"], best_dn["config"])
    ref = timed[0]["out"] if timed else None
    for r in rows:  # distance of every config's output from the current tiles' (summation order only)
        if "out" in r:
            r["bitwise_current"] = bool(torch.equal(r["out"], ref))
            r["max_abs_diff"] = float((r.pop("out") - ref).abs().max())
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1", help="comma-separated batch sizes (default 1)")
    ap.add_argument("--layers", type=int, default=8, help="launches per graph, each over its own 128 experts")
    ap.add_argument("--iters", type=int, default=50, help="graph replays timed")
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK} configs of each kernel only")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for expert_gemv_sweep.json")
    ap.add_argument("--quant", default="bf16",
                    help="comma-separated formats: bf16 (the float kernels), fp8_block (or fp8), mxfp4, nvfp4")
    a = ap.parse_args(argv)
    fmts = [{"fp8": "fp8_block"}.get(f, f) for f in a.quant.split(",")]
    if bad := [f for f in fmts if f not in ("bf16", "fp8_block", "mxfp4", "nvfp4")]:
        ap.error(f"--quant: unknown format(s) {bad}")
    if not torch.cuda.is_available():
        print("expert_gemv_sweep needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    copy_bps = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(dev)}: device copy {copy_bps / 1e9:.0f} GB/s; {a.layers} layers x {E} experts, "
          f"H={H} I={I} top-{K}, formats {fmts}")
    rows = []
    tokens = [int(t) for t in a.tokens.split(",")]
    if "bf16" in fmts:
        g = torch.Generator(device=dev).manual_seed(1)
        S = a.layers * E
        w13 = (torch.randn(S, 2 * I, H, device=dev, generator=g) * 0.02).to(torch.bfloat16)  # [S, 2I, H]
        w2 = (torch.randn(S, H, I, device=dev, generator=g) * 0.02).to(torch.bfloat16)  # [S, H, I]
        rows += [r | {"format": "bf16"} for T in tokens for r in sweep(T, a, w13, w2, copy_bps)]
        del w13, w2
    for fmt in (f for f in fmts if f != "bf16"):
        rows += [r for T in tokens for r in quant_sweep(T, fmt, a, copy_bps)]
    print(f"{'format':<9} {'T':>3} {'kernel':<17} {'tiles':<24} {'us':>7} {'GB/s':>7} {'%copy':>6} {'bits':>5} "
          f"{'max diff':>9}   (quantized rows: both launches, the other one at its current tiles)")
    for r in rows:
        cfg = ",".join("-" if c is None else str(c) for c in r["config"])
        head = f"{r['format']:<9} {r['tokens']:>3} {r['kernel']:<17} {cfg:<24}"
        if "error" in r:
            print(f"{head} {r['error']}")
            continue
        bits = {True: "same", False: "diff", None: ""}[r.get("bitwise_current")]
        diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else ""
        print(f"{head} {r['us']:7.2f} {r['gbps']:7.0f} {r['pct_of_copy']:5.0f}% {bits:>5} {diff:>9}")
    for fmt in fmts:
        for kind in ("gate_up", "down"):
            for T in tokens:
                ok = [r for r in rows if (r["format"], r["kernel"], r["tokens"]) == (fmt, kind, T) and "us" in r]
                if ok:
                    best = min(ok, key=lambda r: r["us"])
                    print(f"best {fmt} {kind} at T={T}: {best['config']} {best['us']:.2f} us "
                          f"({best['gbps']:.0f} GB/s), current {ok[0]['us']:.2f} us")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        path = Path(a.out) / "expert_gemv_sweep.json"
        path.write_text(json.dumps({"date": datetime.now(UTC).isoformat(), "device": torch.cuda.get_device_name(dev),
                                    "copy_gbps": copy_bps / 1e9, "rows": rows}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
