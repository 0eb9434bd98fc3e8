"""Triton kernels of the decode fast path (``edgemoe/kernels/``) against plain-torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (small shapes: the interpreter is
slow; ``conftest.py`` patches two interpreter bugs); with CUDA they run compiled on the device.
Realistic sizes, CUDA-graph capture and bandwidth are checked in ``tests/gpu/test_triton_kernels_gpu.py``.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

triton = pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from edgemoe.core import Phase  # noqa: E402
from edgemoe.experts.cache import ExpertCache  # noqa: E402
from edgemoe.experts.hybrid import plan_step  # noqa: E402
from edgemoe.experts.policy import Bandwidths, CpuAllPolicy, FillAllPolicy, QStarPolicy, StaticPolicy  # noqa: E402
from edgemoe.kernels.decode_attention import (  # noqa: E402
    make_decode_scratch,
    paged_decode_attention,
    paged_latent_decode_attention,
)
from edgemoe.kernels.expert_gemv import expert_gemv  # noqa: E402
from edgemoe.kernels.gather import gather_fills  # noqa: E402
from edgemoe.kernels.route_control import RouteOutputs, route_control  # noqa: E402
from edgemoe.quant.layout import ExpertLayout  # noqa: E402
from edgemoe.quant.weights import WeightFormat  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")

POLICIES = {
    "qstar-1/3": QStarPolicy(Bandwidths(10.0, 30.0)),
    "qstar-1/4": QStarPolicy(Bandwidths(10.0, 40.0)),  # m·q*/m hits exact halves: 2 → 0.5, 6 → 1.5
    "qstar-7/9": QStarPolicy(Bandwidths(7.0, 9.0)),
    "qstar-pcie-faster": QStarPolicy(Bandwidths(55.0, 31.0)),
    "qstar-no-bw": QStarPolicy(Bandwidths(None, None)),
    "fill-all": FillAllPolicy(),
    "cpu-all": CpuAllPolicy(),
    "static": StaticPolicy(),
}


# ---------------------------------------------------------------- policy encoding
@pytest.mark.parametrize("name", list(POLICIES))
def test_fill_rule_reproduces_num_fills(name):
    pol = POLICIES[name]
    num, den, q_min = pol.fill_rule()
    for m in range(0, 300):
        q = math.floor(m * num / den + 0.5)
        q = min(max(q, min(int(q_min), m)), m)
        assert q == (pol.num_fills(m) if pol.admits else 0), (m, q)


# ---------------------------------------------------------------- route control vs plan_step
def _warm_cache(S: int, N: int, pinned: int, seed: int) -> ExpertCache:
    """A cache after random traffic: resident, stale and free slots, equal last_used values, and
    ``pinned`` pinned slots (some resident, some free)."""
    g = torch.Generator().manual_seed(seed)
    c = ExpertCache(S, N, None, torch.float32, torch.device("cpu"))
    for step in range(1, 6):
        ids = torch.randint(0, N, (int(torch.randint(1, 2 * S + 2, (1,), generator=g)),), generator=g).tolist()
        plan_step(c, FillAllPolicy(), {f: 1 + f % 3 for f in ids}, Phase.DECODE, step)
    if pinned:
        c.pinned[torch.randperm(S, generator=g)[:pinned]] = True
    c.counters["decode"] = type(c.counters["decode"])()
    return c


def _expected_cpu_work(flat: torch.Tensor, w: torch.Tensor, cpu: list[int]):
    """The CPU work ``HybridExperts.forward`` hands the executor, flattened as in ``RegisteredStep``."""
    fids, offsets, tok, wt = [], [0], [], []
    for fid in sorted(cpu):
        t, kp = (flat == fid).nonzero(as_tuple=True)
        fids.append(fid)
        offsets.append(offsets[-1] + t.numel())
        tok += t.tolist()
        wt += w[t, kp].float().tolist()
    return fids, offsets, tok, wt


def _random_tables(S: int, N: int, seed: int, free: float, clocks: int) -> ExpertCache:
    """A cache with arbitrary (not traffic-shaped) tables: random owners, a ``free`` fraction of free
    slots, last_used drawn from ``[0, clocks)`` (few values: many ties), and pinned slots."""
    g = torch.Generator().manual_seed(seed)
    c = ExpertCache(S, N, None, torch.float32, torch.device("cpu"))
    used = torch.rand(S, generator=g) >= free
    owners = torch.randperm(N, generator=g)[:S]
    for slot in torch.nonzero(used).view(-1).tolist():
        c.admit(int(owners[slot]), slot, int(torch.randint(0, clocks, (1,), generator=g)))
    c.pinned[torch.rand(S, generator=g) < 0.1] = True
    return c


def _run_route_control(policy, S, L, E, T, k, steps, pinned=0, seed=0, wdtype=torch.float32, groups=64, ref=None,
                       ids=None):
    ref = _warm_cache(S, L * E, pinned, seed) if ref is None else ref
    tables = {n: getattr(ref, n).clone().to(DEV) for n in ("slot_of", "owner_of", "last_used", "pinned")}
    clock = torch.zeros(1, dtype=torch.int64, device=DEV)
    rule = torch.tensor(policy.fill_rule(), dtype=torch.float64, device=DEV)
    counters = torch.zeros(4, dtype=torch.int64, device=DEV)
    out = RouteOutputs.empty(T * k + 3, DEV)  # capacity above T·k, as a graph padded to a larger batch
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(10, 10 + steps):
        clock.fill_(step)
        for layer in range(L):
            # repeats within and across tokens
            step_ids = torch.randint(0, E, (T, k), generator=g) if ids is None else ids
            w = torch.rand(T, k, generator=g).to(wdtype)
            flat = step_ids + layer * E
            tpe = {f: int((flat == f).sum()) for f in torch.unique(flat).tolist()}
            plan = plan_step(ref, policy, tpe, Phase.DECODE, step)
            route_control(step_ids.to(DEV), w.to(DEV), layer * E, tables["slot_of"], tables["owner_of"],
                          tables["last_used"], tables["pinned"], clock, rule, counters, out, groups=groups)
            where = f"step {step} layer {layer}"
            for n, t in tables.items():
                assert torch.equal(t.cpu(), getattr(ref, n)), f"{n} differs at {where}"
            fills = plan.waves[0] if plan.waves else []
            placed = {**plan.hits, **dict(fills)}
            P, nf = T * k, len(fills)
            assert out.slot_tk[:P].tolist() == [placed.get(f, -1) for f in flat.view(-1).tolist()], where
            assert out.meta.tolist() == [len(plan.hits), nf + len(plan.cpu), nf, len(plan.cpu)], where
            assert out.fill_fid[:P].tolist() == [f for f, _ in fills] + [-1] * (P - nf), where
            assert out.fill_slot[:P].tolist() == [s for _, s in fills] + [-1] * (P - nf), where
            fids, offsets, tok, wt = _expected_cpu_work(flat, w, plan.cpu)
            n = len(fids)
            assert out.cpu_dims.tolist() == [T, n], where
            assert out.cpu_fids[:n].tolist() == fids, where
            assert out.cpu_offsets[:P + 1].tolist() == offsets + [offsets[-1]] * (P - n), where
            assert out.cpu_tok[:len(tok)].tolist() == tok, where
            assert out.cpu_wt[:len(wt)].tolist() == wt, where
    c = ref.counters["decode"]
    assert counters.tolist() == [c.hits, c.misses, c.fills, c.cpu]
    ref.check_invariants()
    return c


@pytest.mark.parametrize("name", list(POLICIES))
def test_route_control_equals_plan_step_for_every_policy(name):
    # 7 slots, 3 layers of 8 experts, 3 tokens x top-3: often more distinct experts than slots
    c = _run_route_control(POLICIES[name], S=7, L=3, E=8, T=3, k=3, steps=3, pinned=2 if name == "static" else 0,
                           seed=len(name))
    assert c.misses > 0 and c.hits > 0


@pytest.mark.parametrize("S,pinned,T,k,groups", [(5, 3, 2, 4, 64), (40, 4, 4, 4, 4), (3, 0, 1, 8, 1), (9, 9, 2, 2, 2),
                                                  (30, 0, 4, 4, 2)])
def test_route_control_tight_pinned_and_single_token_caches(S, pinned, T, k, groups):
    # every slot pinned (S=9, pinned=9): nothing evictable, q clamps to 0. Few slot groups: several
    # of the LRU victims share a group, so the search needs several passes
    c = _run_route_control(QStarPolicy(Bandwidths(10.0, 15.0)), S=S, L=2, E=12, T=T, k=k, steps=3, pinned=pinned,
                           seed=S, wdtype=torch.bfloat16, groups=groups)
    if pinned == S:
        assert c.fills == 0


@pytest.mark.parametrize("name", ["fill-all", "qstar"])
def test_route_control_resident_model_all_hits_after_warm_up(name):
    """Every expert fits (S = L·E): the first steps fill, then every step is all hits (the passes that
    order misses and lay out CPU work are skipped); the outputs still equal ``plan_step``'s."""
    policy = FillAllPolicy() if name == "fill-all" else QStarPolicy(Bandwidths(10.0, 15.0))
    c = _run_route_control(policy, S=24, L=3, E=8, T=2, k=4, steps=8, seed=5)
    assert c.hits > 0 and c.misses > 0


