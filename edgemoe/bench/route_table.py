"""The next rows of a routing table at a device-side counter, in one launch (the benchmarks' routing).

The decode benchmarks replace each MoE layer's choice of experts by rows of a table (uniform draws, or a
recorded trace) read at a counter that lives on the device, so that a step replayed from a CUDA graph reads
new rows every time. As torch ops (``arange``, ``add``, ``remainder``, ``index_select``, ``add_``) that read was
five kernels per MoE layer, and a ``topk`` over random scores two more: on an H100 host 16 µs of kernel time a
layer besides the gaps between them (0.77 ms of a 48-layer decode step), which a model's own routing does not
have. :func:`table_rows` does it in one Triton program.
"""

from __future__ import annotations

import os

import torch

try:  # an optional dependency: without it (or without CUDA) the torch ops run
    import triton
    import triton.language as tl
except ImportError:
    triton = None

MAX_TOKENS = 64  # one program copies every row; a longer step (a prefill) uses the torch ops
# read by triton.jit below (as Triton reads it): CPU tensors then run too
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

if triton is not None:

    @triton.jit
    def _table_rows_kernel(table_ptr, counter_ptr, out_ptr, T, R, K: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        c = tl.load(counter_ptr)
        t = tl.arange(0, BLOCK_T)
        j = tl.arange(0, BLOCK_K)
        mask = (t[:, None] < T) & (j[None, :] < K)
        row = (c + t) % R
        ids = tl.load(table_ptr + row[:, None] * K + j[None, :], mask=mask)
        tl.store(out_ptr + t[:, None] * K + j[None, :], ids, mask=mask)
        tl.debug_barrier()  # every thread has read the counter before it moves
        tl.store(counter_ptr, c + T)


def table_rows(table: torch.Tensor, counter: torch.Tensor, T: int) -> torch.Tensor:
    """``table[(c + t) % R]`` for ``t < T`` and ``c`` the counter's value, then the counter advanced by ``T``.

    Args:
        table: ``[R, k]`` contiguous (int64 expert ids), on the counter's device.
        counter: ``[1]`` int64 (a view into a larger tensor is fine), read and written on the device.
        T: rows to read (tokens of the step).

    Returns:
        ``[T, k]``, ``table``'s dtype. One Triton launch for ``T <= MAX_TOKENS`` on CUDA tensors (or in
        Triton's interpreter, ``TRITON_INTERPRET=1``) where Triton is installed, the torch ops otherwise; both
        give the same rows.

    Raises:
        ValueError: ``table`` not ``[R, k]`` contiguous, or ``counter`` not one int64 element.
    """
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous [R, k] tensor, got shape {tuple(table.shape)}")
    if counter.numel() != 1 or counter.dtype != torch.int64:
        raise ValueError(f"counter must be one int64 element, got {counter.numel()} of {counter.dtype}")
    R, k = table.shape
    if triton is not None and 0 < T <= MAX_TOKENS and (table.is_cuda or _INTERPRETED):
        out = torch.empty(T, k, dtype=table.dtype, device=table.device)
        _table_rows_kernel[(1,)](table, counter, out, T, R, K=k, BLOCK_T=triton.next_power_of_2(T),
                                 BLOCK_K=triton.next_power_of_2(k))
        return out
    idx = (counter + torch.arange(T, device=table.device)) % R  # [T]
    counter.add_(T)
    return table.index_select(0, idx)
