"""How long a small CPU operation takes right after a large weight stream, against the same operation alone.

A CPU-only decode step alternates large native GEMVs (the attention projections, the experts, the LM head: tens to
hundreds of MB streamed) with small operations (norms, the router, residual adds: a few Python and torch calls
each). This times an RMSNorm and a router of Qwen3-30B-A3B's geometry (dummy weights, 2 layers) alone, right after
the LM head's GEMV (622 MB of bf16 weights), and once more after that (medians, microseconds):

    python benchmarks/after_stream.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.config import EngineConfig
from edgemoe.engine.model_runner import ModelRunner
from edgemoe.synth import write_config_only


def _us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="CPU executor threads")
    ap.add_argument("--repeats", type=int, default=50)
    a = ap.parse_args(argv)
    model_dir = write_config_only(tempfile.mkdtemp(prefix="edgemoe-after-stream-"), "qwen3_moe", "qwen3-30b-a3b",
                                  overrides={"num_hidden_layers": 2})
    runner = ModelRunner(str(model_dir), EngineConfig(device="cpu", load_format="dummy", expert_cache_slots=0,
                                                      expert_policy="cpu-all", cpu_threads=a.threads,
                                                      bandwidth_pcie_gbps=1.0, bandwidth_cpu_gbps=1.0))
    model = runner.model
    layer, head = model.model.layers[1], model.lm_head
    x = torch.randn(1, runner.model_config.hidden_size).to(torch.bfloat16)
    ops = {"RMSNorm": lambda: layer.input_layernorm(x), "router": lambda: layer.mlp.gate(x)}
    with torch.inference_mode():
        for _ in range(20):
            head(x)
            for op in ops.values():
                op()
        print(f"{a.threads} threads; LM head GEMV {_median([_us(lambda: head(x)) for _ in range(a.repeats)]):.0f} us")
        for name, op in ops.items():
            alone = _median([_us(op) for _ in range(4 * a.repeats)])
            first, second = [], []
            for _ in range(a.repeats):
                head(x)
                first.append(_us(op))
                second.append(_us(op))
            print(f"{name:8s} alone {alone:7.1f} us   right after the GEMV {_median(first):7.1f} us   "
                  f"once more {_median(second):7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
