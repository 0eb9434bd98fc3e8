"""CPU decode attention: the native kernel (``DenseKernels.decode_attention``) against torch's SDPA path, by context.

One decode step of one sequence through one attention layer (a step's per-layer cost: what a step computes once
for all its layers is cached after the first repeat) after its projections (q/k RMSNorm, RoPE, the
K/V write into the paged cache, attention over the cached tokens), Qwen3-30B-A3B's attention by default
(32 query heads, 4 KV heads of 128), bf16, the KV cache in pages of 16 tokens handed out in a random order
(a server's pages after other requests came and went). For each context length and thread count:

- **native**: ``DenseKernels(executor).decode_attention`` on a native executor of that many threads;
- **torch**: the same step as the engine's torch path runs it (``RMSNorm``, ``RotaryEmbedding``,
  ``write_and_attend``: the K/V write, the page gather and SDPA) with torch on that many threads;
- **KV GB/s**: the cached K and V bytes over the step's time; the bytes bound is ``--read-gbps`` (the
  machine's DRAM read bandwidth at that thread count, e.g. from ``benchmarks/cpu_executor.py``), if given.

Best of ``--repeats`` steps after a warm-up one. Running it from another tree (``--tree``, a copy of an earlier
commit's ``edgemoe/``) times that tree's kernel with this harness.

    python benchmarks/cpu_attention.py --threads 1,2 --contexts 300,2000,8000,16000,32000
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    ap.add_argument("--contexts", default="300,2000,8000,16000,32000", help="cached tokens per step")
    ap.add_argument("--heads", default="32,4,128", help="query heads, KV heads, head size (default Qwen3-30B-A3B's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--paths", default="native,torch")
    ap.add_argument("--read-gbps", default=None, help="DRAM read GB/s per thread count, e.g. 1:14.5,2:28")
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="source tree to import")
    ap.add_argument("--out", default=None, help="JSON output file")
    a = ap.parse_args(argv)

    sys.path.insert(0, a.tree)
    import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

    # isort: split
    import torch

    from edgemoe.core import SeqSlice
    from edgemoe.experts import native
    from edgemoe.experts.pool import HostExpertPool
    from edgemoe.kvcache.pool import KVSpec, PagedKVPool
    from edgemoe.layers.attention import write_and_attend
    from edgemoe.layers.norm import RMSNorm
    from edgemoe.layers.rotary import RotaryEmbedding
    from edgemoe.quant.layout import ExpertLayout
    from edgemoe.quant.weights import WeightFormat

    hq, hk, d = (int(v) for v in a.heads.split(","))
    ps, eps = 16, 1e-6
    read = dict((int(k), float(v)) for k, v in (kv.split(":") for kv in a.read_gbps.split(","))) if a.read_gbps else {}
    g = torch.Generator().manual_seed(0)
    q_norm, k_norm = RMSNorm(d, eps), RMSNorm(d, eps)
    q_norm.weight.data = (torch.randn(d, generator=g) * 0.1 + 1).bfloat16()
    k_norm.weight.data = (torch.randn(d, generator=g) * 0.1 + 1).bfloat16()
    rot = RotaryEmbedding(SimpleNamespace(head_dim=d, partial_rotary_factor=1.0,
                                          rope_parameters={"rope_theta": 1_000_000.0}))
    def make_steps(dense, n: int) -> dict:
        """The two paths' step over a fresh cache of ``n`` tokens in shuffled pages."""
        pages = -(-n // ps)
        kv = PagedKVPool(KVSpec.heads(1, hk, d), pages, ps, torch.bfloat16, torch.device("cpu"))
        kv.k.copy_(torch.randn(kv.k.shape, generator=g).bfloat16())
        kv.v.copy_(torch.randn(kv.v.shape, generator=g).bfloat16())
        table = torch.randperm(pages, generator=g).to(torch.int64)
        pos = torch.tensor([n - 1])
        slots = (table[pos // ps] * ps + pos % ps).reshape(1)
        seqs = [SeqSlice(seq_id=0, q_start=0, q_len=1, kv_len=n, page_table=table)]
        qkv = torch.randn(1, (hq + 2 * hk) * d, generator=g).bfloat16()
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)

        # one step's batch for every repeat: what a step computes once for all its layers (page tables, RoPE
        # tables) is in its step cache after the first call, as in the engine
        b_native = SimpleNamespace(seqs=seqs, kv_slots=slots, positions=pos, decode=None, step_cache={})
        b_torch = SimpleNamespace(seqs=seqs, kv_slots=slots, positions=pos, decode=None, step_cache={})

        def native_step():
            b = b_native
            cos, sin = rot.step_tables(pos, torch.bfloat16, b.step_cache)
            return dense.decode_attention(q, k, v, q_norm=q_norm.weight, k_norm=k_norm.weight, eps=eps,
                                          float32_scale=False, cos=cos, sin=sin, k_cache=kv.k[0], v_cache=kv.v[0],
                                          batch=b, page_size=ps, scale=d ** -0.5)

        def torch_step():
            b = b_torch
            qr, kr = rot(q_norm(q.reshape(1, hq, d)), k_norm(k.reshape(1, hk, d)), pos, b.step_cache)
            return write_and_attend(qr, kr, v.reshape(1, hk, d), kv, 0, b, d ** -0.5)

        return {"native": native_step, "torch": torch_step}

    rows = []
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        pool = HostExpertPool(1, ExpertLayout.build(WeightFormat.BF16, 16, 16), torch.bfloat16)
        ex = native.NativeCpuExecutor(pool, threads, min_parallel_bytes=0, oversubscribe=True)
        dense = native.DenseKernels(ex)
        if hasattr(dense, "max_kv_bytes"):  # an earlier tree capped the native kernel's context
            dense.max_kv_bytes = 1 << 62
        for n in (int(c) for c in a.contexts.split(",")):
            steps = make_steps(dense, n)
            kv_bytes = 2 * n * hk * d * 2
            row = {"threads": threads, "context": n, "kv_mb": kv_bytes / 1e6}
            outs = {}
            for name, step in steps.items():
                if name not in a.paths.split(","):
                    continue
                outs[name] = step().float()
                ts = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    step()
                    ts.append(time.perf_counter() - t0)
                row[f"{name}_us"] = 1e6 * min(ts)
                row[f"{name}_kv_gbps"] = kv_bytes / min(ts) / 1e9
            if len(outs) == 2:
                row["max_abs_diff"] = float((outs["native"] - outs["torch"].reshape(outs["native"].shape)).abs().max())
            if threads in read:
                row["bound_us"] = 1e6 * kv_bytes / (read[threads] * 1e9)
            rows.append(row)
            cells = [f"{row.get(f'{p}_us', float('nan')):9.1f} us ({row.get(f'{p}_kv_gbps', float('nan')):5.1f} GB/s)"
                     for p in ("native", "torch")]
            print(f"threads {threads:2d}  context {n:6d}  KV {row['kv_mb']:6.1f} MB  native {cells[0]}  "
                  f"torch {cells[1]}" + (f"  bound {row['bound_us']:.0f} us" if "bound_us" in row else ""), flush=True)
        del dense, ex
    result = {"meta": {"date": datetime.now(UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                       "platform": platform.platform(), "tree": a.tree, "heads": [hq, hk, d], "page_size": ps},
              "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
