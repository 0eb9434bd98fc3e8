"""The host expert pool: every routed expert of the model, in host memory (DESIGN.md §1, §4).

Experts are stored stacked in two banks indexed by the flat id ``moe_layer * E + expert``:
``w13 [N, 2I, H]`` (gate rows then up rows) and ``w2 [N, H, I]``. Host memory is the source of
truth; the device expert cache only ever holds copies of rows.

Experts with biases (gpt-oss) also get two float32 bias banks, ``b13 [N, 2I]`` (gate's bias then up's)
and ``b2 [N, H]``. They are temporary, beside the weight banks, until an expert's row carries its bias
sections: they are not part of :meth:`HostExpertPool.banks` (fills do not copy them; the compute device
keeps a full copy, ``HybridExperts.biases``).
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

from edgemoe.config import SILU_SWIGLU, ExpertActivation

log = logging.getLogger(__name__)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Uninitialized, page-aligned (4 KiB) host tensor backed by a private anonymous mapping.

    Page alignment lets direct I/O (``O_DIRECT``) read straight into the tensor (``torch.empty`` only
    guarantees 64 bytes). Pages are faulted in on first write, so filling then pinning touches each
    page once (DESIGN.md §5). The mapping lives as long as any tensor viewing it.

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


class HostExpertPool:
    """Routed-expert banks in host memory.

    Args:
        num_ids: ``N = num_moe_layers * num_experts`` rows.
        hidden, intermediate: ``H`` and ``I`` (the expert's intermediate size).
        dtype: storage dtype of the banks.
        activation: the experts' activation and biases (the model's ``ExpertActivation``); with
            ``activation.bias`` the bias banks are allocated.

    Both banks are page-aligned (:func:`host_empty`) so the FTW bootstrap reads them with direct I/O.

    Attributes:
        w13: ``[N, 2I, H]`` gate (rows ``[:I]``) and up (rows ``[I:]``) projections.
        w2: ``[N, H, I]`` down projection.
        b13, b2: float32 ``[N, 2I]`` / ``[N, H]`` expert biases (temporary banks, see the module
            docstring), or ``None`` without biases.
        activation: as given.
        pinned: whether the banks are page-locked (registered with CUDA) for async host→GPU copies.
    """

    def __init__(self, num_ids: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 activation: ExpertActivation = SILU_SWIGLU):
        self.num_ids, self.hidden, self.intermediate, self.dtype = num_ids, hidden, intermediate, dtype
        self.activation = activation
        self.w13 = host_empty((num_ids, 2 * intermediate, hidden), dtype)  # [N, 2I, H]
        self.w2 = host_empty((num_ids, hidden, intermediate), dtype)  # [N, H, I]
        self.b13 = self.b2 = None
        if activation.bias:
            self.b13 = torch.empty(num_ids, 2 * intermediate, dtype=torch.float32)  # [N, 2I]
            self.b2 = torch.empty(num_ids, hidden, dtype=torch.float32)  # [N, H]
        self.pinned = False
        self._registered: list[int] = []

    @property
    def row_bytes(self) -> int:
        """Bytes of one expert's weights (both banks; the bias banks stay on the host and, whole, on the
        compute device, so they are not counted in what a fill or a cache slot moves)."""
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()

    @property
    def nbytes(self) -> int:
        return self.row_bytes * self.num_ids

    def banks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w13, self.w2

    def pin(self) -> bool:
        """Page-lock the filled banks with ``cudaHostRegister`` (pin *after* filling: DESIGN.md §5).

        Returns ``True`` on success; on refusal (no CUDA, ulimit, OS limit) logs why and keeps
        pageable memory, returning ``False``. Never raises.
        """
        if self.pinned or not torch.cuda.is_available():
            return self.pinned
        cudart = torch.cuda.cudart()
        for bank in self.banks():
            if bank.numel() == 0:
                continue
            err = cudart.cudaHostRegister(bank.data_ptr(), bank.numel() * bank.element_size(), 0)
            if int(err) != 0:
                log.warning("cudaHostRegister refused %.2f GB (error %s): expert pool stays pageable; "
                            "host->GPU expert copies will be slow", bank.numel() * bank.element_size() / 1e9, err)
                self.unpin()
                return False
            self._registered.append(bank.data_ptr())
        self.pinned = True
        return True

    def unpin(self) -> None:
        if self._registered:
            cudart = torch.cuda.cudart()
            for ptr in self._registered:
                cudart.cudaHostUnregister(ptr)
        self._registered.clear()
        self.pinned = False

    def __del__(self):
        try:
            self.unpin()
        except Exception:
            pass

    def fill_random(self, seed: int, std: float = 0.02, progress: bool = False) -> None:
        """Dummy-weight fill (``--load-format dummy``): every row gets distinct random values.

        Draws one random source ~2 rows long and copies per-row windows of it at random offsets, so a
        full-scale pool (tens of GB) fills at memory-copy speed rather than RNG speed. Bias banks get
        ``N(0, std)`` values.
        """
        g = torch.Generator().manual_seed(seed)
        if self.b13 is not None:
            for b in (self.b13, self.b2):
                b.copy_(torch.randn(b.shape, generator=g) * std)
        for bank in self.banks():
            n = bank[0].numel()
            if n == 0:
                continue
            src = (torch.randn(2 * n + 1, generator=g) * std).to(self.dtype)
            offsets = torch.randint(0, n + 1, (self.num_ids,), generator=g).tolist()
            flat = bank.view(self.num_ids, n)
            it = range(self.num_ids)
            if progress:
                from tqdm import tqdm

                it = tqdm(it, desc="dummy experts", unit="expert", leave=False)
            for i in it:
                flat[i].copy_(src[offsets[i]:offsets[i] + n])
