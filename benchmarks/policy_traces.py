"""Record the routing traces of the expert-policy study (``docs/benchmarks/policy.md``), with the
next-layer prediction of every MoE layer's experts, and print the prediction's accuracy.

Each trace line carries the experts the engine routed and, in ``predicted``, the experts that layer's
router picks from the previous MoE layer's hidden state (the next-layer prefetch): the router of MoE
layer j+1 and its post-attention RMSNorm applied to the residual stream of layer j, taken after layer
j's attention (``--prediction attn``: a prefetch then overlaps layer j's experts and layer j+1's
attention) or after layer j's experts (``--prediction moe``: overlaps only layer j+1's attention). The
first MoE layer has no prediction. Predictions are top-2k, most likely first.

Workloads (``--workload``):

- ``tiny`` / ``small``: the random-weight test presets, eight prompts, 96 tokens each sampled at
  temperature 1, one request at a time (the protocol of ``docs/benchmarks/routing.md``).
- ``qwen-degenerate``: Qwen3-30B-A3B routing geometry (48 MoE layers x 128 experts, top-8) with a
  narrow hidden size, dummy weights (std 0.02): the attention output, an average over the context,
  dominates the residual, so every token picks nearly the same experts (the random model's own
  routing of the decode benchmark).
- ``qwen-random``: the same with ``o_proj`` drawn at std 2e-4, so each layer routes by the current token,
  fed random tokens: no locality.
- ``qwen-text``: the token-routed model fed real text (Python source from the standard library,
  tokenized with the Qwen3 tokenizer): the temporal structure of real tokens.

    python benchmarks/policy_traces.py --workload small --out traces/small.jsonl
    python benchmarks/policy_traces.py --workload qwen-text --tokens 384 --out traces/qwen-text.jsonl
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.bench.trace import RoutingRecorder
from edgemoe.config import EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a hash map handles collisions, with an example in Python.",
           "List the planets of the solar system and one fact about each.",
           "Translate to French: The weather is lovely today, let us walk to the harbour.",
           "What is 17 times 23? Show your work step by step.",
           "Summarize the causes of the French Revolution in three sentences.",
           "Draft an email asking a colleague to review a pull request by Friday.",
           "Describe the water cycle to a ten-year-old."]
QWEN_ROUTING = {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 1024,
                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "moe_intermediate_size": 32,
                "intermediate_size": 256}
TOKEN_ROUTING_O_PROJ_STD = 2e-4
QWEN3_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers" / "qwen3"


class NextLayerPredictor:
    """Wraps a model's decoder layers so that each MoE layer's routing is recorded with the prediction
    made from the previous MoE layer's hidden state (see the module docstring); keeps the accuracy.

    ``recall[j]``: for MoE layer j, the routed experts found in the top-k prediction, summed over
    tokens; ``recall2[j]``: found in the top-2k; ``routes[j]``: routed experts (tokens · k).
    """

    def __init__(self, runner: ModelRunner, recorder: RoutingRecorder, source: str):
        self.runner, self.recorder, self.source = runner, recorder, source
        layers = list(runner.model.decoder.layers)
        moe = [layer for layer in layers if layer.is_moe]
        L = len(moe)
        self.k = runner.model_config.top_k
        self.recall, self.recall2, self.routes = [0] * L, [0] * L, [0] * L
        self.pending: dict[int, torch.Tensor] = {}  # MoE ordinal -> [T, 2k] prediction for that layer
        for j, layer in enumerate(moe):
            layer.forward = self._forward(layer, moe[j + 1] if j + 1 < L else None, j)
            layer.mlp.gate.forward = self._gate(layer.mlp.gate, j)

    def _predict(self, nxt, x: torch.Tensor) -> torch.Tensor:
        h = nxt.post_attention_layernorm(x)
        logits = torch.nn.functional.linear(h.to(nxt.mlp.gate.weight.dtype), nxt.mlp.gate.weight)  # [T, E]
        return logits.topk(min(2 * self.k, logits.shape[-1]), dim=-1).indices  # [T, 2k]

    def _forward(self, layer, nxt, j: int):
        def forward(x, batch):
            x = x + layer.self_attn(layer.input_layernorm(x), batch)
            if nxt is not None and self.source == "attn":
                self.pending[j + 1] = self._predict(nxt, x)
            out = x + layer.mlp(layer.post_attention_layernorm(x), batch)
            if nxt is not None and self.source == "moe":
                self.pending[j + 1] = self._predict(nxt, out)
            return out

        return forward

    def _gate(self, gate, j: int):
        orig = gate.forward

        def forward(x):
            ids, w = orig(x)
            pred = self.pending.pop(j, None)
            self.recorder.predicted = pred
            if pred is not None:
                hit = (pred[:, :, None] == ids[:, None, :])  # [T, 2k, k]
                self.recall[j] += int(hit[:, : self.k].any(dim=1).sum())
                self.recall2[j] += int(hit.any(dim=1).sum())
                self.routes[j] += ids.numel()
            return ids, w

        return forward

    def report(self) -> str:
        n = sum(self.routes)
        if not n:
            return "prediction: no predicted layers"
        per = [f"{100 * r / t:.0f}" for r, t in zip(self.recall, self.routes) if t]
        return (f"next-layer prediction from the residual after the previous layer's {self.source}: "
                f"top-k recall {100 * sum(self.recall) / n:.1f} %, top-2k recall {100 * sum(self.recall2) / n:.1f} % "
                f"over {n} routed experts; per MoE layer (top-k, %): {' '.join(per)}")


class PredictingRecorder(RoutingRecorder):
    """A :class:`RoutingRecorder` that writes the prediction the :class:`NextLayerPredictor` left."""

    predicted: torch.Tensor | None = None

    def __call__(self, batch, moe_layer, topk_ids, topk_weights, predicted=None):
        super().__call__(batch, moe_layer, topk_ids, topk_weights, self.predicted)


def python_source_tokens(tokenizer, n: int, seed: int) -> list[int]:
    """``n`` tokens of standard-library Python source (files in a seeded order)."""
    import sysconfig

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    random.Random(seed).shuffle(files)
    out: list[int] = []
    for f in files:
        out += tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(out) >= n:
            return out[:n]
    return out


def record_preset(preset: str, out: Path, source: str, tokens: int) -> str:
    from edgemoe.engine.llm import LLM
    from edgemoe.engine.sampling import SamplingParams
    from edgemoe.synth import make_model

    model = make_model(Path(tempfile.mkdtemp(prefix="edgemoe-study-")) / preset, "qwen3_moe", preset, seed=0,
                       dtype="float32")
    llm = LLM(str(model), device="cpu", dtype="float32", expert_policy="fill-all", expert_cache_slots=0,
              max_num_seqs=1, progress=False)
    rec = PredictingRecorder(out).attach(llm.runner)
    pred = NextLayerPredictor(llm.runner, rec, source)
    llm.generate(PROMPTS, [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True)
                           for i in range(len(PROMPTS))])
    rec.close()
    return pred.report()


def record_qwen(workload: str, out: Path, source: str, tokens: int, requests: int, seed: int) -> str:
    from transformers import AutoTokenizer

    from edgemoe.synth import write_config_only

    d = write_config_only(Path(tempfile.mkdtemp(prefix="edgemoe-study-")), "qwen3_moe", "qwen3-30b-a3b",
                          tokenizer=QWEN3_TOKENIZER if QWEN3_TOKENIZER.is_dir() else None, overrides=QWEN_ROUTING)
    runner = ModelRunner(d, EngineConfig(device="cpu", dtype="float32", load_format="dummy", expert_cache_slots=0,
                                         expert_policy="cpu-all", max_model_len=4096), progress=False)
    if workload != "qwen-degenerate":  # each layer routes by the current token
        for layer in runner.model.decoder.layers:
            layer.self_attn.o_proj.weight.mul_(TOKEN_ROUTING_O_PROJ_STD / 0.02)
    rec = PredictingRecorder(out).attach(runner)
    rec.write_header(note=f"{workload}: benchmarks/policy_traces.py", prediction=source)
    pred = NextLayerPredictor(runner, rec, source)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    text = None
    if workload == "qwen-text":
        tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER)
        text = python_source_tokens(tok, requests * (tokens + 32), seed)
    for r in range(requests):
        feed = (text[r * (tokens + 32):(r + 1) * (tokens + 32)] if text is not None
                else torch.randint(0, vocab, (tokens + 32,), generator=g).tolist())
        prompt, rest = feed[:32], feed[32:]
        rec.name_sequence(r, f"{workload}-{r}")
        runner.execute([StepInput(r, prompt, 0)], Phase.PREFILL)
        for i, t in enumerate(rest):  # teacher forcing: the next input is the workload's token
            runner.execute([StepInput(r, [t], 32 + i)], Phase.DECODE)
        runner.free(r)
    rec.close()
    return pred.report()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, choices=["tiny", "small", "qwen-degenerate", "qwen-random",
                                                          "qwen-text"])
    ap.add_argument("--out", required=True, help="trace to write (JSONL, appended)")
    ap.add_argument("--prediction", default="attn", choices=["attn", "moe"],
                    help="hidden state the next layer's router is applied to (see the module docstring)")
    ap.add_argument("--tokens", type=int, default=None, help="decode tokens per request (default 96 / 256)")
    ap.add_argument("--requests", type=int, default=2, help="qwen-* workloads: requests (one after another)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        if a.workload in ("tiny", "small"):
            print(record_preset(a.workload, out, a.prediction, a.tokens or 96))
        else:
            print(record_qwen(a.workload, out, a.prediction, a.tokens or 256, a.requests, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
