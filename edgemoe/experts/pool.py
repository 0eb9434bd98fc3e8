"""The host expert pool: every routed expert of the model, in host memory.

Experts are stored as one uint8 byte bank ``[N, row_bytes]`` indexed by the flat id
``moe_layer * E + expert``; an :class:`~edgemoe.quant.layout.ExpertLayout` says where each tensor of
an expert lives in its row, for every format (bf16 / float32 rows as well as FP8, MXFP4 and NVFP4 rows
at their packed size). Typed section views (``pool.view("w13")``) give ``w13 [N, 2I, H]`` (gate rows
then up rows) and ``w2 [N, H, I]`` for float layouts. Host memory is the source of truth; the device
expert cache only ever holds copies of rows.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from edgemoe.config import SILU_SWIGLU, ExpertActivation
from edgemoe.quant.layout import ExpertLayout
from edgemoe.quant.quantize import pack_float_expert
from edgemoe.quant.weights import WeightFormat

log = logging.getLogger(__name__)

_DATA_SECTIONS = ("w13", "w2", "b13", "b2")  # the sections of per-element values (the rest: block scales)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Uninitialized, page-aligned (4 KiB) host tensor backed by a private anonymous mapping.

    Page alignment lets direct I/O (``O_DIRECT``) read straight into the tensor (``torch.empty`` only
    guarantees 64 bytes). Pages are faulted in on first write, so filling then pinning touches each
    page once. The mapping lives as long as any tensor viewing it.

    ``huge_pages`` asks for transparent huge pages (``MADV_HUGEPAGE``, a hint). Off by default: with
    the common ``defrag=madvise`` setting a fault may compact memory synchronously; direct-I/O fills of
    such regions were erratic on a small VM and no faster on the H200 host (docs/benchmarks/bootstrap.md).
    """
    numel = math.prod(shape)
    elsize = torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, numel * elsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(mm, dtype=dtype, count=numel).view(shape)


class HostRegistration:
    """Bookkeeping of one host memory range page-locked with ``cudaHostRegister``.

    Holds the base address it registered, so that :meth:`unregister` undoes exactly that registration, once,
    and :meth:`register` while registered does nothing. The owner (:class:`HostExpertPool`,
    :class:`~edgemoe.layers.embedding.HostEmbedding`) decides when to register (after filling), checks that
    CUDA is available first, and reports a refusal.

    Attributes:
        address: the registered base address (``tensor.data_ptr()``), or ``None`` when nothing is registered.
    """

    def __init__(self) -> None:
        self.address: int | None = None

    @property
    def registered(self) -> bool:
        return self.address is not None

    def register(self, ptr: int, nbytes: int):
        """Page-lock ``nbytes`` bytes of host memory from address ``ptr`` (``cudaHostRegister``, default flags:
        under unified addressing the range is also mapped, readable by the GPU at the same address).

        Args:
            ptr: base address of the range (a host tensor's ``data_ptr()``).
            nbytes: length of the range in bytes.

        Returns:
            CUDA's status as ``torch.cuda.cudart()`` returns it: ``int(status) == 0`` when the range is now
            registered (``0`` when it already was, left as it is); otherwise nothing is recorded and the
            memory stays pageable (``RLIMIT_MEMLOCK``, not enough RAM, ...).

        Raises:
            Whatever ``torch.cuda.cudart()`` raises without a CUDA runtime (callers check
            ``torch.cuda.is_available()`` first). A refusal by CUDA is returned, not raised.
        """
        if self.address is not None:
            return 0
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) == 0:
            self.address = ptr
        return err

    def unregister(self) -> None:
        """Unregister the range (``cudaHostUnregister``; its status is not checked) before its memory is freed
        or replaced; nothing when not registered."""
        if self.address is not None:
            torch.cuda.cudart().cudaHostUnregister(self.address)
        self.address = None


def default_compute_dtype(layout: ExpertLayout) -> torch.dtype:
    """The dtype experts of ``layout`` compute in unless told otherwise: a float layout's own dtype, bfloat16
    for quantized layouts (their rows are dequantized into it, as ``transformers`` does)."""
    return layout.format.dtype if layout.format.dense else torch.bfloat16


