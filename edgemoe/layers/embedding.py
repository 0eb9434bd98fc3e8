"""The token embedding kept in page-locked host memory (``--token-embedding host``).

A step reads only its ``T`` rows of the ``[V, H]`` table (Qwen3.6-35B-A3B: 248320 x 2048 bf16 = 1.02 GB),
so the table can stay in host memory and leave the GPU memory to the expert cache: the rows are
gathered onto the GPU by one Triton launch that reads the registered table zero-copy
(:func:`edgemoe.kernels.embedding.gather_rows`; no host synchronization, CUDA-graph capturable). It
is a plain row copy: the output is bit-identical to ``nn.Embedding`` over the same table.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from edgemoe.experts.pool import HostRegistration

log = logging.getLogger(__name__)

__all__ = ["HostEmbedding"]


class HostEmbedding(nn.Module):
    """``nn.Embedding``'s forward over a table in page-locked host memory.

    Built on the meta device like the rest of the model (``MoECausalLM.keep_embedding_on_host`` swaps it
    in for ``embed_tokens``); ``MoECausalLM.materialize`` allocates :attr:`weight` in host memory (never on
    the compute device), the loaders fill it under the checkpoint's name (``...embed_tokens.weight``), and
    the runner page-locks it with :meth:`pin` after filling.

    Args:
        num_embeddings: ``V``, the vocabulary size.
        embedding_dim: ``H``, the hidden size.

    Attributes:
        weight: ``[V, H]`` parameter in host memory, in the model's dtype.
        pinned: the table is registered (``cudaHostRegister``) and readable from the GPU.

    ``forward(ids)``: ``ids`` int64 or int32 of any shape on the compute device → ``[*ids.shape, H]`` in
    ``weight``'s dtype on ``ids.device``. Raises ``RuntimeError`` for CUDA ids while the table is not
    pinned (Triton could not read it), ``ValueError`` for ids that are not integers. An id outside
    ``[0, V)`` gives a zero row (the engine checks prompt ids at admission).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self._registration = HostRegistration()

    @property
    def pinned(self) -> bool:
        return self._registration.registered

    @property
    def nbytes(self) -> int:
        """Bytes of the table (host memory)."""
        return self.weight.numel() * self.weight.element_size()

    def pin(self) -> bool:
        """Page-lock the filled table with ``cudaHostRegister`` (after filling, as the expert pool: see
        ``edgemoe.weights.bootstrap``).

        Returns:
            ``True`` when the table is registered; ``False`` when CUDA refused (``RLIMIT_MEMLOCK``, not
            enough RAM; logged) or is not available. Never raises.
        """
        if self.pinned:
            return True
        if not torch.cuda.is_available() or self.weight.device.type != "cpu":
            return False
        err = self._registration.register(self.weight.data_ptr(), self.nbytes)
        if int(err) != 0:
            log.warning("cudaHostRegister refused the %.2f GB token embedding (error %s)", self.nbytes / 1e9, err)
            return False
        return True

    def unpin(self) -> None:
        """Unregister the table (before its memory is freed or replaced); nothing when not pinned."""
        self._registration.unregister()

    def __del__(self):
        try:
            self.unpin()
        except Exception:
            pass

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from edgemoe.kernels.embedding import gather_rows  # Triton: imported where the option is used

        if ids.is_cuda and not self.pinned:
            raise RuntimeError("HostEmbedding: the table is not page-locked (call pin() after loading it), so the "
                               "GPU cannot read it")
        flat = ids.reshape(-1)
        out = torch.empty(flat.shape[0], self.weight.shape[1], dtype=self.weight.dtype, device=ids.device)
        return gather_rows(flat, self.weight, out).view(*ids.shape, self.weight.shape[1])

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, host memory, {'pinned' if self.pinned else 'pageable'}"
