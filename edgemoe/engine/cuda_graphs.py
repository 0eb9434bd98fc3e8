"""Decode steps on the device path: fixed-shape static inputs and the CUDA graphs replayed over them.

:class:`DecodeGraphs` owns one graph per padded batch size (1, 2, 4, 8, 16, 32, 64 up to
``max_num_seqs``, and ``max_num_seqs``; a smaller batch pads up), captured right after the first
eager step of that size (which also compiles the Triton kernels and warms cuBLAS), and the static
inputs (:class:`DecodeInputs`) every graph
reads. A batch size whose capture fails runs eagerly from then on. :meth:`DecodeGraphs.invalidate`
drops every graph (the expert cache was rebuilt: its tensors moved).

Python's cyclic garbage collector is kept off during each capture: a collection that starts inside the
capture would run the finalizers of dead objects there, and those of a released host pool or embedding table
call ``cudaHostUnregister``, which CUDA forbids while a stream is capturing (the capture fails, the error
unreported until the next launch: "operation failed due to a previous error during capture"). The garbage
waits for the next collection after the capture; none is forced (a full collection of an engine process took
160 ms on a 2-core VM, and a resize of the expert cache captures anew). ``torch.cuda.graph`` itself no longer
collects (``torch.compiler.config.force_cudagraph_gc``).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from edgemoe.core import DecodeMeta, ForwardBatch, Phase, SeqSlice, StepInput
from edgemoe.kvcache.pool import PagedKVPool
from edgemoe.kvcache.state import RecurrentStatePool

log = logging.getLogger(__name__)


def _round8(n: int) -> int:
    return -(-n // 8) * 8

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # decode batch sizes with a captured CUDA graph (smaller ones pad up)
SCRATCH_SEQ = -1  # owner id of the padding rows' scratch KV page and recurrent-state slot


class DecodeInputs:
    """Static (fixed-address) inputs of device-path decode steps, for batch sizes up to ``max_bs``.

    A step of ``B`` sequences padded to ``bs`` rows fills rows ``[0, bs)``; padding rows decode token 0
    at position 0 into a scratch KV page no sequence owns (``SCRATCH_SEQ``'s, reserved by the runner),
    attend to one key, and route like row 0 with weight 0 (``ForwardBatch.decode.valid``), so they
    change nothing a real row reads.

    Args:
        kv: the KV pool (``SCRATCH_SEQ`` holds its scratch page).
        state: the recurrent-state pool (``SCRATCH_SEQ`` holds its scratch slot), or ``None``.
        num_heads, head_dim: query heads and head size (the paged decode kernel's scratch; for a latent KV
            pool the scratch holds ``num_heads`` outputs of the pool's ``value_dim``).
        max_model_len: longest sequence (pages per block-table row).
        max_bs: largest batch.
        device: the CUDA device.
    """

    def __init__(self, kv: PagedKVPool, state: RecurrentStatePool | None, num_heads: int, head_dim: int,
                 max_model_len: int, max_bs: int, device: torch.device):
        from edgemoe.kernels.decode_attention import LATENT_PARTITION, make_decode_scratch

        self.kv, self.device, self.max_bs = kv, device, max_bs
        self.max_pages = -(-max_model_len // kv.page_size)
        self.scratch_page = kv.pages_of(SCRATCH_SEQ)[0]
        # Host staging and device inputs share one byte layout, so a step moves its inputs in one transfer:
        # int64 rows (token ids, positions, KV slots, state slots) x max_bs | context lengths int32 |
        # valid flags | block tables int32 [max_bs, max_pages] last (a step copies up to its bs-th row).
        n64, n_lens, n_valid = 4 * max_bs * 8, _round8(4 * max_bs), _round8(max_bs)
        self._tables_at, self._row_bytes = n64 + n_lens + n_valid, 4 * self.max_pages
        total = self._tables_at + max_bs * self._row_bytes
        pin = device.type == "cuda"
        self._h = torch.zeros(total, dtype=torch.uint8, pin_memory=pin)
        self._d = torch.zeros(total, dtype=torch.uint8, device=device)
        self._copied = torch.cuda.Event() if pin else None  # the last transfer out of the staging buffer

        def views(buf: torch.Tensor):
            rows = buf[:n64].view(torch.int64).view(4, max_bs)
            lens = buf[n64:n64 + 4 * max_bs].view(torch.int32)
            valid = buf[n64 + n_lens:n64 + n_lens + max_bs].view(torch.bool)
            tables = buf[self._tables_at:].view(torch.int32).view(max_bs, self.max_pages)
            return rows, lens, valid, tables

        self._h_i64, self._h_lens, self._h_valid, self._h_tables = views(self._h)
        rows, self.context_lens, self.valid, self.block_tables = views(self._d)
        self.input_ids, self.positions, self.kv_slots = rows[0], rows[1], rows[2]
        self.state_slots = None if state is None else rows[3]
        self.context_lens.fill_(1)
        self._h_lens.fill_(1)  # rows past a step's bs keep length 1, as the device copy starts
        self.logits_index = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.scratch_state = None if state is None else state.slot(SCRATCH_SEQ)
        if kv.spec.is_latent:
            self.attn_scratch = make_decode_scratch(max_bs, num_heads, kv.spec.value_dim, max_model_len, device,
                                                    partition_size=LATENT_PARTITION)
        else:
            self.attn_scratch = make_decode_scratch(max_bs, num_heads, head_dim, max_model_len, device)

    def load(self, inputs: list[StepInput], state_slots: list[int | None], bs: int, step: int,
             record) -> ForwardBatch:
        """Write ``inputs`` (one token each; their KV pages and state slots already allocated) into rows
        ``[0, bs)`` and return the step's batch over the static tensors."""
        kv, ps = self.kv, self.kv.page_size
        if self._copied is not None:  # the previous step's transfer has read the staging buffer
            self._copied.synchronize()
        h = self._h_i64
        h[:, :bs] = 0
        h[2, :bs] = self.scratch_page * ps
        if self.state_slots is not None:
            h[3, :bs] = self.scratch_state
        self._h_tables[:bs] = self.scratch_page
        self._h_lens[:bs] = 1
        self._h_valid[:bs] = False
        seqs = []
        for row, inp in enumerate(inputs):
            pos = inp.start_pos
            pages = kv.pages_of(inp.seq_id)
            h[0, row], h[1, row] = inp.token_ids[0], pos
            h[2, row] = pages[pos // ps] * ps + pos % ps
            if self.state_slots is not None:
                h[3, row] = state_slots[row]
            self._h_tables[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self._h_lens[row] = pos + 1
            self._h_valid[row] = True
            seqs.append(SeqSlice(inp.seq_id, row, 1, pos + 1, None, state_slots[row]))
        end = self._tables_at + bs * self._row_bytes
        self._d[:end].copy_(self._h[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        return ForwardBatch(
            phase=Phase.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            kv_slots=self.kv_slots[:bs], seqs=seqs, logits_index=self.logits_index[:bs], step=step,
            record=record,
            decode=DecodeMeta(self.block_tables[:bs], self.context_lens[:bs], self.valid[:bs], self.attn_scratch),
            state_slots=None if self.state_slots is None else self.state_slots[:bs],
        )


class DecodeGraphs:
    """Runs device-path decode steps: replayed from a CUDA graph of the padded batch size when one is
    captured, else eagerly (then captured when graphs are on).

    Args:
        inputs: the static inputs (one set serves every batch size).
        device: the compute device.
    """

    def __init__(self, inputs: DecodeInputs, device: torch.device):
        self.inputs, self.device = inputs, device
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (batch size, armed)
        self.failed: set[int] = set()  # batch sizes whose capture failed: they run eagerly
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def captured_sizes(self) -> set[int]:
        """Batch sizes with a captured graph (with or without the CPU branch)."""
        return {bs for bs, _ in self.graphs}

    def invalidate(self) -> None:
        """Drop every captured graph (and their memory pool); the next step of each size captures anew."""
        self.graphs.clear()
        self.failed.clear()
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    def run(self, model: torch.nn.Module, inputs: list[StepInput], state_slots: list[int | None], step: int,
            record, use_graphs: bool, armed: bool = False,
            arming: Callable[[bool], AbstractContextManager] | None = None) -> torch.Tensor:
        """One decode step of ``inputs``: ``[B, vocab]`` float32 logits.

        Args:
            model: the model (its forward over the static batch).
            inputs: one token per sequence, KV pages and state slots allocated.
            state_slots: each sequence's recurrent-state slot (``None`` entries without state).
            step: the model step (LRU clock).
            record: the routing recorder callback, or ``None`` (a recording step is never captured).
            use_graphs: replay / capture CUDA graphs (the decode path allows it).
            armed: whether the step enqueues the CPU branch (``DeviceDecode.armed``): a step with and one
                without it are different graphs, each captured at its first use.
            arming: for a policy that may arm and drop the CPU branch between steps, a context in which
                the model's step is enqueued with (``True``) or without it (``DeviceDecode.arming``): the
                first step of a batch size then runs armed (compiling the branch's kernels; while the rule
                fills every miss the branch has no work, and the output is the same) and both variants are
                captured after it, so a later switch replays a graph instead of running a step eagerly and
                capturing it in the middle of decoding.
        """
        B, d = len(inputs), self.inputs
        sizes = sorted(b for b in {*GRAPH_BATCH_SIZES, d.max_bs} if B <= b <= d.max_bs and b not in self.failed)
        use_graphs = use_graphs and record is None and bool(sizes)
        bs = sizes[0] if use_graphs else B
        batch = d.load(inputs, state_slots, bs, step, record)
        key = (bs, bool(armed))
        if use_graphs and key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
            return logits[:B].clone()
        both = use_graphs and arming is not None
        with arming(True) if both else nullcontext():
            logits = model(batch)  # eager (and the warm-up of a capture: Triton compiles here)
        if use_graphs:
            try:
                if not both:
                    self._capture(model, key, batch)
                for state in (True, False) if both else ():
                    if (bs, state) not in self.graphs:
                        with arming(state):
                            self._capture(model, (bs, state), batch)
            except Exception:
                log.exception("capturing the decode step for batch size %d failed; it runs eagerly from now on", bs)
                self.failed.add(bs)
                torch.cuda.synchronize(self.device)
        return logits[:B]

    def _capture(self, model: torch.nn.Module, key: tuple[int, bool], batch: ForwardBatch) -> None:
        """Capture the decode step ``key = (batch size, armed)`` over the static inputs (no kernel runs)."""
        graph = torch.cuda.CUDAGraph()
        batch.step_cache.clear()  # tensors derived during the eager step must be recomputed inside the graph
        torch.cuda.synchronize(self.device)
        collecting = gc.isenabled()
        gc.disable()  # no finalizer of dead objects runs inside the capture (module docstring)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = model(batch)
        finally:
            if collecting:
                gc.enable()
        self.graphs[key] = (graph, logits)
        log.info("captured the decode step for batch size %d%s", key[0], " with the CPU branch" if key[1] else "")