class HostExpertPool:
    """Routed experts in host memory: one byte bank of packed rows.

    Args:
        num_ids: ``N = num_moe_layers * num_experts`` rows.
        layout: the byte layout of one row (format, ``H``, ``I``, sections).
        compute_dtype: the dtype the experts compute in: a float layout's own dtype (the default), or for a
            quantized layout the dtype its rows are dequantized into (default bfloat16).
        activation: the experts' activation (the model's ``ExpertActivation``: SiLU SwiGLU, or gpt-oss's
            clamped SwiGLU); ``activation.bias`` iff the layout has bias sections (``b13``, ``b2``).

    The bank is page-aligned (:func:`host_empty`) so the FTW bootstrap reads it with direct I/O.

    Attributes:
        bank: uint8 ``[N, row_bytes]``; row ``i`` holds expert ``i``'s sections at ``layout``'s offsets.
        layout: the :class:`~edgemoe.quant.layout.ExpertLayout`.
        hidden, intermediate: ``H`` and ``I``.
        activation: as given.
        pinned: whether the bank is page-locked (registered with CUDA) for async host→GPU copies.

    Raises:
        ValueError: a float layout with another ``compute_dtype`` (its rows are computed in place), or an
            activation with biases over a layout without bias sections (or the reverse).
    """

    def __init__(self, num_ids: int, layout: ExpertLayout, compute_dtype: torch.dtype | None = None,
                 activation: ExpertActivation = SILU_SWIGLU):
        if compute_dtype is None:
            compute_dtype = default_compute_dtype(layout)
        if layout.format.dense and compute_dtype != layout.format.dtype:
            raise ValueError(f"a {layout.format.value} expert pool computes in {layout.format.dtype}, "
                             f"not {compute_dtype}")
        if layout.has_bias != activation.bias:
            raise ValueError(f"expert layout has_bias={layout.has_bias} but the experts are {activation.describe()}")
        self.num_ids, self.layout, self.compute_dtype = num_ids, layout, compute_dtype
        self.activation = activation
        self.hidden, self.intermediate = layout.hidden, layout.intermediate
        self.bank = host_empty((num_ids, layout.row_bytes), torch.uint8)  # [N, row_bytes]
        self.pinned = False
        self._registration = HostRegistration()

    @classmethod
    def dense(cls, num_ids: int, hidden: int, intermediate: int, dtype: torch.dtype,
              activation: ExpertActivation = SILU_SWIGLU) -> HostExpertPool:
        """A pool of float experts of ``dtype`` (bf16 / f16 / f32 rows: ``w13 [2I, H]``, ``w2 [H, I]``, and
        float32 ``b13 [2I]``, ``b2 [H]`` with ``activation.bias``)."""
        layout = ExpertLayout.build(WeightFormat.for_dtype(dtype), hidden, intermediate, has_bias=activation.bias)
        return cls(num_ids, layout, activation=activation)

    @property
    def format(self) -> WeightFormat:
        return self.layout.format

    @property
    def row_bytes(self) -> int:
        """Bytes of one expert row (every section and the alignment padding)."""
        return self.layout.row_bytes

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.num_ids

    def view(self, name: str) -> torch.Tensor:
        """Typed view of section ``name`` over every row (``[N, *section.shape]``, no copy)."""
        return self.layout.view(self.bank, name)

    def pin(self) -> bool:
        """Page-lock the filled bank with ``cudaHostRegister`` (pin *after* filling).

        Returns ``True`` on success; on refusal (no CUDA, ulimit, OS limit) logs why and keeps
        pageable memory, returning ``False``. Never raises.
        """
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        if self.bank.numel() == 0:
            self.pinned = True
            return True
        err = self._registration.register(self.bank.data_ptr(), self.nbytes)
        if int(err) != 0:
            log.warning("cudaHostRegister refused %.2f GB (error %s): expert pool stays pageable; "
                        "host->GPU expert copies will be slow", self.nbytes / 1e9, err)
            return False
        self.pinned = True
        return True

    def unpin(self) -> None:
        self._registration.unregister()
        self.pinned = False

    def __del__(self):
        try:
            self.unpin()
        except Exception:
            pass

    def fill_random(self, seed: int, std: float = 0.02, progress: bool = False) -> None:
        """Dummy-weight fill (``--load-format dummy``): every row gets valid weights of the layout's format.

        Two random float experts (``N(0, std)``) are quantized into the layout (:func:`~edgemoe.quant.quantize.
        pack_float_expert`); each row's weight sections (``w13``, ``w2``) are windows of theirs at random
        element offsets, so rows differ (biases too), and the other sections (block scales) are the first
        expert's. A
        full-scale pool (tens of GB) fills at memory-copy speed rather than RNG or quantizer speed.
        """
        g = torch.Generator().manual_seed(seed)
        lay, h, i = self.layout, self.hidden, self.intermediate
        src = lay.new_bank(2)  # [2, row_bytes]
        for r in range(2):
            w13 = torch.randn(2 * i, h, generator=g) * std
            w2 = torch.randn(h, i, generator=g) * std
            b13, b2 = (torch.randn(2 * i, generator=g) * std, torch.randn(h, generator=g) * std) if lay.has_bias \
                else (None, None)
            pack_float_expert(lay, w13, w2, out=src[r], b13=b13, b2=b2)
        it = range(self.num_ids)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, desc="dummy experts", unit="expert", leave=False)
        windows = []
        for s in lay.sections:
            if s.name in _DATA_SECTIONS:
                n = s.nbytes // s.dtype.itemsize
                flat = src[:, s.offset:s.end].contiguous().view(s.dtype).reshape(-1)  # [2n] elements of both experts
                windows.append((self.bank[:, s.offset:s.end].view(s.dtype), flat, n,
                                torch.randint(0, n + 1, (self.num_ids,), generator=g).tolist()))
            else:
                self.bank[:, s.offset:s.end].copy_(src[0, s.offset:s.end])
        for row in it:
            for dst, flat, n, offsets in windows:
                dst[row].copy_(flat[offsets[row]:offsets[row] + n])
