"""Decode benchmark: tokens/s, hit rate and q*/m per expert-cache budget, policy and batch size.

Loads the model once (``--load-format dummy`` by default: full geometry from config.json, random
weights, no disk), measures B_P/B_H on this machine, then for each budget (GB of expert cache),
policy and batch size (``--batch-sizes``: sequences decoded together) rebuilds the expert cache in
place, prefills the prompt of each sequence and times decode steps. The all-resident run (every
expert cached) is the ceiling of each batch size. tokens/s counts every sequence's tokens; ms/token
is per step. Writes a markdown table and a JSON file.

    python benchmarks/decode.py --preset qwen3-30b-a3b --budgets 8,16,32 --out results/
    python benchmarks/decode.py --arch deepseek_v3 --preset deepseek-v3 --layers 8 --budgets 8,16,32 --out results/
    python benchmarks/decode.py --preset qwen3-30b-a3b --budgets 8 --policies qstar --batch-sizes 1,4,16,64
    python benchmarks/decode.py --quant mxfp4 --budgets 2,4,8 --policies qstar,fill-all --cpu-threads 6,15 --out r/mxfp4
    python benchmarks/decode.py --compare r/bf16 r/fp8 r/mxfp4 r/nvfp4 --out r   # formats.md: ratios to the first

``--quant`` gives the dummy experts a released quantized format (packed rows in the host pool and the cache,
fills of packed bytes, the quantized Triton kernels on the GPU); budgets are GB of expert cache, so an equal
budget holds 2x (FP8) or ~3.6x (4-bit) the experts of bf16. ``--cpu-threads`` takes a list: each count
rebuilds the CPU executor and measures B_P/B_H anew. Policies with a CPU branch are skipped for a quantized
pool on the torch CPU executor (no native kernel for its rows: seconds per token), unless
``--torch-cpu-branch``. ``--compare`` reads the ``decode.json`` of earlier runs and writes ``formats.md``:
tokens/s per format and its ratio to the first run's at the same budget, policy, threads and batch.

The bound each run is compared with (bound/measured; the target is >= 0.7) is the all-resident time per
step of its batch size plus the slower of the two miss branches: fills over B_P and CPU experts over B_H, each at the
rate measured alone when the policy uses one branch, and at the concurrent pair's rates when it uses both.

Random weights route near-uniformly, so the hit rate approaches the cache's share of experts: real
checkpoints have more routing locality (see the routing-trace replay) and hit more.

Routing (``--routing``): ``uniform`` (k distinct experts drawn per token and layer: no locality),
``model`` (the random router's own choice: with ``--decode-input random`` each step routes by a random
token, with ``greedy`` the repeated output token routes the same experts every step: degenerate), or
``trace`` (``--trace FILE,...``: recorded routing, e.g. the Mixtral-8x7B traces, mapped onto this
model's geometry with its temporal structure kept, ``edgemoe.bench.replay.remap_workload``, and
replayed step after step: realistic locality).

For the policy study: ``--repeats`` runs every (budget, policy) in a rotated order, ``--step-log`` records every
decode step (time, hits, misses, fills, CPU experts, the policy's state), ``--step-markers`` adds each step's device
time and the device's idle time before it (whether a slower run lost its time on the GPU or on the host), and
``--reuse-priors 4,8`` runs ``auto`` once per reuse prior in the same process (an A/B free of the offsets between
processes, which on the GPU host reached 7 % for identical decisions). Before the first timed run an untimed ``auto``
run compiles the decode kernels and captures the decode step (seconds on a fresh machine; ``--no-kernel-warmup``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import edgemoe  # noqa: F401  (before torch: torch's OpenMP threads then wait passively, as in the server)

# isort: split
import torch

from edgemoe.bench.route_table import table_rows
from edgemoe.bench.step_markers import StepMarkers, step_times
from edgemoe.config import DOORBELL_WAITS, JOIN_LATENESS, EngineConfig
from edgemoe.core import Phase
from edgemoe.engine.model_runner import ModelRunner, StepInput
from edgemoe.experts.bandwidth import bandwidths_from_profile, measure
from edgemoe.experts.policy import AutoPolicy, Bandwidths
from edgemoe.layers.router import pad_routes
from edgemoe.synth import QUANT_LAYOUTS

PREFILL_CHUNK = 8192


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def policy_state(pol) -> dict:
    """The policy's decision state for a step log: its fill ratio at the table's largest miss count and, for
    ``auto``, whether the table fills every miss (and whether for falling or rising misses), the CPU cost level,
    the late fraction of the hand-offs of the last window it judged, the mean miss count per layer step and the mean
    estimated net reuse of a fill over the layers."""
    st = {"q_ratio": round(pol.q_ratio(), 4)}
    if isinstance(pol, AutoPolicy):
        reuse = pol.reuse
        st |= {"fills_every_miss": pol.fills_every_miss(), "misses_falling": pol.misses_falling,
               "misses_rose": pol.misses_rose, "cpu_level": pol.cpu_level,
               "late_fraction": None if pol.late_fraction is None else round(pol.late_fraction, 3),
               "miss_rate": None if pol.miss_rate is None else round(pol.miss_rate, 3),
               "reuse_mean": round(sum(reuse) / len(reuse), 3), "reuse_min": round(min(reuse), 3)}
    return st


def run_one(runner: ModelRunner, slots: int, policy: str, prompt: list[int], warmup: int, tokens: int,
            feed: list[int] | None, skip_prefill: bool = False, batch: int = 1, step_log: bool = False,
            requests: int = 1, on_request=None, markers: bool = False, reuse_prior: float | None = None) -> dict:
    """Prefill ``prompt`` for each of ``batch`` sequences, then decode them together ``warmup + tokens``
    steps; time the last ``tokens`` steps (each decodes one token of every sequence).

    ``requests``: serve that many such requests back to back on one expert cache and policy (the turns of
    an agent session): request ``r > 0`` prefills again and decodes ``tokens`` steps, all timed, so the
    policy's course after each prefill counts (``on_request(r, batch)`` runs before each request's prefill, e.g.
    to move the routing replay on); ``tokens_per_s`` is over every timed step, ``request_tokens_per_s`` per
    request, ``prefill_s`` the sum of the requests' prefills.

    ``feed``: the tokens given to the decode steps (teacher forcing; sequence ``i`` of step ``s`` takes
    ``feed[(s * batch + i) % len(feed)]``); ``None`` feeds back the greedy token. A random-weight
    model's greedy output repeats one token, which would route every step to the same experts;
    feeding random tokens gives near-uniform routing instead (the pessimistic case).

    ``step_log``: also return ``steps``, one record per decode step (warm-up included): its wall time in ms
    (the step's sampling synchronizes), its decode hits, misses, fills and CPU experts (one counter read after
    each step), and the policy's state after it (:func:`policy_state`).

    ``markers`` (with ``step_log``): the model's forward also stamps the device clock at its start and end
    (:class:`~edgemoe.bench.step_markers.StepMarkers`, captured into the decode graphs), and each step record gains
    ``gpu_ms`` (the forward's device time) and ``gap_ms`` (the device idle before it, from the forward before it;
    ``None`` for a request's first step): whether a slower run lost its time on the device or on the host.

    ``reuse_prior``: for ``auto``, the reuse prior of the new cache's policy (:class:`AutoPolicy` ``reuse_prior``,
    hits a fill) instead of its default, set before any window is read.

    Raises:
        ValueError: ``reuse_prior`` for a policy other than ``auto``.
    """
    mk = StepMarkers(runner.device, capacity=requests * (warmup + tokens) + 1) if markers and step_log else None
    with mk.wrap(runner.model) if mk is not None else nullcontext():
        return _run_one(runner, slots, policy, prompt, warmup, tokens, feed, skip_prefill, batch, step_log,
                        requests, on_request, mk, reuse_prior)


def _run_one(runner, slots, policy, prompt, warmup, tokens, feed, skip_prefill, batch, step_log, requests,
             on_request, mk: StepMarkers | None, reuse_prior: float | None) -> dict:
    """:func:`run_one`'s body; ``mk``: the markers wrapping the model's forward, or ``None``."""
    runner.set_expert_cache(slots, policy)
    if reuse_prior is not None:
        if not isinstance(runner.experts.policy, AutoPolicy):
            raise ValueError(f"a reuse prior is auto's, not {policy}'s")
        runner.experts.policy.reuse_prior = float(reuse_prior)
    dev = runner.device
    toks: list[int] = []
    pos = step = 0
    steps: list[dict] = []
    counts = dict(runner.experts.stats()["decode"]) if step_log else {}  # read once per step after it

    def prefill() -> float:
        nonlocal pos
        _sync(dev)
        t0 = time.perf_counter()
        toks.clear()
        for i in range(batch):
            if skip_prefill:  # long-context decode: the KV pages are allocated, not computed (decode reads them all)
                runner.kv.allocate(i, len(prompt))
                toks.append(prompt[-1])
                continue
            for start in range(0, len(prompt), PREFILL_CHUNK):
                logits = runner.execute([StepInput(i, prompt[start:start + PREFILL_CHUNK], start)], Phase.PREFILL)
            toks.append(int(logits[0].argmax()))
        _sync(dev)
        pos = len(prompt)
        return time.perf_counter() - t0

    def decode_step() -> None:
        nonlocal pos, step, counts
        ids = [toks[i] if feed is None else feed[(step * batch + i) % len(feed)] for i in range(batch)]
        s0 = time.perf_counter()
        logits = runner.execute([StepInput(i, [t], pos) for i, t in enumerate(ids)], Phase.DECODE)
        toks[:] = logits.argmax(dim=-1).tolist()
        if step_log:
            ms = 1e3 * (time.perf_counter() - s0)
            c1 = dict(runner.experts.stats()["decode"])
            steps.append({"step": step, "ms": round(ms, 3), **{k: c1[k] - counts[k] for k in c1},
                          **policy_state(runner.experts.policy)})
            counts = c1
        pos, step = pos + 1, step + 1

    prefill_s, dt, per_request = 0.0, 0.0, []
    d = dict.fromkeys(runner.experts.stats()["decode"], 0)
    for r in range(requests):
        if on_request is not None:
            on_request(r, batch)
        prefill_s += prefill()
        first = len(steps)  # this request's first step record
        if mk is not None:
            mk.reset()  # the prefill's forwards are not steps
        for _ in range(warmup if r == 0 else 0):
            decode_step()
        before = dict(runner.experts.stats()["decode"])
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(tokens):
            decode_step()
        _sync(dev)
        dt_r = time.perf_counter() - t0
        if mk is not None:
            times = step_times(mk.read())
            if times["steps"] != len(steps) - first:
                raise RuntimeError(f"{times['steps']} forwards stamped for {len(steps) - first} decode steps")
            for i, rec in enumerate(steps[first:]):
                rec["gpu_ms"] = round(times["forward_ms"][i], 4)
                rec["gap_ms"] = round(times["gap_ms"][i - 1], 4) if i else None
        after = runner.experts.stats()["decode"]
        d = {k: d[k] + after[k] - before[k] for k in after}
        dt += dt_r
        per_request.append(batch * tokens / dt_r)
        for i in range(batch):
            runner.free(i)
    timed = tokens * requests  # every timed step of every request
    uses = d["hits"] + d["misses"]
    row = runner.pool.row_bytes
    return {
        "policy": policy, "slots": slots, "cache_gb": slots * row / 1e9, "context": len(prompt), "batch": batch,
        "decode_path": runner.experts.decode_path,
        "tokens_per_s": batch * timed / dt, "ms_per_token": 1e3 * dt / timed, "prefill_s": prefill_s,
        "hit_rate": d["hits"] / uses if uses else 0.0,
        "fills_per_token": d["fills"] / timed, "cpu_per_token": d["cpu"] / timed,
        "miss_gb_per_token": d["misses"] * row / 1e9 / timed,
        "q_ratio_policy": runner.experts.policy.q_ratio(),
        "q_over_m_observed": d["fills"] / d["misses"] if d["misses"] else None,
        **({"requests": requests, "request_tokens_per_s": per_request} if requests > 1 else {}),
        **({"steps": steps} if step_log else {}),
    }


def route_uniformly(runner: ModelRunner, seed: int, max_tokens: int = 8192) -> None:
    """Replace each router's choice by k distinct experts drawn uniformly per token and layer (weights:
    the router's own top-k weights; the router's work stays in the step). Random-weight models route almost the
    same experts every step, which would flatter any cache; uniform routing is the no-locality case.

    The draws come from a pre-generated table (the top k of random scores per row) read at a device-side
    counter, so a decode step replayed from a CUDA graph routes differently at every layer and step (a
    generator call cannot be captured); a decode step reads it in one launch (:func:`table_rows`)."""
    dev, E = runner.device, runner.model_config.num_experts
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = 1 << 14
    k = runner.model_config.top_k
    table = torch.rand(rows, E, generator=g, device=dev).topk(k, dim=-1).indices.contiguous()  # [R, k] ids
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    for blk in runner.model.moe_blocks():

        def route(x, valid=None, own=blk.route):
            _, w = own(x)  # the router's own work and weights (any family's routing), its choice replaced
            return pad_routes(table_rows(table, counter, x.shape[0]), w, valid)  # ids [T, k]

        blk.route = route


def trace_offset(request: int, prompt_len: int, warmup: int, tokens: int, batch: int) -> int:
    """The trace row at which request ``request`` of a ``--requests`` run starts its replay: past every row the
    requests before it read (each sequence's prefill restarts at the request's start and reads ``prompt_len``
    rows, then each decode step reads ``batch`` rows; every request is given the first one's ``warmup + tokens``
    steps)."""
    return request * (prompt_len + batch * (warmup + tokens))


def route_from_trace(runner: ModelRunner, paths: list[str], reset_tokens: int, seed: int = 0,
                     start: list[int] | None = None) -> int:
    """Replace each router's choice by recorded routing: the traces' decode steps mapped onto this model's
    (MoE layers, experts, top-k) (:func:`edgemoe.bench.replay.remap_workload`), MoE layer ``j`` reading
    step ``c_j``, ``c_j + 1``, ... of its own table at a device-side counter (a prefill, a step of at
    least ``reset_tokens`` tokens, restarts it at ``start[0]`` (0 without ``start``; the caller may change it
    between requests) and reads rows too, so every run replays the same steps; a CUDA graph replays with the
    counter).
    Weights: the router's own top-k weights (its work stays in the step). Returns the number of recorded
    steps (the tables wrap around).

    Raises:
        ValueError: the traces cannot be mapped onto the model (see ``remap_workload``).
    """
    from edgemoe.bench.replay import load_workload, remap_workload

    cfg, dev = runner.model_config, runner.device
    blocks = list(runner.model.moe_blocks())
    L, E, k = len(blocks), cfg.num_experts, cfg.top_k
    wl = remap_workload(load_workload(paths), L, E, k, seed=seed)
    rows: dict[int, list[list[int]]] = {}
    for a in wl.accesses:
        if a.phase == "decode" and len(a.ids) == k:
            rows.setdefault(a.layer, []).append([f - a.layer * E for f in a.ids])
    n = min(len(r) for r in rows.values()) if len(rows) == L else 0
    if n == 0:
        raise ValueError(f"{paths}: no decode steps with {k} experts in every one of {L} MoE layers after remapping")
    table = torch.tensor([rows[j][:n] for j in range(L)], dtype=torch.int64, device=dev)  # [L, R, k]
    counters = torch.zeros(L, dtype=torch.int64, device=dev)
    for j, blk in enumerate(blocks):

        def route(x, valid=None, own=blk.route, j=j):
            T = x.shape[0]
            if T >= reset_tokens:  # a prefill: every run replays the trace from the request's start
                counters[j:j + 1].fill_(start[0] % n if start else 0)
            _, w = own(x)  # the router's own work and weights (any family's routing), its choice replaced
            return pad_routes(table_rows(table[j], counters[j:j + 1], T), w, valid)  # ids [T, k]

        blk.route = route
    return n


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model options the benchmarks share: a directory, or a preset's config with dummy weights."""
    ap.add_argument("--model", help="checkpoint or config-only directory (default: write --preset's config)")
    ap.add_argument("--arch", default="qwen3_moe", help="architecture of --preset (a make-model --arch)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, help="num_hidden_layers of --preset's config (the full geometry, fewer "
                    "layers, where host RAM cannot hold every layer's experts)")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant", choices=list(QUANT_LAYOUTS),
                    help="routed experts in this released quantized layout (dummy rows of its format)")


