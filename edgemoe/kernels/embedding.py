"""A step's token-embedding rows gathered from a page-locked host table, zero-copy over PCIe.

One launch copies ``out[t] = table[ids[t]]`` for every token ``t`` of a step, reading the table at its
mapped host address: the technique of :mod:`.gather` (a table registered with ``cudaHostRegister`` is
read under UVA through the address the launcher translates), so the ``[V, H]`` table needs no device
memory and the host learns nothing of the ids. The grid is ``(T, chunks per row)``, fixed by the shapes:
the launch can be captured in a CUDA graph. Rows are copied as the widest words (8, 4, 2 or 1 bytes)
that divide a row and both base addresses: a plain byte copy, so the rows are bit-identical to
``table.index_select(0, ids)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_WORDS = 1024  # 8 KiB per program with 8-byte words
NUM_WARPS = 4


@triton.jit
def _gather_rows_kernel(ids_ptr, ids_stride, src_ptr, dst_ptr, V, ROW, BLOCK: tl.constexpr):
    """Program ``(t, c)``: chunk ``c`` of row ``ids[t]`` of ``src`` into row ``t`` of ``dst`` (zeros for an
    id outside ``[0, V)``: nothing outside the table is read)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    row = tl.load(ids_ptr + t * ids_stride).to(tl.int64)
    limit = tl.where((row >= 0) & (row < V), ROW, 0)  # the words to read: none for an id outside the table
    col = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + row * ROW + col, mask=col < limit, other=0)
    tl.store(dst_ptr + t * ROW + col, x, mask=col < ROW)


def _word_views(table: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``table [V, H]`` and ``out [T, H]`` as ``[rows, words]`` views in the widest integer word that divides a
    row's bytes and both base addresses."""
    row_bytes = table.shape[1] * table.element_size()
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0 and table.data_ptr() % size == 0 and out.data_ptr() % size == 0:
            break
    as_bytes = (table.view(torch.uint8), out.view(torch.uint8))
    return tuple(t.view(t.shape[0], -1).view(word) for t in as_bytes)


def gather_rows(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy the rows ``out[t] = table[ids[t]]`` for ``t < T`` in one launch; returns ``out``.

    Args:
        ids: ``[T]`` int64 or int32 token ids on the compute device, any stride (read by the kernel, never by
            the host). An id outside ``[0, V)`` gives a zero row (nothing outside the table is read; the
            engine checks prompt ids at admission, so none reaches here).
        table: ``[V, H]`` contiguous embedding table of any dtype: page-locked host memory
            (``cudaHostRegister``, e.g. :meth:`~edgemoe.layers.embedding.HostEmbedding.pin`) or a device
            tensor; under ``TRITON_INTERPRET=1`` plain CPU tensors.
        out: ``[T, H]`` contiguous tensor of ``table``'s dtype on the compute device.

    Raises:
        ValueError: ids that are not a 1-D integer tensor, or a table and ``out`` that are not contiguous
            2-D tensors of one dtype and row width with ``T`` rows in ``out``.

    A pageable (unregistered) host table is refused by Triton's launcher ("cannot be accessed from
    Triton"). ``T = 0`` launches nothing.
    """
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"ids must be a 1-D int64 or int32 tensor, got {ids.dtype} {tuple(ids.shape)}")
    for name, t in (("table", table), ("out", out)):
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 2-D tensor, got {tuple(t.shape)}")
    if table.dtype != out.dtype or table.shape[1] != out.shape[1] or out.shape[0] != ids.shape[0]:
        raise ValueError(f"out {out.dtype} {tuple(out.shape)} does not fit {ids.shape[0]} rows of the table "
                         f"{table.dtype} {tuple(table.shape)}")
    if ids.shape[0] == 0:
        return out
    src, dst = _word_views(table, out)
    words = src.shape[1]
    block = min(MAX_BLOCK_WORDS, triton.next_power_of_2(words))
    grid = (ids.shape[0], triton.cdiv(words, block))
    _gather_rows_kernel[grid](ids, ids.stride(0), src, dst, table.shape[0], words, BLOCK=block, num_warps=NUM_WARPS)
    return out