@pytest.mark.parametrize("S,E,groups,free,clocks", [(150, 200, 4, 0.2, 6), (150, 200, 2, 0.05, 40),
                                                     (5000, 2000, 64, 0.001, 5000), (5000, 2000, 8, 0.001, 5000)])
def test_route_control_victim_search_on_random_tables(S, E, groups, free, clocks):
    # LRU victims cluster in few slot groups and (S > 4096) span several blocks of the table scan
    seed = S + groups
    ref = _random_tables(S, 4 * E, seed, free, clocks)
    _run_route_control(FillAllPolicy(), S=S, L=4, E=E, T=8, k=8, steps=1, seed=seed, groups=groups, ref=ref)


def test_route_control_victim_order_across_scan_blocks():
    # groups=2, S=4100: the scan covers slots [0, 4096) then [4096, 4100). Group 0's two oldest slots
    # are 0 (first block) and 4096 (second block); group 1's oldest, slot 1, falls between them.
    S = 4100
    ref = ExpertCache(S, S + 8, None, torch.float32, torch.device("cpu"))
    ref.slot_of[:S] = torch.arange(S)
    ref.owner_of.copy_(torch.arange(S))
    ref.last_used.fill_(100)
    ref.last_used[[0, 4096, 1]] = torch.tensor([0, 1, 2])
    ids = torch.tensor([[S, S + 1, S + 2]])
    _run_route_control(FillAllPolicy(), S=S, L=1, E=S + 8, T=1, k=3, steps=1, groups=2, ref=ref, ids=ids)
    assert ref.owner_of[[0, 4096, 1]].tolist() == [S, S + 1, S + 2]


