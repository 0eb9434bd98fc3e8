"""Radix-tree prefix cache over token ids, at KV-page granularity.

The idea is SGLang's RadixAttention (Zheng et al., "SGLang: Efficient Execution of Structured Language
Model Programs", NeurIPS 2024, §3): the KV pages of finished and running sequences stay indexed by
their token ids in a radix tree, so a new request whose prompt starts with a cached prefix reuses those
pages and prefills only the rest; unreferenced pages are evicted least-recently-used first.

Here every edge is a run of *whole pages*: a node holds ``k`` page ids and the ``k * page_size`` token
ids stored in them, so only full pages are ever shared and a sequence never writes into a page it
shares. Children are keyed by the token ids of their first page (two children of one node never share
a first page: the tree splits an edge where paths diverge). Each node carries

- ``ref``: how many sequences use it (a sequence locks the deepest node of its prefix, which counts for
  every node up to the root), so a node with ``ref == 0`` has only unreferenced descendants;
- ``last_access``: a logical clock value (one tick per :meth:`RadixCache.match_prefix` /
  :meth:`RadixCache.insert`), the LRU key of eviction.

The tree owns the pages it holds; :meth:`RadixCache.evict` and duplicate inserts hand pages back to the
page pool through the ``release`` callback.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["PrefixMatch", "RadixCache", "RadixNode"]


class RadixNode:
    """One edge of the tree and the node it leads to.

    Attributes:
        parent: the node above (``None`` for the root).
        children: first-page token ids → child.
        tokens: the token ids of this edge, ``len(pages) * page_size`` of them.
        pages: KV page ids holding those tokens, in order.
        ref: sequences using this node (directly or through a descendant).
        last_access: logical time of the last match or insert through this node.
    """

    __slots__ = ("children", "last_access", "pages", "parent", "ref", "tokens")

    def __init__(self, parent: RadixNode | None, tokens: tuple[int, ...], pages: list[int], last_access: int):
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.tokens = tokens
        self.pages = pages
        self.ref = 0
        self.last_access = last_access


class PrefixMatch(NamedTuple):
    """A cached prefix: ``pages`` hold its first ``num_tokens`` tokens (``len(pages) * page_size``);
    ``node`` is the deepest node of the path (the root for an empty match), the handle to lock."""

    pages: list[int]
    num_tokens: int
    node: RadixNode


class RadixCache:
    """The prefix tree of one KV page pool.

    Args:
        page_size: tokens per KV page (the granularity of sharing).
        release: called with page ids the tree gives back to the pool (evicted or duplicate pages).

    Counters: ``num_pages`` (pages held by the tree), ``evictable_pages`` (pages of unreferenced nodes;
    all of them can be evicted, leaves first).
    """

    def __init__(self, page_size: int, release: Callable[[list[int]], None]):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self._release = release
        self.root = RadixNode(None, (), [], 0)
        self.root.ref = 1  # never evicted
        self._clock = 0
        self.num_pages = 0
        self.evictable_pages = 0

    # ------------------------------------------------------------------ lookup and insertion
    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` made of whole pages.

        An edge matched only in part is split, so the returned node ends exactly at ``num_tokens``.
        Every node on the path is marked as used now.
        """
        ps = self.page_size
        self._clock += 1
        node, pages, i = self.root, [], 0
        end = len(tokens) // ps * ps
        while i < end:
            child = node.children.get(tuple(tokens[i:i + ps]))
            if child is None:
                break
            m = self._common_pages(child, tokens, i)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = self._clock
            pages.extend(child.pages)
            i += m * ps
            node = child
        return PrefixMatch(pages, i, node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> PrefixMatch:
        """Cache ``pages`` as holding ``tokens`` (``len(tokens) == len(pages) * page_size``).

        The tree takes ownership of ``pages``: positions it already caches keep the tree's page and
        the caller's duplicate page is released to the pool; the rest become new cached pages.

        Returns:
            the tree's pages for all of ``tokens`` (the caller must use these from now on) and the
            deepest node, which is left unreferenced (lock it to keep the pages).

        Raises:
            ValueError: ``tokens`` and ``pages`` disagree in length.
        """
        ps = self.page_size
        if len(tokens) != len(pages) * ps:
            raise ValueError(f"insert: {len(tokens)} tokens do not fill {len(pages)} pages of {ps}")
        self._clock += 1
        node, out, i = self.root, [], 0
        duplicates: list[int] = []
        while i < len(tokens):
            key = tuple(tokens[i:i + ps])
            child = node.children.get(key)
            if child is None:
                child = RadixNode(node, tuple(tokens[i:]), list(pages[i // ps:]), self._clock)
                node.children[key] = child
                self.num_pages += len(child.pages)
                self.evictable_pages += len(child.pages)
                out.extend(child.pages)
                node = child
                break
            m = self._common_pages(child, tokens, i)
            if m < len(child.pages):
                child = self._split(child, m)
            child.last_access = self._clock
            duplicates.extend(p for p, q in zip(pages[i // ps:i // ps + m], child.pages) if p != q)
            out.extend(child.pages)
            i += m * ps
            node = child
        if duplicates:
            self._release(duplicates)
        return PrefixMatch(out, len(tokens), node)

    def _common_pages(self, node: RadixNode, tokens: Sequence[int], start: int) -> int:
        """Whole pages of ``node``'s edge equal to ``tokens[start:]``."""
        ps, edge = self.page_size, node.tokens
        n = min(len(edge), len(tokens) - start) // ps
        m = 0
        while m < n and edge[m * ps:(m + 1) * ps] == tuple(tokens[start + m * ps:start + (m + 1) * ps]):
            m += 1
        return m

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut ``node``'s edge after ``m`` pages; returns the new upper node (``node`` keeps the tail,
        so handles to it still name the same full path)."""
        ps = self.page_size
        head = RadixNode(node.parent, node.tokens[:m * ps], node.pages[:m], node.last_access)
        head.ref = node.ref
        node.parent.children[node.tokens[:ps]] = head
        node.tokens, node.pages, node.parent = node.tokens[m * ps:], node.pages[m:], head
        head.children[node.tokens[:ps]] = node
        return head

    # ------------------------------------------------------------------ references
    def lock(self, node: RadixNode) -> None:
        """A sequence starts using the path root → ``node``: its pages cannot be evicted."""
        while node is not self.root:
            if node.ref == 0:
                self.evictable_pages -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one :meth:`lock` of ``node``.

        Raises:
            ValueError: ``node`` is not locked.
        """
        if node is not self.root and node.ref < 1:
            raise ValueError("unlock of an unreferenced radix node")
        while node is not self.root:
            node.ref -= 1
            if node.ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages (fewer when not enough are evictable) by removing
        unreferenced leaves, least recently used first; a parent left childless and unreferenced
        becomes a candidate in turn. Whole nodes are evicted, so more pages may be freed.

        Returns:
            pages released to the pool.
        """
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self._nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.tokens[:self.page_size]]
            freed.extend(leaf.pages)
            self.num_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        if freed:
            self._release(freed)
        return len(freed)

    def evict_where(self, doomed: Callable[[int], bool]) -> int:
        """Evict the unreferenced nodes holding a page for which ``doomed(page)`` is true (a KV pool
        shrinking drops its top pages), and the descendants they must take along (themselves
        unreferenced: a referenced node keeps its ancestors referenced).

        Returns:
            pages released to the pool.
        """
        freed: list[int] = []
        gone: set[int] = set()  # ids of nodes removed with an evicted ancestor
        for node in sorted(self._nodes(), key=self._depth):
            if node.ref or id(node) in gone or not any(doomed(p) for p in node.pages):
                continue
            del node.parent.children[node.tokens[:self.page_size]]
            stack = [node]
            while stack:
                n = stack.pop()
                gone.add(id(n))
                freed.extend(n.pages)
                self.num_pages -= len(n.pages)
                self.evictable_pages -= len(n.pages)
                stack.extend(n.children.values())
        if freed:
            self._release(freed)
        return len(freed)

    def referenced_pages(self) -> list[int]:
        """Pages of nodes a live sequence references (locked); they cannot be evicted."""
        return [p for n in self._nodes() if n.ref for p in n.pages]

    @staticmethod
    def _depth(node: RadixNode) -> int:
        d = 0
        while node.parent is not None:
            node, d = node.parent, d + 1
        return d

    def _nodes(self) -> list[RadixNode]:
        """Every node below the root."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
