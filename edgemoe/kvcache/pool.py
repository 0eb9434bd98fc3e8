"""Paged KV cache pool (vLLM's PagedAttention layout, simplified).

Keys and values of every full-attention layer live in two tensors of fixed-size pages; a sequence
owns a list of pages (its *page table*). Token ``t`` of a sequence is stored at flat slot
``page_table[t // page_size] * page_size + t % page_size``.
"""

from __future__ import annotations

import torch


class KVCacheFullError(RuntimeError):
    """Raised when a sequence needs more KV pages than are free. The pool is left unchanged."""


class PagedKVPool:
    """A pool of KV pages for ``num_layers`` attention layers.

    Args:
        num_layers: attention layers that store KV.
        num_pages: pages in the pool; capacity is ``num_pages * page_size`` tokens.
        page_size: tokens per page.
        num_kv_heads, head_dim: per-token KV geometry.
        dtype, device: storage dtype and device of the KV tensors.

    Storage: ``k[layer]``/``v[layer]`` are ``[num_pages * page_size, num_kv_heads, head_dim]``.
    Bytes: ``2 * num_layers * num_pages * page_size * num_kv_heads * head_dim * dtype_size``.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if num_pages < 1 or page_size < 1:
            raise ValueError("KV pool needs at least one page of at least one token")
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.device = torch.device(device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes across all layers (keys + values)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def pages_needed(self, seq_id: int, total_len: int) -> int:
        """Extra pages ``seq_id`` needs to hold ``total_len`` tokens."""
        have = len(self._pages.get(seq_id, ()))
        return max(0, -(-total_len // self.page_size) - have)

    def can_allocate(self, seq_id: int, total_len: int) -> bool:
        return self.pages_needed(seq_id, total_len) <= len(self._free)

    def allocate(self, seq_id: int, total_len: int) -> None:
        """Grow ``seq_id``'s page table to hold ``total_len`` tokens.

        Raises:
            KVCacheFullError: not enough free pages (nothing is allocated then).
        """
        need = self.pages_needed(seq_id, total_len)
        if need > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} more pages, {len(self._free)} free "
                f"(capacity {self.capacity_tokens} tokens)"
            )
        pages = self._pages.setdefault(seq_id, [])
        for _ in range(need):
            pages.append(self._free.pop())

    def free(self, seq_id: int) -> None:
        """Return all pages of ``seq_id`` to the pool (no-op for an unknown id)."""
        for p in reversed(self._pages.pop(seq_id, [])):
            self._free.append(p)

    def pages_of(self, seq_id: int) -> list[int]:
        """Page ids of ``seq_id`` in token order (empty for an unknown id)."""
        return list(self._pages.get(seq_id, ()))

    def page_table(self, seq_id: int) -> torch.Tensor:
        """``[num_pages_of_seq]`` int64 page ids of ``seq_id`` on the pool's device."""
        return torch.tensor(self._pages.get(seq_id, []), dtype=torch.int64, device=self.device)

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """``[end - start]`` int64 flat slots of token positions ``[start, end)`` of ``seq_id``."""
        pages = self._pages[seq_id]
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(pages, dtype=torch.int64)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).to(self.device)