@pytest.mark.parametrize("T,k,S,groups", [(8, 8, 300, 8), (16, 8, 4500, 64)])
def test_route_control_large_steps(T, k, S, groups):
    # many fills per layer (several passes of the victim search), 128 routes, a table of > 4096 slots
    _run_route_control(FillAllPolicy(), S=S, L=2, E=64, T=T, k=k, steps=2, pinned=7, seed=T, groups=groups)


@pytest.mark.parametrize("T,k,S,E,policy", [(32, 8, 200, 128, "qstar-1/3"), (64, 8, 200, 256, "qstar-7/9"),
                                            (17, 8, 90, 64, "fill-all"), (64, 8, 40, 256, "cpu-all"),
                                            (20, 7, 150, 96, "qstar-1/4")])
def test_route_control_batches_beyond_one_tile(T, k, S, E, policy):
    # T·k = 256 and 512 (32 and 64 sequences of top-8), and 136 / 140: routes span 2-4 tiles of 128, so
    # dedupe, fill ranks, CPU ordinals and offsets all compare routes across tiles; E = 128 experts
    # per layer makes most experts repeat across tokens (several tokens per expert); S < distinct
    # misses: CPU work every layer
    c = _run_route_control(POLICIES[policy], S=S, L=2, E=E, T=T, k=k, steps=2, pinned=5, seed=T + S)
    assert c.misses > 0 and (c.cpu > 0 or policy == "fill-all")