def model_dir(a: argparse.Namespace) -> str:
    """``--model``, or a temporary config-only directory of ``--arch``'s ``--preset`` (``--layers`` deep, experts
    in ``--quant``'s format)."""
    if a.model is not None:
        return a.model
    from edgemoe.synth import write_config_only

    overrides = None if a.layers is None else {"num_hidden_layers": a.layers}
    return str(write_config_only(tempfile.mkdtemp(prefix="edgemoe-bench-"), a.arch, a.preset, overrides=overrides,
                                 quant=a.quant))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--budgets", default="8,16,32", help="expert-cache budgets in GB")
    ap.add_argument("--policies", default="qstar,auto,adaptive,fill-all,cpu-all,static")
    ap.add_argument("--eviction", default="layer-lru", choices=["layer-lru", "global-lru"],
                    help="the expert cache's eviction rule (EngineConfig.expert_eviction)")
    ap.add_argument("--prefetch", default="off", choices=["off", "next-layer"],
                    help="expert prefetch in decode (EngineConfig.prefetch)")
    ap.add_argument("--doorbell-wait", default="auto", choices=list(DOORBELL_WAITS),
                    help="how the device path waits for its CPU experts (EngineConfig.doorbell_wait)")
    ap.add_argument("--join-lateness", default="yes-no",
                    help="how the device path counts a hand-off's join (EngineConfig.join_lateness), a list: the "
                         "first for every policy; a policy that reads the count (auto) runs again with each "
                         "further one right after, as POLICY/COUNT (e.g. yes-no,graded gives auto and auto/graded)")
    ap.add_argument("--reuse-priors", default="",
                    help="run auto once per reuse prior listed (AutoPolicy.reuse_prior, hits a fill; e.g. 4,8), as "
                         "auto/prior P in the rotation beside the other policies: an A/B of the prior in one process")
    ap.add_argument("--fill-shares", default="",
                    help="also run qstar at fixed shares of each layer step's misses filled (q = round(m * share), at "
                         "least 1), a list in (0, 1], reported as 'share S': where the measured optimum lies, beside "
                         "qstar's and auto's splits (the step-time simulator's --fill-ratios on the machine itself)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1", help="sequences decoded together, e.g. 1,4,16,64 (default 1)")
    ap.add_argument("--cpu-threads", default="", help="CPU executor threads, a list (e.g. 6,15; default: the "
                    "engine's count); each count is a sweep of its own")
    ap.add_argument("--torch-cpu-branch", action="store_true",
                    help="run policies with a CPU branch even for a quantized pool on the torch CPU executor")
    ap.add_argument("--compare", nargs="+", metavar="DIR",
                    help="only compare earlier runs' decode.json (first = baseline) into formats.md / formats.json")
    ap.add_argument("--profile-seconds", type=float, default=1.0)
    ap.add_argument("--rotate-gb", type=float, default=2.0,
                    help="expert bytes the bandwidth profile rotates over (far above the L3, so reads come from DRAM)")
    ap.add_argument("--decode-input", default="random", choices=["random", "greedy"],
                    help="token fed to each decode step: random (uniform routing) or the greedy output")
    ap.add_argument("--routing", default="uniform", choices=["uniform", "model", "trace"],
                    help="uniform: k distinct experts drawn uniformly per token and layer (no locality); "
                         "model: the (random) router's own choice; trace: --trace's recorded routing")
    ap.add_argument("--trace", default="", help="--routing trace: routing trace files, comma-separated")
    ap.add_argument("--no-resident", action="store_true", help="skip the all-resident ceiling run")
    ap.add_argument("--contexts", default="",
                    help="extra all-resident runs at these context lengths (tokens), e.g. 8192,32768; the KV "
                         "pages are allocated without a prefill (decode time does not depend on their values)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--out", default=".", help="folder for decode.json and decode.md")
    ap.add_argument("--requests", type=int, default=1,
                    help="requests served back to back per run on one cache and policy (an agent session's turns): "
                         "each prefills, the first decodes --warmup untimed steps, every one --tokens timed steps; "
                         "with --routing trace request r replays the trace from past the rows the requests before "
                         "it read (trace_offset)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every (budget, policy, batch) in turn: the policies alternate within a budget, so a "
                         "drift of the machine reaches each of them alike, each repeat starting one policy further "
                         "into the list (results carry their repeat index)")
    ap.add_argument("--step-log", action="store_true",
                    help="record every decode step (time, hits, misses, fills, CPU experts, the policy's state) "
                         "in decode.json (the timed steps then include the counter reads)")
    ap.add_argument("--no-kernel-warmup", action="store_true",
                    help="skip the untimed auto run before the first timed one (which compiles the decode kernels "
                         "and captures the decode step, seconds on a fresh machine)")
    ap.add_argument("--step-markers", action="store_true",
                    help="with --step-log: stamp each decode step's forward on the device clock and log its device "
                         "time (gpu_ms) and the device's idle time before it (gap_ms)")
    a = ap.parse_args(argv)
    if a.step_markers and not a.step_log:
        ap.error("--step-markers adds to the step log: give --step-log too")
    if a.requests < 1 or a.repeats < 1:
        ap.error(f"--requests and --repeats must be >= 1, got {a.requests} and {a.repeats}")
    if a.compare:
        return compare(a.compare, Path(a.out))
    shares = [float(x) for x in a.fill_shares.split(",") if x]
    if any(not 0 < x <= 1 for x in shares) or len(set(shares)) < len(shares):
        ap.error(f"--fill-shares {a.fill_shares}: distinct shares in (0, 1]")
    priors = [float(x) for x in a.reuse_priors.split(",") if x]
    if any(x < 0 for x in priors) or len(set(priors)) < len(priors) or (priors and "auto" not in a.policies.split(",")):
        ap.error(f"--reuse-priors {a.reuse_priors}: distinct priors >= 0, with auto among --policies")
    latenesses = [x for x in a.join_lateness.split(",") if x]
    if not latenesses or any(x not in JOIN_LATENESS for x in latenesses) or len(set(latenesses)) < len(latenesses):
        ap.error(f"--join-lateness {a.join_lateness}: a list of distinct counts of {', '.join(JOIN_LATENESS)}")
    if a.prefetch != "off" and a.routing != "model":
        ap.error(f"--prefetch {a.prefetch} predicts with the model's own routers, which --routing {a.routing} "
                 "replaces: use --routing model")

    model = model_dir(a)
    threads = [int(t) for t in a.cpu_threads.split(",") if t] or [None]
    batches = [int(b) for b in a.batch_sizes.split(",") if b]
    from edgemoe.models import load_config

    limit = load_config(model).context_length()
    max_len = max([min(4096, limit), *[int(c) + a.warmup + a.tokens + 8 for c in a.contexts.split(",") if c]])
    per_seq = a.prompt_len + a.warmup + a.tokens + 16
    cfg = EngineConfig(device=a.device, dtype=a.dtype, load_format=a.load_format, expert_cache_slots=0,
                       expert_policy="cpu-all", cpu_threads=threads[0], enforce_eager=a.enforce_eager,
                       expert_eviction=a.eviction, prefetch=a.prefetch, doorbell_wait=a.doorbell_wait,
                       join_lateness="graded" if "graded" in latenesses else latenesses[0],  # the options' check
                       max_model_len=max_len, max_num_seqs=max(batches),
                       kv_cache_tokens=max(max_len, max(batches) * per_seq))
    t0 = time.perf_counter()
    runner = ModelRunner(model, cfg)
    load_s = time.perf_counter() - t0
    pool = runner.pool
    trace_steps = None
    trace_start = [0]  # where a request's prefill starts the trace replay (--requests)

    def next_request(r: int, batch: int) -> None:  # request r replays a later stretch of the trace
        trace_start[0] = trace_offset(r, a.prompt_len, a.warmup, a.tokens, batch)
    if a.routing == "uniform":
        route_uniformly(runner, seed=1)
    elif a.routing == "trace":
        if not a.trace:
            ap.error("--routing trace needs --trace FILE[,FILE...]")
        if max(batches) >= a.prompt_len:
            ap.error("--routing trace tells a prefill by its size: give --batch-sizes below --prompt-len")
        trace_steps = route_from_trace(runner, [p for p in a.trace.split(",") if p], a.prompt_len, start=trace_start)
        if (rows := trace_offset(a.requests, a.prompt_len, a.warmup, a.tokens, max(batches))) > trace_steps:
            print(f"note: the requests read {rows} trace rows, the trace has {trace_steps}: later requests wrap "
                  "around onto earlier ones' routing", flush=True)
    print(runner.summary(), flush=True)
    g = torch.Generator().manual_seed(0)
    vocab = runner.model_config.vocab_size
    prompt = torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist()
    feed = None if a.decode_input == "greedy" else torch.randint(  # every request's steps get their own tokens
        0, vocab, ((a.warmup + a.requests * a.tokens) * max(batches),), generator=g).tolist()
    row = pool.row_bytes
    results, profiles, skipped = [], {}, []
    resident_ms: dict[int, float] = {}

    def save() -> str:
        """Write decode.json and decode.md with the results so far (a run cut short keeps them); the table."""
        meta = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": "python " + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"platform": platform.platform(),
                        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                        "cpu_threads": [int(t) for t in profiles], "torch": torch.__version__},
            "model": runner.model_config.architecture, "preset": a.preset if a.model is None else a.model,
            "expert_mb": row / 1e6, "experts_total": runner.pool.num_ids, "pool_gb": runner.pool.nbytes / 1e9,
            "kv_bytes_per_token": runner.kv.bytes_per_token, "kv_layout": runner.kv.spec.describe(),
            "pinned": runner.pinned, "load_s": load_s, "profiles": profiles, "skipped": skipped,
            "format": pool.format.value, "quant": a.quant,
            "bandwidths_used": {"b_p": runner.experts.bandwidths.pcie, "b_h": runner.experts.bandwidths.cpu,
                                "source": runner.experts.bandwidths.source},
            "decode_path": runner.experts.decode_path, "prompt_len": a.prompt_len, "warmup": a.warmup,
            "tokens": a.tokens,
            "batch_sizes": batches, "decode_input": a.decode_input, "routing": a.routing,
            "trace": a.trace or None, "trace_steps": trace_steps, "eviction": a.eviction, "prefetch": a.prefetch,
            "join_lateness": a.join_lateness, "kernel_warmup": bool(budgets) and not a.no_kernel_warmup,
        }
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        lines = [
            "| budget (GB) | policy | threads | batch | context | tokens/s | ms/step | bound ms | bound/measured "
            "| hit rate | fills/step | CPU experts/step | q*/m (policy) | q/m (observed) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            qo = "-" if r["q_over_m_observed"] is None else f"{r['q_over_m_observed']:.2f}"
            bound = f"{r['bound_ms']:.2f} | {r['bound_ratio']:.2f}" if "bound_ms" in r else "- | -"
            lines.append(f"| {r['budget_gb']} | {r['policy']} | {r['threads']} | {r['batch']} | {r['context']} | "
                         f"{r['tokens_per_s']:.1f} | "
                         f"{r['ms_per_token']:.2f} | "
                         f"{bound} | {r['hit_rate']:.3f} | {r['fills_per_token']:.1f} | {r['cpu_per_token']:.1f} | "
                         f"{r['q_ratio_policy']:.3f} | {qo} |")
        table = "\n".join(lines + ([""] if skipped else []) + [f"skipped: {x}" for x in skipped])
        (out / "decode.md").write_text(table + "\n")
        return table

    def record(r: dict, budget) -> None:
        r.update(budget_gb=budget, format=pool.format.value, threads=runner.experts.cpu_executor.threads,
                 cpu_executor=runner.experts.cpu_executor.name)
        results.append(r)
        print(r, flush=True)
        save()

    budgets = [float(x) for x in a.budgets.split(",") if x]
    for n, th in enumerate(threads):
        if n:
            runner.set_cpu_threads(th)
        prof = measure(pool, pool.layout, runner.device, runner.experts.cpu_executor, a.profile_seconds,
                       int(a.rotate_gb * 1e9))
        runner.experts.bandwidths = bandwidths_from_profile(prof, "measured by benchmarks/decode.py")
        ex = runner.experts.cpu_executor
        profiles[str(ex.threads)] = prof
        print(f"CPU executor {ex.name} x {ex.threads} threads; profile: isolated {prof['isolated']}, "
              f"concurrent {prof['concurrent']}", flush=True)
        if n == 0 and not a.no_resident:
            # every expert placed and pinned up front: all hits, the ceiling (no CPU work: once)
            for b in batches:
                r = run_one(runner, pool.num_ids, "static", prompt, a.warmup, a.tokens, feed, batch=b)
                resident_ms[b] = r["ms_per_token"]
                record(r, "all (resident)")
            for ctx in [int(c) for c in a.contexts.split(",") if c]:
                long_prompt = torch.randint(0, vocab, (ctx,), generator=g).tolist()
                r = run_one(runner, pool.num_ids, "static", long_prompt, a.warmup, a.tokens, feed, skip_prefill=True)
                record(r, "all (resident)")
        torch_cpu = ex.name == "torch" and not pool.format.dense and not a.torch_cpu_branch
        if n == 0 and budgets and not a.no_kernel_warmup:
            # one untimed, unrecorded run first: a fresh machine compiles the decode kernels and captures the step in
            # its first decode step (seconds on the GPU host: 2-9 s), which would fall into the first policy run's
            # warm-up and, through auto's time-based window reads, into its first windows; auto captures the step
            # with and without the CPU branch, so every policy's kernels are compiled after it
            warm = "fill-all" if torch_cpu else "auto"
            t0 = time.perf_counter()
            for b in batches:
                run_one(runner, int(budgets[0] * 1e9 // row), warm, prompt, 1, 1, feed, batch=b)
            print(f"kernel warm-up ({warm}, {budgets[0]} GB): {time.perf_counter() - t0:.1f} s", flush=True)
        # (budget, repeat, policy, fixed share filled or None); the shares after the policies, as qstar with B_H set
        # so that its rule fills that share (QStarPolicy: q = round(m * B_P / B_H)); repeat r starts r places further
        # into that list, so no policy always runs first or right after the same one (on the GPU host runs of
        # identical decisions have differed by 2-5 %; a fixed order would put any after-effect on one policy)
        order = [(q, None) for p in a.policies.split(",") if p
                 for q in ([f"auto/prior {x:g}" for x in priors] if p == "auto" and priors else [p])]
        order += [("qstar", x) for x in shares]
        runs = [(gb, rep, pol, share) for gb in budgets
                for rep in range(a.repeats)
                for pol, share in order[rep % len(order):] + order[:rep % len(order)]]
        measured = runner.experts.bandwidths
        for gb, rep, pol, share in runs:
            if pol == "fill-all" and n:  # no CPU branch: the thread count does not matter
                continue
            if torch_cpu and pol != "fill-all":
                if not rep:
                    skipped.append(f"{pol} at {gb} GB, {ex.threads} threads: {pool.format.value} rows have no "
                                   "native CPU kernel (torch executor)")
                continue
            for b, lateness in [(b, x) for b in batches for x in latenesses]:
                if lateness != latenesses[0] and runner.experts.policy.join_limits() is None:
                    continue  # the policy (run_one's last) does not read the count: once, with the first
                if lateness != runner.engine_config.join_lateness:
                    try:
                        runner.set_join_lateness(lateness)
                    except ValueError as e:  # e.g. graded without the native executor: the other runs go on
                        if not rep:
                            skipped.append(f"{pol} with joins counted {lateness} at {gb} GB, {ex.threads} threads: {e}")
                        continue
                runner.experts.bandwidths = measured if share is None else Bandwidths(
                    measured.pcie, measured.pcie / share, f"a fixed share of {share:g} filled")
                name, _, prior = pol.partition("/prior ")  # an auto/prior P of --reuse-priors
                reuse_prior = float(prior) if prior else None
                r = run_one(runner, int(gb * 1e9 // row), name, prompt, a.warmup, a.tokens, feed, batch=b,
                            step_log=a.step_log, requests=a.requests, on_request=next_request,
                            markers=a.step_markers, reuse_prior=reuse_prior)
                r["policy"] = pol
                runner.experts.bandwidths = measured
                if share is not None:
                    r["policy"], r["fill_share"] = f"share {share:g}", share
                elif lateness != latenesses[0]:
                    r["policy"] = f"{pol}/{lateness}"
                if reuse_prior is not None:
                    r["reuse_prior"] = reuse_prior
                r["join_lateness"] = lateness
                # bytes-bound limit: the resident step plus the slower miss branch, each at the rate
                # measured alone (one branch in use) or while both run (both in use: the concurrent pair)
                both = r["fills_per_token"] > 0 and r["cpu_per_token"] > 0
                rates = prof["concurrent"] if both else prof["isolated"]
                if b in resident_ms and rates["b_p_gbps"] and rates["b_h_gbps"]:
                    miss_ms = max(r["fills_per_token"] * row / (rates["b_p_gbps"] * 1e9),
                                  r["cpu_per_token"] * row / (rates["b_h_gbps"] * 1e9)) * 1e3
                    r["bound_ms"] = resident_ms[b] + miss_ms
                    r["bound_ratio"] = r["bound_ms"] / r["ms_per_token"]
                r["repeat"] = rep
                record(r, gb)
    for line in skipped:
        print("skipped:", line, flush=True)
    print(save())
    return 0


def compare(dirs: list[str], out: Path) -> int:
    """``formats.md`` / ``formats.json`` in ``out``: each run's tokens/s and bytes-bound ratio beside the first
    run's (the baseline, e.g. bf16) at the same budget, policy, threads and batch (resident runs: same batch)."""
    runs = [json.loads((Path(d) / "decode.json").read_text()) for d in dirs]

    def key(r: dict) -> tuple:
        resident = not isinstance(r["budget_gb"], (int, float))
        return (str(r["budget_gb"]), r["policy"], None if resident or r["policy"] == "fill-all" else r["threads"],
                r["batch"], r["context"])

    base = {key(r): r for r in runs[0]["results"]}
    rows = []
    for run in runs:
        for r in run["results"]:
            b = base.get(key(r))
            rows.append({"format": r["format"], "budget_gb": r["budget_gb"], "policy": r["policy"],
                         "threads": r["threads"], "batch": r["batch"], "tokens_per_s": r["tokens_per_s"],
                         "ratio_to_baseline": r["tokens_per_s"] / b["tokens_per_s"] if b else None,
                         "bound_ratio": r.get("bound_ratio"), "hit_rate": r["hit_rate"],
                         "expert_mb": run["meta"]["expert_mb"], "cpu_executor": r["cpu_executor"]})
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "runs": [r["meta"] for r in runs],
            "baseline": runs[0]["meta"]["format"]}
    (out / "formats.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    lines = [f"| format | expert MB | budget (GB) | policy | threads | batch | tokens/s | x {meta['baseline']} "
             "| bound/measured | hit rate | CPU executor |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (str(r["budget_gb"]), r["policy"], r["threads"], r["batch"])):
        ratio = "-" if r["ratio_to_baseline"] is None else f"{r['ratio_to_baseline']:.2f}"
        bound = "-" if r["bound_ratio"] is None else f"{r['bound_ratio']:.2f}"
        lines.append(f"| {r['format']} | {r['expert_mb']:.2f} | {r['budget_gb']} | {r['policy']} | {r['threads']} | "
                     f"{r['batch']} | {r['tokens_per_s']:.1f} | {ratio} | {bound} | {r['hit_rate']:.3f} | "
                     f"{r['cpu_executor']} |")
    skipped = [f"{run['meta']['format']}: {x}" for run in runs for x in run["meta"]["skipped"]]
    table = "\n".join(lines + ([""] if skipped else []) + [f"skipped: {x}" for x in skipped])
    (out / "formats.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
