"""Where edgemoe's CPU-only decode time goes: embeddings, norms, attention, experts, LM head.

Loads a checkpoint on the CPU (``cpu-all``, 0 cache slots: every expert on the CPU executor), prefills a
random prompt and decodes random tokens (the comparison's protocol), timing each part of every step
with wall-clock module hooks (all CPU work is synchronous): ``norms`` (input, post-attention and final
RMSNorm), ``attention`` (q/k/v/o projections, q/k norm, RoPE, KV write, SDPA), ``experts`` (the MoE block:
its router, routing control and the CPU executor, one native call where it takes the step; the router is not
hooked on its own, as a hook on it sends the step back to the separate calls), ``LM head`` (the final
projection onto the vocabulary and its float32 cast), ``residual`` (the rest of the decoder layers) and
``runner`` (the step outside the model: inputs, KV bookkeeping, argmax). Each part's weight bytes per
token and effective GB/s are printed beside its time; a torch.profiler table of the heaviest ops follows.

    python benchmarks/peers/profile_cpu.py --model .peers/ckpt4/hf --threads 2 --tokens 32

Without ``--model``: Qwen3-30B-A3B's geometry ``--layers`` deep with dummy weights (no checkpoint to write:
the same bytes per token as the comparison's checkpoint of that depth).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput


class PartTimer:
    """Accumulates wall time per label from forward pre/post hooks (``start``/``stop`` pairs)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self._open: dict[int, float] = {}
        self.marks: dict[str, float] = {}

    def attach(self, module: torch.nn.Module, label: str, mark: str | None = None) -> None:
        def pre(mod, args):
            self._open[id(mod)] = time.perf_counter()

        def post(mod, args, out):
            t = time.perf_counter()
            self.total[label] += t - self._open.pop(id(mod))
            if mark is not None:
                self.marks[mark] = t

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: a config-only Qwen3-30B-A3B, dummy weights)")
    ap.add_argument("--layers", type=int, default=16, help="without --model: num_hidden_layers")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--torch-profile", type=int, default=8, help="steps under torch.profiler after the timed ones")
    ap.add_argument("--out", help="JSON file for the breakdown")
    a = ap.parse_args(argv)

    model_dir, load_format = a.model, "auto"
    if model_dir is None:
        from edgemoe.synth import write_config_only

        model_dir = str(write_config_only(tempfile.mkdtemp(prefix="edgemoe-profile-"), "qwen3_moe", "qwen3-30b-a3b",
                                          overrides={"num_hidden_layers": a.layers}))
        load_format = "dummy"
    cfg = EngineConfig(device="cpu", load_format=load_format, expert_cache_slots=0, expert_policy="cpu-all",
                       cpu_threads=a.threads, bandwidth_pcie_gbps=1.0, bandwidth_cpu_gbps=1.0,
                       max_model_len=max(4096, a.prompt_len + a.warmup + a.tokens + a.torch_profile + 16))
    runner = ModelRunner(model_dir, cfg)
    mc = runner.model_config
    model = runner.model
    timer = PartTimer()
    backbone = model.model
    timer.attach(backbone.embed_tokens, "embed")
    for layer in backbone.layers:
        timer.attach(layer, "layer")
        timer.attach(layer.input_layernorm, "norms")
        timer.attach(layer.post_attention_layernorm, "norms")
        timer.attach(layer.self_attn, "attention")
        timer.attach(layer.mlp, "moe block")
    timer.attach(backbone.norm, "final norm", mark="final_norm_end")
    timer.attach(model, "model", mark="model_end")

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, mc.vocab_size, (a.prompt_len,), generator=g).tolist()
    feed = torch.randint(0, mc.vocab_size, (a.warmup + a.tokens + a.torch_profile,), generator=g).tolist()
    runner.set_expert_cache(0, "cpu-all")
    runner.execute([StepInput(0, prompt, 0)], Phase.PREFILL)
    pos = len(prompt)
    step_s, lm_s = 0.0, 0.0
    for i in range(a.warmup + a.tokens):
        if i == a.warmup:
            timer.total.clear()
            step_s = lm_s = 0.0
        t0 = time.perf_counter()
        runner.execute([StepInput(0, [feed[i]], pos)], Phase.DECODE)[0].argmax()
        t1 = time.perf_counter()
        step_s += t1 - t0
        lm_s += timer.marks["model_end"] - timer.marks["final_norm_end"]
        pos += 1
    n = a.tokens
    tot = timer.total
    parts = {
        "embed": tot["embed"],
        "norms": tot["norms"] + tot["final norm"],
        "attention": tot["attention"],
        "experts": tot["moe block"],
        "residual": tot["layer"] - tot["attention"] - tot["moe block"] - tot["norms"],
        "LM head": lm_s,
        "runner": step_s - tot["model"],
    }
    h, hd = mc.hidden_size, mc.head_dim
    attn_bytes = (2 * mc.num_heads * hd + 2 * mc.num_kv_heads * hd) * h * 2
    layers = len(backbone.layers)
    weight_bytes = {"attention": layers * attn_bytes,
                    "experts": layers * (mc.top_k * runner.pool.row_bytes + mc.num_experts * h * 2),  # + router
                    "LM head": mc.vocab_size * h * 2, "embed": h * 2}
    rows = []
    print(f"{n} decode steps, {a.threads} threads: {n / step_s:.2f} tokens/s, {1e3 * step_s / n:.1f} ms/token")
    print(f"{'part':<10} {'ms/token':>9} {'share':>6} {'MB/token':>9} {'GB/s':>6}")
    for name, s in parts.items():
        ms = 1e3 * s / n
        mb = weight_bytes.get(name, 0) / 1e6
        gbps = mb / ms if mb and ms > 0 else None
        rows.append({"part": name, "ms_per_token": ms, "share": s / step_s, "weight_mb_per_token": mb,
                     "gb_per_s": gbps})
        print(f"{name:<10} {ms:9.2f} {s / step_s:6.1%} {mb:9.1f} {'' if gbps is None else f'{gbps:6.1f}'}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(a.warmup + a.tokens, a.warmup + a.tokens + a.torch_profile):
            runner.execute([StepInput(0, [feed[i]], pos)], Phase.DECODE)
            pos += 1
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20,
                                                              max_name_column_width=40, max_shapes_column_width=60)
    print(table)
    if a.out:
        Path(a.out).write_text(json.dumps({"threads": a.threads, "tokens": n, "tokens_per_s": n / step_s,
                                           "ms_per_token": 1e3 * step_s / n, "parts": rows,
                                           "executor": runner.experts.cpu_executor.name, "torch_ops": table}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