def test_route_control_rejects_bad_arguments():
    tab = ExpertCache(4, 16, None, torch.float32, DEV)
    rule = torch.tensor(FillAllPolicy().fill_rule(), dtype=torch.float64, device=DEV)
    counters = torch.zeros(4, dtype=torch.int64, device=DEV)
    args = (tab.slot_of, tab.owner_of, tab.last_used, tab.pinned, tab.clock, rule, counters)
    ids = torch.zeros(0, 8, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="route"):
        route_control(ids, torch.ones(0, 8, device=DEV), 0, *args, RouteOutputs.empty(8, DEV))
    ids = torch.zeros(3, 8, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="scratch"):
        out = RouteOutputs.empty(24, DEV)
        out.scratch = out.scratch[:, :8]
        route_control(ids, torch.ones(3, 8, device=DEV), 0, *args, out)
    ids = torch.zeros(2, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="cpu_offsets"):
        out = RouteOutputs.empty(4, DEV)
        out.cpu_offsets = out.cpu_offsets[:4]
        route_control(ids, torch.ones(2, 2, device=DEV), 0, *args, out)
    with pytest.raises(ValueError, match="policy"):
        route_control(ids, torch.ones(2, 2, device=DEV), 0, *args[:5], rule.float(), counters,
                      RouteOutputs.empty(4, DEV))
    empty = ExpertCache(0, 16, None, torch.float32, DEV)
    with pytest.raises(ValueError, match="slot"):
        route_control(ids, torch.ones(2, 2, device=DEV), 0, empty.slot_of, empty.owner_of, empty.last_used,
                      empty.pinned, empty.clock, rule, counters, RouteOutputs.empty(4, DEV))


# ---------------------------------------------------------------- gather
@pytest.mark.parametrize("fmt,I,H", [(WeightFormat.BF16, 40, 120), (WeightFormat.BF16, 3, 5),
                                     (WeightFormat.FP32, 3, 10), (WeightFormat.NVFP4, 32, 64),
                                     (WeightFormat.MXFP4, 32, 64)])
def test_gather_copies_exactly_the_fills(fmt, I, H):
    # bf16 2I x H = 80 x 120 + 120 x 40: a 28672-byte row, more than one 16 KiB chunk; packed rows move as bytes
    layout = ExpertLayout.build(fmt, H, I)
    g = torch.Generator().manual_seed(I)
    N, S = 9, 6
    src = torch.randint(0, 256, (N, layout.row_bytes), generator=g, dtype=torch.uint8).to(DEV)
    dst = torch.zeros(S, layout.row_bytes, dtype=torch.uint8, device=DEV)
    fid = torch.tensor([7, 2, 5, 0, -1], dtype=torch.int64, device=DEV)
    slot = torch.tensor([4, 0, 1, 3, -1], dtype=torch.int64, device=DEV)
    meta = torch.tensor([1, 3, 3, 0], dtype=torch.int32, device=DEV)  # 3 fills: the 4th pair is not copied
    gather_fills(meta, fid, slot, src, dst, num_programs=3)
    for f, s in zip([7, 2, 5], [4, 0, 1]):
        assert torch.equal(dst[s], src[f])
    for s in (2, 3, 5):
        assert not dst[s].any()
    dst.zero_()  # another launch shape (benchmarks/fill_kernel.py sweeps them): the same copy
    gather_fills(meta, fid, slot, src, dst, num_programs=2, block_words=512, num_warps=4)
    assert all(torch.equal(dst[s], src[f]) for f, s in zip([7, 2, 5], [4, 0, 1])) and not dst[[2, 3, 5]].any()
    meta[2] = 0
    dst.zero_()
    gather_fills(meta, fid, slot, src, dst)
    assert not dst.any()


