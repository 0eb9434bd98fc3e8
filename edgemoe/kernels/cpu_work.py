"""One decode step's CPU work in the native executor's registered-step layout.

``route_control`` writes a step's CPU work into device buffers with this layout and the native
executor's ``RegisteredStep`` reads it from pinned host buffers with the same layout, so a step's
whole work list crosses PCIe in one copy. Plain torch (no Triton), so the executor can import it.
"""

from __future__ import annotations

import torch


def cpu_work_words(max_experts: int, max_routes: int) -> int:
    """int64 words of one step's packed CPU work (see :func:`carve_cpu_work`)."""
    return 2 + max_experts + (max_experts + 1) + max_routes + (max_routes + 1) // 2


def carve_cpu_work(pack: torch.Tensor, max_experts: int, max_routes: int) -> tuple[torch.Tensor, ...]:
    """Views ``(dims, fids, offsets, tok, wt)`` of one step's CPU work inside one int64 buffer.

    ``pack`` is ``[cpu_work_words(E, R)]`` int64 (device or host): dims ``[2]`` int64, fids ``[E]``
    int64, offsets ``[E + 1]`` int64, tok ``[R]`` int64, then wt ``[R]`` float32 in the remaining
    words. One layout for the device producer (``route_control``'s outputs) and the registered
    host step, so a whole step's work crosses PCIe in one copy.

    Raises:
        ValueError: ``pack`` is not a contiguous int64 buffer of that size.
    """
    E, R = int(max_experts), int(max_routes)
    if pack.dtype != torch.int64 or pack.dim() != 1 or pack.numel() != cpu_work_words(E, R) or not pack.is_contiguous():
        raise ValueError(f"pack must be a contiguous [{cpu_work_words(E, R)}] int64 buffer, got {pack.dtype} "
                         f"{tuple(pack.shape)}")
    a = 2 + E + E + 1 + R
    dims, fids, offsets, tok = pack[:2], pack[2:2 + E], pack[2 + E:3 + 2 * E], pack[3 + 2 * E:a]
    return dims, fids, offsets, tok, pack[a:].view(torch.float32)[:R]
