"""Fused host→device gather of one MoE layer's fills.

One launch copies, for every fill ``i < n_fill`` (``n_fill = meta[2]``, read on the device), row
``fill_fid[i]`` of the host expert pool's byte bank into row ``fill_slot[i]`` of the device cache's
bank: one packed row per expert, whatever its format (bf16, FP8, MXFP4, NVFP4 rows alike). The host
bank is page-locked (``cudaHostRegister``) and read zero-copy through its mapped address (under UVA
the launcher translates a registered host pointer; the H200 host reached 51 GB/s this way), so the
copy needs no per-row ``cudaMemcpyAsync`` and no host knowledge of ``n_fill``: it can be captured in
a CUDA graph right after :func:`~edgemoe.kernels.route_control`.

Rows are copied as 8-byte words (16-byte vector loads per thread pair) in chunks of ``BLOCK`` words;
a persistent grid of programs strides over the ``n_fill × chunks`` work items.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 2048  # 16 KiB per work item
NUM_WARPS = 8


@triton.jit
def _copy_rows(src_ptr, dst_ptr, fill_fid_ptr, fill_slot_ptr, n_fill, ROW, pid, NPROG, BLOCK: tl.constexpr):
    """Copy chunk ``c`` of row ``fill_fid[i]`` to row ``fill_slot[i]`` for work items ``i·chunks + c``."""
    chunks = tl.cdiv(ROW, BLOCK)
    offs = tl.arange(0, BLOCK)
    for item in range(pid, n_fill * chunks, NPROG):
        i = item // chunks
        c = item - i * chunks
        fid = tl.load(fill_fid_ptr + i)
        slot = tl.load(fill_slot_ptr + i)
        col = c * BLOCK + offs
        mask = col < ROW
        x = tl.load(src_ptr + fid * ROW + col, mask=mask)
        tl.store(dst_ptr + slot * ROW + col, x, mask=mask)


@triton.jit
def _gather_fills_kernel(meta_ptr, fill_fid_ptr, fill_slot_ptr, src_ptr, dst_ptr, ROW, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_fill = tl.load(meta_ptr + 2)
    _copy_rows(src_ptr, dst_ptr, fill_fid_ptr, fill_slot_ptr, n_fill, ROW, pid, nprog, BLOCK)


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two contiguous uint8 ``[rows, row_bytes]`` banks as ``[rows, words]`` views, in the widest word that
    divides a row and both base addresses."""
    for t in (src, dst):
        if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"expert banks must be contiguous uint8 [rows, row_bytes] tensors, got {t.dtype} "
                             f"{tuple(t.shape)}")
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"pool rows of {src.shape[1]} bytes and cache rows of {dst.shape[1]} bytes differ")
    row_bytes = src.shape[1]
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=word).element_size()
        if row_bytes % size == 0 and src.data_ptr() % size == 0 and dst.data_ptr() % size == 0:
            break
    return src.view(src.shape[0], -1).view(word), dst.view(dst.shape[0], -1).view(word)


def default_programs(device: torch.device) -> int:
    """Persistent grid size for :func:`gather_fills`: 4 programs per SM on CUDA, 4 elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def gather_fills(meta: torch.Tensor, fill_fid: torch.Tensor, fill_slot: torch.Tensor, src: torch.Tensor,
                 dst: torch.Tensor, num_programs: int | None = None, block_words: int = BLOCK_WORDS,
                 num_warps: int = NUM_WARPS) -> None:
    """Copy the fills of one layer's step: ``dst[fill_slot[i]] = src[fill_fid[i]]`` for ``i < meta[2]``.

    Args:
        meta: ``[4]`` int32 from :func:`~edgemoe.kernels.route_control.route_control` (``meta[2]`` =
            fills).
        fill_fid, fill_slot: ``[K]`` int64 source rows and destination slots (first ``meta[2]`` valid).
        src: the host pool's byte bank, uint8 ``[N, row_bytes]`` — page-locked (``HostExpertPool`` after
            ``pin()``) or a device tensor.
        dst: the cache's byte bank, uint8 ``[S, row_bytes]`` on the device.
        num_programs: persistent grid size (default :func:`default_programs`); fixed per device, so
            the launch is CUDA-graph capturable.
        block_words, num_warps: words of one work item (a power of two) and warps of one program
            (``benchmarks/fill_kernel.py`` sweeps them against the copy engine).

    Raises:
        ValueError: banks that are not contiguous uint8 ``[rows, row_bytes]`` of one row size, or a
            ``block_words`` that is not a power of two.

    A pageable (unregistered) host source is refused by Triton's launcher ("cannot be accessed from
    Triton"); copy such pools with ``cudaMemcpyAsync`` instead.
    """
    if meta.dtype != torch.int32 or meta.numel() < 4:
        raise ValueError("meta must be the [4] int32 output of route_control")
    if block_words <= 0 or block_words & (block_words - 1):
        raise ValueError(f"block_words must be a power of two, got {block_words}")
    if fill_fid.dtype != torch.int64 or fill_slot.dtype != torch.int64 or fill_fid.numel() != fill_slot.numel():
        raise ValueError("fill_fid and fill_slot must be int64 tensors of the same length")
    s, d = _words(src, dst)
    grid = (int(num_programs) if num_programs else default_programs(dst.device),)
    _gather_fills_kernel[grid](meta, fill_fid, fill_slot, s, d, s.shape[1], BLOCK=block_words, num_warps=num_warps)