def test_gather_rejects_mismatched_banks():
    a = torch.zeros(3, 4096, dtype=torch.uint8, device=DEV)
    meta = torch.zeros(4, dtype=torch.int32, device=DEV)
    ids = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="rows of 4096 bytes and cache rows of 8192 bytes differ"):
        gather_fills(meta, ids, ids, a, torch.zeros(3, 8192, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match="contiguous uint8"):
        gather_fills(meta, ids, ids, a, a.view(torch.float32))
    with pytest.raises(ValueError, match="meta"):
        gather_fills(meta.long(), ids, ids, a, a)
    with pytest.raises(ValueError, match="power of two"):
        gather_fills(meta, ids, ids, a, a, block_words=3000)


# ---------------------------------------------------------------- expert GEMV
def _swiglu_routes(x, slot_tk, w, w13, w2):
    """The eager device path (``HybridExperts._run_device_pairs``), one route at a time."""
    T, k = w.shape
    dt = w13.dtype
    out = torch.zeros(T, k, x.shape[1], dtype=dt)
    for p, s in enumerate(slot_tk.tolist()[: T * k]):
        t, j = divmod(p, k)
        if s >= 0:
            gate, up = F.linear(x[t:t + 1].to(dt), w13[s]).chunk(2, dim=-1)
            out[t, j] = (F.linear(F.silu(gate) * up, w2[s]) * w[t, j].to(dt))[0]
    return out


@pytest.mark.parametrize("dtype,T,k,H,I", [(torch.float32, 3, 2, 80, 20), (torch.bfloat16, 3, 2, 80, 20),
                                           (torch.bfloat16, 1, 4, 520, 12), (torch.float32, 2, 3, 33, 9)])
def test_expert_gemv_matches_swiglu_routes(dtype, T, k, H, I):
    g = torch.Generator().manual_seed(H)
    S = 4
    x = torch.randn(T, H, generator=g)
    w13 = (torch.randn(S, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(S, H, I, generator=g) / I**0.5).to(dtype)
    slot_tk = torch.tensor(([0, 3, -1, 2, 1, 0, 3, 1] * 3)[: T * k], dtype=torch.int32)  # repeats and CPU routes
    w = torch.rand(T, k, generator=g)
    out = torch.full((T, k, H), 7.0, dtype=dtype, device=DEV)  # stale rows must be overwritten
    a = torch.empty(T * k, I, dtype=dtype, device=DEV)
    expert_gemv(x.to(DEV), slot_tk.to(DEV), w.to(DEV), w13.to(DEV), w2.to(DEV), out, a)
    ref = _swiglu_routes(x, slot_tk, w, w13, w2)
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    else:  # bf16 rounding points agree; summation order may flip a projection's last bit
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2**-5, atol=2**-5 * ref.abs().max().item())
    assert not out.cpu()[slot_tk.view(T, k) < 0].any()
    # over the section views of a byte bank (slots row_bytes apart): the same bits
    layout = ExpertLayout.build(WeightFormat.for_dtype(dtype), H, I)
    bank = layout.new_bank(S)
    layout.view(bank, "w13").copy_(w13)
    layout.view(bank, "w2").copy_(w2)
    bank = bank.to(DEV)
    out2 = torch.full((T, k, H), 7.0, dtype=dtype, device=DEV)
    expert_gemv(x.to(DEV), slot_tk.to(DEV), w.to(DEV), layout.view(bank, "w13"), layout.view(bank, "w2"), out2, a)
    assert torch.equal(out2, out)


def test_expert_gemv_rejects_bad_shapes():
    w13, w2 = torch.zeros(2, 8, 6, device=DEV), torch.zeros(2, 6, 4, device=DEV)
    x, w = torch.zeros(1, 6, device=DEV), torch.zeros(1, 2, device=DEV)
    slot = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="scratch"):
        expert_gemv(x, slot, w, w13, w2, torch.zeros(1, 2, 6, device=DEV), torch.zeros(2, 5, device=DEV))
    with pytest.raises(ValueError, match="slot_tk"):
        expert_gemv(x, slot.long(), w, w13, w2, torch.zeros(1, 2, 6, device=DEV), torch.zeros(2, 4, device=DEV))


