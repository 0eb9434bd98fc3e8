"""Routing control of one MoE layer's decode step, on the device.

The device twin of :func:`edgemoe.experts.hybrid.plan_step` (decode branch): one single-program
Triton launch per MoE layer reads the router's top-k, classifies the step's experts against the
expert cache's residency table, picks ``q`` of the misses to fill and their LRU victim slots, rewrites
the tables, and lays out the CPU branch's work in the registered-step format of the native executor
(``edgemoe_step`` in ``edgemoe/experts/csrc/executor.h``). Nothing is read back to the host, so the
launch can be captured in a CUDA graph.

Algorithm (``P = T·k`` routes, any ``P``; ``S`` slots; FreeToken, arXiv 2608.16157, §2). The
pairwise steps compare routes in tiles of at most 128 x 128 (one tile up to 16 tokens of top-8),
so a step of 64 sequences of top-8 is 16 tiles per pass; per-route values that other tiles read
live in the caller's scratch rows between passes.

1. Dedupe: pairwise comparison of the ``P`` flat ids; an expert's first route represents it, its
   route count is its token count.
2. Lookup ``slot_of``; hits' slots are marked ``last_used = -2`` (a value no clock takes) for the
   victim search and set to the clock at the end.
3. ``q = clamp(floor(m·num/den + 0.5), min(q_min, m), m)`` in float64 (exactly the host formula,
   see :meth:`edgemoe.experts.policy.ExpertPolicy.fill_rule`), or, for a per-layer policy, ``q =
   table[layer, min(m, M)]`` (:meth:`edgemoe.experts.policy.AutoPolicy.fill_table`), at least the
   misses that find a free slot (a fill there displaces nothing); clamped to the evictable slots.
4. Fill order: misses by (tokens descending, flat id ascending) — the rank of each miss is a
   pairwise count.
5. Victims: the ``q`` smallest keys ``(last_used + 1)·S + slot`` over evictable slots (not pinned, not
   hit by this layer's step) of the layer's victim range (all slots under global LRU, the layer's
   partition under per-layer LRU). The slots are split into ``G`` groups (``slot mod G``); each pass over
   the table keeps every group's smallest and second-smallest key above the last accepted key. Every
   group minimum below the smallest second-minimum is among the next smallest keys overall, so a pass
   accepts at least one victim (typically many); at most ``q`` passes, usually one or two.
6. The i-th fill takes the i-th victim; the victim's previous owner is evicted.

Reuse accounting (optional, the tables of :class:`edgemoe.experts.cache.ExpertCache`, whose module docstring
gives the reasons): a fill that displaces a resident remembers the id it displaced (its *ghost*:
``ghost_slot[ghost] = slot``, ``slot_ghost[slot] = ghost``); the pair is live while the filled id stays in the
slot and no other fill displaces the ghost. Per MoE layer ``l``, ``reuse[l, 0]`` gains one for each hit of the
layer on a resident with a live ghost and loses one for each request (hit or miss) of a live ghost displaced by
a fill of layer ``l`` (charged to the filler's layer); ``reuse[l, 1]`` counts the layer's fills that displaced a
resident. ``reuse[l, 0] / reuse[l, 1]`` over a window is the net reuse of such a fill against the cache without
it (zero in expectation without routing locality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from edgemoe.kernels.cpu_work import carve_cpu_work, cpu_work_words

TILE = 128  # routes per tile of the pairwise comparisons
SCRATCH_ROWS = 6  # int32 per-route rows: count, within, slot, flags, rank, CPU-expert ordinal
GROUPS = 64  # slot groups of the victim search (default)
_HIT = tl.constexpr(-2)  # last_used mark of this step's hit slots during the search
_NO_KEY = tl.constexpr(2**63 - 1)


@dataclass
class RouteOutputs:
    """Caller-owned, fixed-shape outputs of :func:`route_control` (``K`` = capacity, ``K >= P``).

    Attributes:
        slot_tk: ``[>= P]`` int32: slot of each route (row-major over ``[T, k]``) for hits and fills,
            -1 for routes computed on the CPU.
        fill_fid: ``[K]`` int64: flat ids to copy host→device, in fill order (first ``meta[2]``
            valid, the rest -1 up to ``P``).
        fill_slot: ``[K]`` int64: destination slot of each fill (same layout).
        meta: ``[4]`` int32: ``(n_hits, n_misses, n_fills, n_cpu)`` of this layer's step (deduplicated
            experts).
        cpu_dims: ``[2]`` int64: ``(T, n_cpu)``.
        cpu_fids: ``[K]`` int64: CPU experts in ascending flat id (first ``n_cpu`` valid).
        cpu_offsets: ``[K + 1]`` int64: routes of CPU expert ``e`` are ``cpu_offsets[e] .. [e + 1]``
            (entries ``0 .. P`` written; those past ``n_cpu`` hold the total).
        cpu_tok: ``[K]`` int64: token row of each CPU route, grouped by expert, ascending token.
        cpu_wt: ``[K]`` float32: router weight of each CPU route.
        cpu_pack: ``[cpu_work_words(K, K)]`` int64 holding the ``cpu_*`` buffers above in the native
            executor's registered-step layout (:func:`~edgemoe.kernels.cpu_work.carve_cpu_work`), so one copy
            moves a step's CPU work to the host.
        scratch: ``[SCRATCH_ROWS, K]`` int32 working rows of the kernel (no meaning outside it).
    """

    slot_tk: torch.Tensor
    fill_fid: torch.Tensor
    fill_slot: torch.Tensor
    meta: torch.Tensor
    cpu_dims: torch.Tensor
    cpu_fids: torch.Tensor
    cpu_offsets: torch.Tensor
    cpu_tok: torch.Tensor
    cpu_wt: torch.Tensor
    cpu_pack: torch.Tensor
    scratch: torch.Tensor

    @classmethod
    def empty(cls, max_routes: int, device: torch.device | str) -> "RouteOutputs":
        """Buffers for up to ``max_routes`` routes (``K = max_routes``) on ``device``."""
        K = int(max_routes)
        i64 = dict(dtype=torch.int64, device=device)
        pack = torch.zeros(cpu_work_words(K, K), **i64)
        dims, fids, offsets, tok, wt = carve_cpu_work(pack, K, K)
        return cls(slot_tk=torch.full((K,), -1, dtype=torch.int32, device=device), fill_fid=torch.full((K,), -1, **i64),
                   fill_slot=torch.full((K,), -1, **i64), meta=torch.zeros(4, dtype=torch.int32, device=device),
                   cpu_dims=dims, cpu_fids=fids, cpu_offsets=offsets, cpu_tok=tok, cpu_wt=wt, cpu_pack=pack,
                   scratch=torch.zeros(SCRATCH_ROWS, K, dtype=torch.int32, device=device))


@triton.jit
def _group_minima(last_used_ptr, pinned_ptr, S, lo, hi, thr, BLOCK_R: tl.constexpr, G: tl.constexpr):
    """One pass over slots ``lo .. hi - 1``: per group ``g = (slot - lo) mod G``, the smallest and
    second-smallest key ``(last_used + 1)·S + slot`` above ``thr`` among evictable slots; and the
    evictable count and the free count (evictable slots that hold nothing)."""
    rows = tl.arange(0, BLOCK_R)[:, None]
    cols = tl.arange(0, G)[None, :]
    gmin = tl.full([G], _NO_KEY, tl.int64)
    gsec = tl.full([G], _NO_KEY, tl.int64)
    n_ok = tl.zeros([G], tl.int32)
    n_free = tl.zeros([G], tl.int32)
    for start in range(0, hi - lo, BLOCK_R * G):
        slot = lo + start + rows * G + cols  # [BLOCK_R, G]
        inb = slot < hi
        lu = tl.load(last_used_ptr + slot, mask=inb, other=_HIT)
        pin = tl.load(pinned_ptr + slot, mask=inb, other=1)
        ok = inb & (pin == 0) & (lu != _HIT)
        n_ok += tl.sum(ok.to(tl.int32), axis=0)
        n_free += tl.sum((ok & (lu == -1)).to(tl.int32), axis=0)
        key = (tl.where(ok, lu, 0) + 1) * S + slot
        key = tl.where(ok & (key > thr), key, _NO_KEY)
        bmin = tl.min(key, axis=0)  # [G]
        bsec = tl.min(tl.where(key == bmin[None, :], _NO_KEY, key), axis=0)  # [G]
        gsec = tl.minimum(tl.minimum(gsec, bsec), tl.maximum(gmin, bmin))
        gmin = tl.minimum(gmin, bmin)
    return gmin, gsec, tl.sum(n_ok), tl.sum(n_free)


# The slot-table size and range change when the expert cache is resized, and the layer ordinals differ per
# layer: integer arguments Triton would otherwise specialize on (== 1, divisible by 16), which would compile
# new variants on the decode path after a resize (seconds, where elastic memory must react within one).
@triton.jit(do_not_specialize=["layer_offset", "S", "moe_layer", "slot_lo", "slot_hi"])
def _route_control_kernel(topk_ids_ptr, topk_w_ptr, layer_offset, P, K, T,
                          slot_of_ptr, owner_of_ptr, last_used_ptr, pinned_ptr, clock_ptr, policy_ptr,
                          counters_ptr, S,
                          slot_tk_ptr, fill_fid_ptr, fill_slot_ptr, meta_ptr,
                          cpu_dims_ptr, cpu_fids_ptr, cpu_offsets_ptr, cpu_tok_ptr, cpu_wt_ptr, scratch_ptr, SK,
                          table_ptr, table_cols, moe_layer, ghost_slot_ptr, slot_ghost_ptr, reuse_ptr, E,
                          slot_lo, slot_hi,
                          BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr, G: tl.constexpr,
                          TABLE: tl.constexpr, REUSE: tl.constexpr, COUNT: tl.constexpr):
    # Routes are processed in tiles of BLOCK_P; a pairwise quantity of route i is a sum over every
    # column tile j of [BLOCK_P, BLOCK_P] comparisons. Per-route values that later tiles read go
    # through the caller's scratch rows (int32 [6, SK]): count, within, slot, flags, rank, CPU ordinal.
    cnt_ptr, within_ptr, slot_ptr = scratch_ptr, scratch_ptr + SK, scratch_ptr + 2 * SK
    flags_ptr, rank_ptr, eo_ptr = scratch_ptr + 3 * SK, scratch_ptr + 4 * SK, scratch_ptr + 5 * SK
    lane = tl.arange(0, BLOCK_P)
    clock = tl.load(clock_ptr)

    # 1. dedupe (an expert's first route represents it, its route count is its token count) and
    #    2. hits and misses; hit slots are marked for the victim search
    n_hits = tl.zeros([], tl.int32)
    n_credit = tl.zeros([], tl.int32)
    m = tl.zeros([], tl.int32)
    for i0 in range(0, P, BLOCK_P):
        r = i0 + lane
        valid = r < P
        fid = tl.load(topk_ids_ptr + r, mask=valid, other=0) + layer_offset  # [BP] int64 flat ids
        cnt = tl.zeros([BLOCK_P], tl.int32)
        within = tl.zeros([BLOCK_P], tl.int32)
        for j0 in range(0, P, BLOCK_P):
            c = j0 + lane
            fc = tl.load(topk_ids_ptr + c, mask=c < P, other=0) + layer_offset
            same = (fid[:, None] == fc[None, :]) & valid[:, None] & (c < P)[None, :]  # [BP, BP]
            cnt += tl.sum(same.to(tl.int32), axis=1)
            within += tl.sum((same & (c[None, :] < r[:, None])).to(tl.int32), axis=1)
        first = valid & (within == 0)
        slot = tl.load(slot_of_ptr + fid, mask=valid, other=-1)  # [BP]
        hit = valid & (slot >= 0)
        miss = valid & (slot < 0)
        n_hits += tl.sum((first & hit).to(tl.int32))
        m += tl.sum((first & miss).to(tl.int32))
        tl.store(last_used_ptr + slot, _HIT, mask=hit)
        if COUNT:  # (implies REUSE) before any table changes: requests of live ghosts are charged to their
            # filler's layer, hits on residents with a live ghost credited to this layer
            gs = tl.load(ghost_slot_ptr + fid, mask=first, other=-1)  # [BP]
            gown = tl.load(owner_of_ptr + gs, mask=first & (gs >= 0), other=-1)  # [BP]
            pen = first & (gs >= 0) & (gown >= 0)
            tl.atomic_add(reuse_ptr + (gown // E) * 2, tl.full([BLOCK_P], -1, tl.int64), mask=pen)
            hg = tl.load(slot_ghost_ptr + slot, mask=first & hit, other=-1)  # [BP] the hit resident's ghost
            hg_at = tl.load(ghost_slot_ptr + hg, mask=first & hit & (hg >= 0), other=-1)
            n_credit += tl.sum((first & hit & (hg >= 0) & (hg_at == slot)).to(tl.int32))
        tl.store(cnt_ptr + r, cnt, mask=valid)
        tl.store(within_ptr + r, within, mask=valid)
        tl.store(slot_ptr + r, slot.to(tl.int32), mask=valid)
        tl.store(flags_ptr + r, first.to(tl.int32) | (miss.to(tl.int32) << 1), mask=valid)
    if COUNT:
        tl.atomic_add(reuse_ptr + moe_layer * 2, n_credit.to(tl.int64))
    tl.debug_barrier()

    # 3. q from the policy's fill rule (float64, the host formula's operation order) or its per-layer
    #    table, clamped to the evictable slots (counted by the first pass of the victim search, skipped
    #    when nothing fills)
    if TABLE:
        q = tl.load(table_ptr + moe_layer * table_cols + tl.minimum(m, table_cols - 1)).to(tl.int32)
        q = tl.minimum(tl.maximum(q, 0), m)
    else:
        num = tl.load(policy_ptr)
        den = tl.load(policy_ptr + 1)
        q_min = tl.load(policy_ptr + 2).to(tl.int32)
        q = (m.to(tl.float64) * num / den + 0.5).to(tl.int32)  # floor of a non-negative value
        q = tl.minimum(tl.maximum(q, tl.minimum(q_min, m)), m)
    gmin = tl.full([G], _NO_KEY, tl.int64)
    gsec = tl.full([G], _NO_KEY, tl.int64)
    n_evict = tl.zeros([], tl.int32)
    n_free = tl.zeros([], tl.int32)
    if (q > 0) | (TABLE & (m > 0)):
        gmin, gsec, n_evict, n_free = _group_minima(last_used_ptr, pinned_ptr, S, slot_lo, slot_hi, -1, BLOCK_R, G)
        if TABLE:  # a per-layer policy fills at least the misses that find a free slot
            q = tl.maximum(q, tl.minimum(m, n_free))
    q = tl.minimum(q, n_evict)

    # 4. fill order: most-routed misses first, ties to the smaller flat id (nothing to order without
    #    misses: the all-hit step of a resident model skips the pass)
    for i0 in range(0, tl.where(m > 0, P, 0), BLOCK_P):
        r = i0 + lane
        valid = r < P
        fid = tl.load(topk_ids_ptr + r, mask=valid, other=0) + layer_offset
        cnt = tl.load(cnt_ptr + r, mask=valid, other=0)
        flags = tl.load(flags_ptr + r, mask=valid, other=0)
        rank = tl.zeros([BLOCK_P], tl.int32)
        for j0 in range(0, P, BLOCK_P):
            c = j0 + lane
            fc = tl.load(topk_ids_ptr + c, mask=c < P, other=0) + layer_offset
            cc = tl.load(cnt_ptr + c, mask=c < P, other=0)
            um = ((tl.load(flags_ptr + c, mask=c < P, other=0) & 3) == 3)[None, :]  # first & miss
            rank += tl.sum((um & ((cc[None, :] > cnt[:, None]) | ((cc[None, :] == cnt[:, None]) &
                                                                  (fc[None, :] < fid[:, None])))).to(tl.int32), axis=1)
        miss = (flags & 2) != 0
        is_fill = miss & (rank < q)
        is_cpu = miss & (rank >= q)
        tl.store(fill_fid_ptr + rank, fid, mask=is_fill & ((flags & 1) != 0))
        tl.store(rank_ptr + r, rank, mask=valid)
        tl.store(flags_ptr + r, flags | (is_cpu.to(tl.int32) << 2), mask=valid)

    # 5. victims in (last_used, slot) order into fill_slot[0 .. q)
    taken = tl.zeros([], tl.int32)
    thr = tl.full([], -1, tl.int64)
    for _ in range(0, q):  # every pass accepts at least one victim
        if taken < q:
            cand = gmin < tl.min(gsec)  # [G] group minima that are the next smallest keys overall
            take = tl.minimum(tl.sum(cand.to(tl.int32)), q - taken)
            rk = tl.sum((cand[None, :] & (gmin[None, :] < gmin[:, None])).to(tl.int32), axis=1)  # [G]
            acc = cand & (rk < take)
            tl.store(fill_slot_ptr + taken + rk, gmin % S, mask=acc)
            thr = tl.maximum(thr, tl.max(tl.where(acc, gmin, -1)))
            taken += take
            if taken < q:
                gmin, gsec, n_evict, n_free = _group_minima(last_used_ptr, pinned_ptr, S, slot_lo, slot_hi, thr,
                                                            BLOCK_R, G)
    tl.debug_barrier()

    # 6. table updates: evict the victims' owners, admit the fills, refresh recency; per-route slots
    #    (a fill's slot is its victim). Tiles touch disjoint victims, so only a tile's own lanes race.
    for i0 in range(0, P, BLOCK_P):
        r = i0 + lane
        valid = r < P
        fl = r < q
        vic = tl.load(fill_slot_ptr + r, mask=fl, other=0)  # [BP] i-th victim
        ffid = tl.load(fill_fid_ptr + r, mask=fl, other=0)  # [BP] i-th fill
        old = tl.load(owner_of_ptr + vic, mask=fl, other=-1)
        slot = tl.load(slot_ptr + r, mask=valid, other=-1).to(tl.int64)
        hit = valid & (slot >= 0)
        flags = tl.load(flags_ptr + r, mask=valid, other=0)
        rank = tl.load(rank_ptr + r, mask=valid, other=0)
        is_fill = ((flags & 2) != 0) & (rank < q)
        vslot = tl.load(fill_slot_ptr + rank, mask=is_fill, other=-1)
        tl.debug_barrier()  # every (replicated) lane has read the old owners before they are overwritten
        tl.store(slot_of_ptr + old, -1, mask=fl & (old >= 0))
        tl.store(slot_of_ptr + ffid, vic, mask=fl)
        tl.store(owner_of_ptr + vic, ffid, mask=fl)
        tl.store(last_used_ptr + vic, clock, mask=fl)
        tl.store(last_used_ptr + slot, clock, mask=hit)
        tl.store(slot_tk_ptr + r, tl.where(hit, slot, vslot).to(tl.int32), mask=valid)
        if REUSE:  # the victims' old ghosts are forgotten, their owners become the fills' ghosts
            g = tl.load(slot_ghost_ptr + vic, mask=fl, other=-1)  # [BP]
            g_at = tl.load(ghost_slot_ptr + g, mask=fl & (g >= 0), other=-1)
            tl.debug_barrier()
            tl.store(ghost_slot_ptr + g, -1, mask=fl & (g >= 0) & (g_at == vic))
            tl.debug_barrier()
            tl.store(ghost_slot_ptr + old, vic, mask=fl & (old >= 0))
            tl.store(slot_ghost_ptr + vic, old, mask=fl)
            if COUNT:
                tl.atomic_add(reuse_ptr + moe_layer * 2 + 1, tl.sum((fl & (old >= 0)).to(tl.int64)))
    tl.debug_barrier()  # the fill list's first q entries are read (vslot) before the rest is cleared
    for i0 in range(0, P, BLOCK_P):
        r = i0 + lane
        clear = (r < P) & (r >= q)
        tl.store(fill_fid_ptr + r, -1, mask=clear)
        tl.store(fill_slot_ptr + r, -1, mask=clear)

    n_fill = q
    n_cpu = m - q
    tl.store(meta_ptr, n_hits)
    tl.store(meta_ptr + 1, m)
    tl.store(meta_ptr + 2, n_fill)
    tl.store(meta_ptr + 3, n_cpu)
    tl.atomic_add(counters_ptr, n_hits.to(tl.int64))
    tl.atomic_add(counters_ptr + 1, m.to(tl.int64))
    tl.atomic_add(counters_ptr + 2, n_fill.to(tl.int64))
    tl.atomic_add(counters_ptr + 3, n_cpu.to(tl.int64))

    # CPU work: experts ascending by flat id, routes grouped by expert in row-major (token) order (no
    #    passes when every miss fills: the offsets are all zero)
    n_cpu_routes = tl.zeros([], tl.int64)
    cpu_p = tl.where(n_cpu > 0, P, 0)
    for i0 in range(0, cpu_p, BLOCK_P):
        r = i0 + lane
        valid = r < P
        fid = tl.load(topk_ids_ptr + r, mask=valid, other=0) + layer_offset
        flags = tl.load(flags_ptr + r, mask=valid, other=0)
        is_cpu = (flags & 4) != 0
        cpu_first = is_cpu & ((flags & 1) != 0)
        eo = tl.zeros([BLOCK_P], tl.int32)  # CPU-expert ordinal
        base = tl.zeros([BLOCK_P], tl.int32)  # CPU routes of smaller ids
        for j0 in range(0, P, BLOCK_P):
            c = j0 + lane
            fc = tl.load(topk_ids_ptr + c, mask=c < P, other=0) + layer_offset
            fcl = tl.load(flags_ptr + c, mask=c < P, other=0)
            smaller = fc[None, :] < fid[:, None]
            eo += tl.sum((((fcl[None, :] & 5) == 5) & smaller).to(tl.int32), axis=1)
            base += tl.sum((((fcl[None, :] & 4) != 0) & smaller).to(tl.int32), axis=1)
        pos = base + tl.load(within_ptr + r, mask=valid, other=0)
        wt = tl.load(topk_w_ptr + r, mask=valid, other=0.0).to(tl.float32)  # [BP]
        tl.store(cpu_fids_ptr + eo, fid, mask=cpu_first)
        tl.store(cpu_tok_ptr + pos, (r // K).to(tl.int64), mask=is_cpu)
        tl.store(cpu_wt_ptr + pos, wt, mask=is_cpu)
        tl.store(eo_ptr + r, eo, mask=valid)
        n_cpu_routes += tl.sum(is_cpu.to(tl.int64))
    tl.debug_barrier()
    for i0 in range(0, P, BLOCK_P):
        r = i0 + lane
        off = tl.zeros([BLOCK_P], tl.int64)  # offsets[e], e = r
        for j0 in range(0, cpu_p, BLOCK_P):
            c = j0 + lane
            is_cpu = (tl.load(flags_ptr + c, mask=c < P, other=0) & 4) != 0
            eo = tl.load(eo_ptr + c, mask=c < P, other=0)
            off += tl.sum((is_cpu[None, :] & (eo[None, :] < r[:, None])).to(tl.int64), axis=1)
        tl.store(cpu_offsets_ptr + r, off, mask=r < P)
    tl.store(cpu_offsets_ptr + P, n_cpu_routes)
    tl.store(cpu_dims_ptr, T)
    tl.store(cpu_dims_ptr + 1, n_cpu.to(tl.int64))


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, min_numel: int) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.numel() < min_numel:
        raise ValueError(f"{name} must be a contiguous {dtype} tensor of at least {min_numel} elements, got "
                         f"{t.dtype} {tuple(t.shape)}")


def route_control(topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer_offset: int,
                  slot_of: torch.Tensor, owner_of: torch.Tensor, last_used: torch.Tensor, pinned: torch.Tensor,
                  clock: torch.Tensor, policy: torch.Tensor, counters: torch.Tensor, out: RouteOutputs,
                  groups: int = GROUPS, *, fill_table: torch.Tensor | None = None, moe_layer: int = 0,
                  reuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, num_experts: int = 1,
                  slots: tuple[int, int] | None = None, count_reuse: bool = True) -> None:
    """Plan one MoE layer's decode step on the device and update the expert cache's tables in place.

    Equal, tables included, to ``plan_step(cache, policy, tokens_per_expert, Phase.DECODE, clock)``
    (:mod:`edgemoe.experts.hybrid`) with ``tokens_per_expert`` counted over ``topk_ids``. One
    single-program launch for any ``T·k`` (the pairwise passes loop over tiles of routes); no host
    synchronization, no allocation: CUDA-graph capturable.

    Args:
        topk_ids: ``[T, k]`` int64 expert index within the layer (contiguous).
        topk_weights: ``[T, k]`` router weights (float32/bfloat16/float16, contiguous).
        layer_offset: ``moe_layer · E`` (the flat id of the layer's expert 0).
        slot_of: ``[N]`` int64 residency table (-1: not resident). owner_of: ``[S]`` int64 (-1: free).
        last_used: ``[S]`` int64 LRU clock per slot (-1: never used). pinned: ``[S]`` bool (or int8).
        clock: ``[1]`` int64, the current model step (advanced by the caller once per step).
        policy: ``[3]`` float64 ``(num, den, q_min)``: ``q = clamp(floor(m·num/den + 0.5),
            min(q_min, m), m)`` (``torch.tensor(policy.fill_rule(), dtype=torch.float64)``).
        counters: ``[4]`` int64, atomically incremented by ``(hits, misses, fills, cpu)``.
        out: the output buffers (:class:`RouteOutputs`, capacity ``>= T·k``).
        groups: slot groups of the victim search (a power of two; more groups accept more victims
            per pass over the table; 1 makes it one arg-min pass per victim). Results do not depend on it.
        fill_table: ``[L, M + 1]`` int32, a per-layer policy's ``q`` for ``m = 0 .. M`` misses (row
            ``moe_layer``; ``m > M`` reads column ``M``); replaces ``policy`` when given.
        moe_layer: MoE layer ordinal (``layer_offset / num_experts``): the table row and reuse row.
        reuse: ``(ghost_slot [N] int64, slot_ghost [S] int64, reuse [L, 2] int64)`` (the cache's
            reuse tables, see the module docstring), updated in place; ``None``: no reuse accounting.
        num_experts: ``E``, experts per MoE layer (the layer of a flat id), with ``reuse``.
        slots: ``(lo, hi)``: victims only among slots ``lo .. hi - 1`` (the layer's partition of a
            per-layer LRU, :meth:`edgemoe.experts.cache.ExpertCache.victim_range`); ``None``: all ``S``.
        count_reuse: with ``reuse``, also count (``reuse[moe_layer]`` and the charges of ghosts); ``False``
            keeps the pairs of ghosts and fills up to date without counting, as the cache's ``admit`` does
            for fills outside a decode step's control (next-layer prefetch).

    Raises:
        ValueError: a shape, dtype or capacity mismatch, an empty step, or an empty cache (``S = 0``:
            every miss runs on the CPU; do not launch).
    """
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int64 or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be a contiguous [T, k] int64 tensor, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    T, k = topk_ids.shape
    P = T * k
    if P < 1:
        raise ValueError(f"route_control needs at least one route, got T·k = {P}")
    if tuple(topk_weights.shape) != (T, k) or not topk_weights.is_contiguous() or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a contiguous float [T, k] = [{T}, {k}] tensor, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    S = owner_of.numel()
    if S == 0:
        raise ValueError("route_control needs at least one cache slot")
    if pinned.dtype == torch.bool:
        pinned = pinned.view(torch.int8)
    for name, t, dtype, n in (("slot_of", slot_of, torch.int64, 1), ("owner_of", owner_of, torch.int64, S),
                              ("last_used", last_used, torch.int64, S), ("pinned", pinned, torch.int8, S),
                              ("clock", clock, torch.int64, 1), ("policy", policy, torch.float64, 3),
                              ("counters", counters, torch.int64, 4), ("slot_tk", out.slot_tk, torch.int32, P),
                              ("fill_fid", out.fill_fid, torch.int64, P), ("fill_slot", out.fill_slot, torch.int64, P),
                              ("meta", out.meta, torch.int32, 4), ("cpu_dims", out.cpu_dims, torch.int64, 2),
                              ("cpu_fids", out.cpu_fids, torch.int64, P),
                              ("cpu_offsets", out.cpu_offsets, torch.int64, P + 1),
                              ("cpu_tok", out.cpu_tok, torch.int64, P), ("cpu_wt", out.cpu_wt, torch.float32, P),
                              ("scratch", out.scratch, torch.int32, SCRATCH_ROWS * P)):
        _check(name, t, dtype, n)
    if fill_table is not None:
        if fill_table.dim() != 2 or fill_table.dtype != torch.int32 or not fill_table.is_contiguous() \
                or not 0 <= moe_layer < fill_table.shape[0]:
            raise ValueError(f"fill_table must be a contiguous [L, M + 1] int32 tensor with row {moe_layer}, got "
                             f"{fill_table.dtype} {tuple(fill_table.shape)}")
    if reuse is not None:
        ghost_slot, slot_ghost, counts = reuse
        _check("ghost_slot", ghost_slot, torch.int64, slot_of.numel())
        _check("slot_ghost", slot_ghost, torch.int64, S)
        _check("reuse", counts, torch.int64, 2 * (moe_layer + 1))
        if num_experts < 1:
            raise ValueError("reuse accounting needs num_experts >= 1")
    lo, hi = (0, S) if slots is None else (int(slots[0]), int(slots[1]))
    if not 0 <= lo <= hi <= S:
        raise ValueError(f"slots must be a range within 0..{S}, got {slots}")
    if out.scratch.dim() != 2 or out.scratch.shape[0] != SCRATCH_ROWS or out.scratch.shape[1] < P:
        raise ValueError(f"scratch must be [{SCRATCH_ROWS}, >= {P}] int32, got {tuple(out.scratch.shape)}")
    if last_used.numel() != S or pinned.numel() != S:
        raise ValueError(f"owner_of, last_used and pinned must all have S = {S} entries")
    block_p = max(16, triton.next_power_of_2(min(P, TILE)))
    if groups < 1 or groups & (groups - 1):
        raise ValueError(f"groups must be a power of two, got {groups}")
    # one CTA of 16 warps: a pass over the slot table loads 4096 slots (8 per thread) per iteration, 2048
    # when the [tile, tile] route comparisons take the registers (sm_90 compile at P = 128: 128 registers,
    # spills < 50 B)
    block_s = 4096 if block_p <= 32 else 2048
    block_r = max(1, min(triton.next_power_of_2(max(1, hi - lo)), block_s) // groups)
    _route_control_kernel[(1,)](
        topk_ids, topk_weights, int(layer_offset), P, k, T,
        slot_of, owner_of, last_used, pinned, clock, policy, counters, S,
        out.slot_tk, out.fill_fid, out.fill_slot, out.meta,
        out.cpu_dims, out.cpu_fids, out.cpu_offsets, out.cpu_tok, out.cpu_wt, out.scratch, out.scratch.shape[1],
        policy if fill_table is None else fill_table, 1 if fill_table is None else fill_table.shape[1], int(moe_layer),
        *(reuse if reuse is not None else (slot_of, owner_of, counters)), int(num_experts), lo, hi,
        BLOCK_P=block_p, BLOCK_R=block_r, G=groups, TABLE=fill_table is not None, REUSE=reuse is not None,
        COUNT=reuse is not None and bool(count_reuse),
        num_warps=16)
