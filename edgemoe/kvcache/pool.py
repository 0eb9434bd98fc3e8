"""Paged KV cache pool (vLLM's PagedAttention layout, simplified), with an optional prefix cache.

What a token stores per attention layer is the model's :class:`KVSpec`: a key and a value of
``num_kv_heads x head_dim`` each (grouped-query attention), or one latent row of ``latent_dim``
values (multi-head latent attention, which caches the compressed ``c_kv`` and the rotary key instead of
per-head keys and values). Rows live in fixed-size pages; a sequence has a list of pages (its *page
table*). Token ``t`` of a sequence is stored at flat slot ``page_table[t // page_size] * page_size + t
% page_size``, whatever the row holds.

With prefix caching (:class:`~edgemoe.kvcache.radix.RadixCache`), a page table starts with pages the
sequence *borrows* from the radix tree (a cached prefix, locked while the sequence lives) followed by
pages it owns. Freeing a sequence unlocks the borrowed pages and returns only its own; cached pages
nobody references count as free and are evicted (LRU) when an allocation runs out of unused pages.

The pool's page count changes at run time (:meth:`PagedKVPool.resize`, between steps): growing
reallocates the page storage with room for the new pages and copies the old pages over (page ids,
page tables and cached prefixes stay valid; tensors captured by CUDA graphs move, so they are
captured again); shrinking drops free pages at the top of the id range only. Allocation hands out the
lowest free page id first, so pages at the top are the first to become free again.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgemoe.kvcache.radix import PrefixMatch, RadixCache, RadixNode


@dataclass(frozen=True)
class KVSpec:
    """Per-token KV geometry of a model's attention layers (``MoECausalLM.kv_spec``).

    Exactly one form: ``num_kv_heads`` and ``head_dim`` (a key and a value of ``[num_kv_heads,
    head_dim]`` per token and layer), or ``latent_dim`` (one row of that many values per token and
    layer, attended by every query head; its first ``value_dim`` values are also the value, as in
    multi-head latent attention's absorbed form). Build with :meth:`heads` or :meth:`latent`.

    Raises:
        ValueError: neither or both forms, or a non-positive size.
    """

    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    latent_dim: int = 0
    value_dim: int = 0

    def __post_init__(self):
        heads = self.num_kv_heads > 0 and self.head_dim > 0
        latent = 0 < self.value_dim <= self.latent_dim
        if self.num_layers < 0 or heads == (self.latent_dim > 0) or (self.latent_dim > 0 and not latent) \
                or min(self.num_kv_heads, self.head_dim, self.latent_dim, self.value_dim) < 0:
            raise ValueError(f"KV spec needs num_kv_heads and head_dim, or latent_dim and value_dim <= latent_dim, "
                             f"all positive: {self}")

    @classmethod
    def heads(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVSpec:
        """Grouped-query K/V: ``num_kv_heads`` heads of ``head_dim`` for keys and for values."""
        return cls(num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)

    @classmethod
    def latent(cls, num_layers: int, latent_dim: int, value_dim: int) -> KVSpec:
        """One latent row of ``latent_dim`` values per token and layer, the first ``value_dim`` of which are
        the value (multi-head latent attention: ``kv_lora_rank + qk_rope_head_dim`` and ``kv_lora_rank``)."""
        return cls(num_layers, latent_dim=latent_dim, value_dim=value_dim)

    @property
    def is_latent(self) -> bool:
        return self.latent_dim > 0

    @property
    def planes(self) -> tuple[tuple[int, ...], ...]:
        """Per-token shape of each stored tensor: ``((Hkv, D), (Hkv, D))`` (keys, values) or ``((W,),)``."""
        if self.is_latent:
            return ((self.latent_dim,),)
        return ((self.num_kv_heads, self.head_dim),) * 2

    def describe(self) -> str:
        """One line for the start-up summary, e.g. ``61 layers x one latent row of 576``."""
        if self.is_latent:
            return f"{self.num_layers} layers x one latent row of {self.latent_dim}"
        return f"{self.num_layers} layers x K/V of {self.num_kv_heads} x {self.head_dim}"

    def elements_per_token(self) -> int:
        """Values one token stores across all layers."""
        per_layer = self.latent_dim if self.is_latent else 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * per_layer

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token takes across all layers, stored in ``dtype``."""
        return self.elements_per_token() * torch.empty((), dtype=dtype).element_size()


class KVCacheFullError(RuntimeError):
    """Raised when a sequence needs more KV pages than are free. The pool is left unchanged."""


class PagedKVPool:
    """A pool of KV pages for the attention layers of ``spec``.

    Args:
        spec: per-token KV geometry (:class:`KVSpec`).
        num_pages: pages in the pool; capacity is ``num_pages * page_size`` tokens.
        page_size: tokens per page.
        dtype, device: storage dtype and device of the KV tensors.
        prefix_caching: keep full pages of sequences in a radix tree (``self.prefix_cache``) for reuse.

    Storage (``S = num_pages * page_size`` slots): grouped-query K/V in ``k[layer]`` / ``v[layer]``, each
    ``[S, num_kv_heads, head_dim]`` (``latent`` is ``None``); latent rows in ``latent[layer]``, ``[S,
    latent_dim]`` (``k`` and ``v`` are ``None``). ``planes`` lists the stored tensors either way.
    Bytes: ``num_pages * page_size * spec.bytes_per_token(dtype)``.
    """

    def __init__(self, spec: KVSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device,
                 prefix_caching: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError("KV pool needs at least one page of at least one token")
        self.spec = spec
        self.page_size = page_size
        self.num_pages = num_pages
        slots = num_pages * page_size
        self.device, self.dtype = torch.device(device), dtype
        self._set_planes(tuple(torch.zeros((spec.num_layers, slots, *row), dtype=dtype, device=device)
                               for row in spec.planes))
        self._free: list[int] = list(range(num_pages))  # a min-heap: the lowest free page id is handed out first
        self._pages: dict[int, list[int]] = {}
        self.prefix_cache = RadixCache(page_size, self._release) if prefix_caching else None
        self._borrowed: dict[int, int] = {}  # seq_id -> leading pages of its table owned by the tree
        self._prefix_node: dict[int, RadixNode] = {}  # seq_id -> the radix node it locks

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers."""
        return self.spec.bytes_per_token(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of all KV storage."""
        return sum(p.nbytes for p in self.planes)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        """Pages an allocation can get: unused pages plus cached pages no sequence references."""
        return len(self._free) + (self.prefix_cache.evictable_pages if self.prefix_cache is not None else 0)

    @property
    def cached_pages(self) -> int:
        """Pages held by the prefix cache (referenced or not)."""
        return self.prefix_cache.num_pages if self.prefix_cache is not None else 0

    def free_tokens(self) -> int:
        return self.free_pages * self.page_size

    def pages_needed(self, seq_id: int, total_len: int) -> int:
        """Extra pages ``seq_id`` needs to hold ``total_len`` tokens."""
        have = len(self._pages.get(seq_id, ()))
        return max(0, -(-total_len // self.page_size) - have)

    def can_allocate(self, seq_id: int, total_len: int) -> bool:
        return self.pages_needed(seq_id, total_len) <= self.free_pages

    def allocate(self, seq_id: int, total_len: int) -> None:
        """Grow ``seq_id``'s page table to hold ``total_len`` tokens, evicting unreferenced cached
        pages (LRU) when unused pages run out.

        Raises:
            KVCacheFullError: not enough free pages (nothing is allocated then).
        """
        need = self.pages_needed(seq_id, total_len)
        if need > self.free_pages:
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} more pages, {self.free_pages} free "
                f"(capacity {self.capacity_tokens} tokens)"
            )
        if need > len(self._free):
            self.prefix_cache.evict(need - len(self._free))
        pages = self._pages.setdefault(seq_id, [])
        for _ in range(need):
            pages.append(heapq.heappop(self._free))

    def _release(self, pages: Sequence[int]) -> None:
        """Return ``pages`` to the free heap (a sequence's own pages, or pages the prefix cache gives back)."""
        for p in pages:
            heapq.heappush(self._free, p)

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``: unlock the cached pages it borrows, return the pages it owns to the
        pool (no-op for an unknown id)."""
        pages = self._pages.pop(seq_id, [])
        borrowed = self._borrowed.pop(seq_id, 0)
        node = self._prefix_node.pop(seq_id, None)
        if node is not None:
            self.prefix_cache.unlock(node)
        self._release(pages[borrowed:])

    # ------------------------------------------------------------------ resizing
    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers and planes."""
        return self.page_size * self.bytes_per_token

    def min_pages(self) -> int:
        """The fewest pages :meth:`resize` can shrink to now: one past the highest page a sequence or
        the prefix cache holds (unreferenced cached pages at the top count as droppable)."""
        held = [p for pages in self._pages.values() for p in pages]
        if self.prefix_cache is not None:
            held += self.prefix_cache.referenced_pages()
        return max(held, default=-1) + 1

    # normal tensors even when a step borrowing pages resizes under inference mode: the storage must keep taking
    # the in-place writes made between steps (a checkpoint's partial page restored on admission)
    @torch.inference_mode(False)
    def resize(self, num_pages: int, stage_on_host: bool = False) -> None:
        """Change the page count at a safe point between steps (no step in flight).

        Growing allocates new storage of ``num_pages`` pages, copies the current pages into it (their
        ids, the page tables and the prefix cache stay valid) and adds the new ids to the free pages;
        the tensors move, so anything that captured their addresses (CUDA graphs) must be captured
        again. ``stage_on_host`` copies the old pages through host memory first and frees them before
        the new storage is allocated, so the device never holds both (slower: two host transfers).
        Shrinking first evicts unreferenced cached pages at or above ``num_pages``, then keeps the
        first ``num_pages`` pages.

        Raises:
            ValueError: ``num_pages < 1``, or a page at or above ``num_pages`` is held by a sequence or a
                referenced prefix (see :meth:`min_pages`); nothing changes then.
            torch.OutOfMemoryError: the new storage cannot be allocated (the pool is unchanged, unless
                ``stage_on_host``: then the old pages are restored from the host copy first).
        """
        if num_pages < 1:
            raise ValueError("KV pool needs at least one page")
        old = self.num_pages
        if num_pages == old:
            return
        if num_pages < old:
            low = self.min_pages()
            if num_pages < low:
                raise ValueError(f"cannot shrink the KV pool to {num_pages} pages: page {low - 1} is in use")
            if self.prefix_cache is not None:
                self.prefix_cache.evict_where(lambda page: page >= num_pages)
            keep = num_pages * self.page_size
            self._set_planes(tuple(p[:, :keep].clone() for p in self.planes))
            self._free = [p for p in self._free if p < num_pages]
            heapq.heapify(self._free)
        else:
            slots, have = num_pages * self.page_size, old * self.page_size
            olds = self.planes
            if stage_on_host:
                olds = tuple(p.cpu() for p in self.planes)
                self._set_planes(())
            try:
                new = tuple(torch.zeros((p.shape[0], slots, *p.shape[2:]), dtype=p.dtype, device=self.device)
                            for p in olds)
            except torch.OutOfMemoryError:
                if stage_on_host:
                    self._set_planes(tuple(p.to(self.device) for p in olds))
                raise
            for n, o in zip(new, olds):
                n[:, :have].copy_(o)
            self._set_planes(new)
            del olds
            for p in range(old, num_pages):
                heapq.heappush(self._free, p)
        self.num_pages = num_pages

    def _set_planes(self, planes: tuple[torch.Tensor, ...]) -> None:
        self.planes = planes
        if not planes:
            self.k = self.v = self.latent = None
            return
        self.k, self.v = (None, None) if self.spec.is_latent else planes
        self.latent = planes[0] if self.spec.is_latent else None

    def pages_of(self, seq_id: int) -> list[int]:
        """Page ids of ``seq_id`` in token order (empty for an unknown id)."""
        return list(self._pages.get(seq_id, ()))

    # ------------------------------------------------------------------ prefix sharing
    def attach_prefix(self, seq_id: int, match: PrefixMatch) -> None:
        """Start the new sequence ``seq_id`` with the cached pages of ``match`` (from
        ``prefix_cache.match_prefix``), locked until :meth:`free`.

        Raises:
            ValueError: ``seq_id`` already has pages, or prefix caching is off.
        """
        if self.prefix_cache is None:
            raise ValueError("attach_prefix: prefix caching is off")
        if self._pages.get(seq_id):
            raise ValueError(f"attach_prefix: sequence {seq_id} already has pages")
        self._pages[seq_id] = list(match.pages)
        self._borrowed[seq_id] = len(match.pages)
        self.prefix_cache.lock(match.node)
        self._prefix_node[seq_id] = match.node

    def cache_prefix(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Insert the full pages of ``seq_id`` into the prefix cache; the sequence keeps using them
        (locked). Pages the tree already held under the same tokens replace the sequence's copies,
        which go back to the pool. No-op without prefix caching.

        Args:
            token_ids: the tokens whose KV ``seq_id`` holds, from position 0.
        """
        if self.prefix_cache is None or seq_id not in self._pages:
            return
        table = self._pages[seq_id]
        n = min(len(token_ids) // self.page_size, len(table))
        if n <= self._borrowed.get(seq_id, 0):
            return
        match = self.prefix_cache.insert(token_ids[:n * self.page_size], table[:n])
        table[:n] = match.pages
        self.prefix_cache.lock(match.node)
        old = self._prefix_node.get(seq_id)
        if old is not None:
            self.prefix_cache.unlock(old)
        self._prefix_node[seq_id] = match.node
        self._borrowed[seq_id] = n

    def page_table(self, seq_id: int) -> torch.Tensor:
        """``[num_pages_of_seq]`` int64 page ids of ``seq_id`` on the pool's device."""
        return torch.tensor(self._pages.get(seq_id, []), dtype=torch.int64, device=self.device)

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """``[end - start]`` int64 flat slots of token positions ``[start, end)`` of ``seq_id``."""
        pages = self._pages[seq_id]
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.tensor(pages, dtype=torch.int64)
        return (table[pos // self.page_size] * self.page_size + pos % self.page_size).to(self.device)