# ---------------------------------------------------------------- paged decode attention
def _attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale, page_size):
    """SDPA in float32 over each sequence's gathered K/V (GQA heads repeated)."""
    B, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    out = torch.zeros(B, Hq, D)
    for b in range(B):
        n = int(context_lens[b])
        if n == 0:
            continue
        t = torch.arange(n)
        rows = block_tables[b, t // page_size].long() * page_size + t % page_size
        kk = k_cache[rows].float().repeat_interleave(G, dim=1).transpose(0, 1)  # [Hq, n, D]
        vv = v_cache[rows].float().repeat_interleave(G, dim=1).transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(q[b].float()[:, None], kk, vv, scale=scale)[:, 0]
    return out


@pytest.mark.parametrize("dtype,D,Hq,Hk,page,part", [(torch.float32, 64, 4, 2, 16, 64),
                                                     (torch.bfloat16, 128, 4, 1, 32, 128),
                                                     (torch.float16, 64, 2, 2, 64, 64),
                                                     (torch.bfloat16, 64, 8, 2, 16, 256)])
def test_paged_decode_attention_matches_sdpa(dtype, D, Hq, Hk, page, part):
    g = torch.Generator().manual_seed(D + page)
    lens = [1, 0, 130, 77, part, part + 1]  # 0: a padding row; 1; across pages and partitions
    B, max_pages, num_pages = len(lens), -(-max(lens) // page) + 1, 64
    k_cache = torch.randn(num_pages * page, Hk, D, generator=g).to(dtype)
    v_cache = torch.randn(num_pages * page, Hk, D, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scratch = make_decode_scratch(B + 2, Hq, D, max_pages * page, DEV, partition_size=part)
    out = torch.full((B, Hq, D), float("nan"), dtype=dtype, device=DEV)
    paged_decode_attention(q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), tables.to(DEV), ctx.to(DEV), D**-0.5, out,
                           scratch, page)
    ref = _attention_reference(q, k_cache, v_cache, tables, ctx, D**-0.5, page)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,C,R,H,page,part", [(torch.float32, 32, 16, 20, 16, 64),
                                                  (torch.bfloat16, 64, 16, 16, 8, 64),
                                                  (torch.float16, 32, 32, 3, 32, 128)])
def test_paged_latent_decode_attention_matches_torch(dtype, C, R, H, page, part):
    """Multi-head latent attention decode: every head against one shared latent row per token, value = the
    row's first C values (reference: ``edgemoe.layers.mla.latent_decode_attention`` in float32)."""
    from edgemoe.layers.mla import latent_decode_attention

    g = torch.Generator().manual_seed(C + page)
    lens = [1, 0, 130, 77, part, part + 1]  # 0: a padding row; across pages and partitions
    B, max_pages, num_pages = len(lens), -(-max(lens) // page) + 1, 48
    latent = torch.randn(num_pages * page, C + R, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in range(B)]).to(torch.int32)
    q = torch.randn(B, H, C + R, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scratch = make_decode_scratch(B + 1, H, C, max_pages * page, DEV, partition_size=part)
    out = torch.full((B, H, C), float("nan"), dtype=dtype, device=DEV)
    paged_latent_decode_attention(q.to(DEV), latent.to(DEV), tables.to(DEV), ctx.to(DEV), 0.2, out, scratch, page)
    pos = torch.arange(max_pages * page)
    slots = tables.long()[:, pos // page] * page + pos % page
    ref = latent_decode_attention(q.float(), latent.float(), slots, ctx.long().clamp(min=1), C, 0.2)
    ref[1] = 0  # a zero-length row gives zeros
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="powers of two"):
        paged_latent_decode_attention(q[..., :-8].contiguous().to(DEV), latent[:, :-8].contiguous().to(DEV),
                                      tables.to(DEV), ctx.to(DEV), 0.2, out, scratch, page)
    other = make_decode_scratch(B, H + 1, C, max_pages * page, DEV, partition_size=part)
    with pytest.raises(ValueError, match="scratch"):
        paged_latent_decode_attention(q.to(DEV), latent.to(DEV), tables.to(DEV), ctx.to(DEV), 0.2, out, other, page)


def test_decode_scratch_and_attention_argument_checks():
    with pytest.raises(ValueError, match="partition_size"):
        make_decode_scratch(1, 4, 64, 1000, DEV, partition_size=100)
    s = make_decode_scratch(2, 4, 64, 1000, DEV, partition_size=256)
    assert s.max_partitions == 4 and tuple(s.acc.shape) == (2, 4, 4, 64)
    q = torch.zeros(3, 4, 64, device=DEV)
    kv = torch.zeros(32, 2, 64, device=DEV)
    with pytest.raises(ValueError, match="scratch"):
        paged_decode_attention(q, kv, kv, torch.zeros(3, 2, dtype=torch.int32, device=DEV),
                               torch.ones(3, dtype=torch.int32, device=DEV), 0.1, q.clone(), s, 16)
