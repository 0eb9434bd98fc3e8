"""The radix-tree prefix cache (``edgemoe.kvcache.radix``) and the shared-aware ``PagedKVPool``.

The tree is checked against a brute-force reference (a dict from page-aligned token prefixes to page
ids) under random inserts, matches, locks and evictions, besides the hand-written cases.
"""

from __future__ import annotations

import random

import pytest
import torch

from edgemoe.kvcache.pool import KVCacheFullError, KVSpec, PagedKVPool
from edgemoe.kvcache.radix import RadixCache

PS = 4


def seq(*pages: int) -> list[int]:
    """Tokens of whole pages: page ``p`` is ``[p*10, p*10+1, p*10+2, p*10+3]``."""
    return [p * 10 + i for p in pages for i in range(PS)]


class Released(list):
    def __call__(self, pages):
        self.extend(pages)


def make_tree() -> tuple[RadixCache, Released]:
    released = Released()
    return RadixCache(PS, released), released


def edges(node) -> list:
    """The tree below ``node`` as nested ``(pages, [children])``, children sorted by first page."""
    return sorted((n.pages, edges(n)) for n in node.children.values())


def test_match_insert_and_split_on_match():
    tree, released = make_tree()
    assert tree.match_prefix(seq(1, 2)) == ([], 0, tree.root)
    m = tree.insert(seq(1, 2, 3), [10, 11, 12])
    assert m.pages == [10, 11, 12] and m.num_tokens == 12 and m.node.ref == 0
    assert tree.num_pages == tree.evictable_pages == 3
    # a longer query with a partial last page: whole pages only
    assert tree.match_prefix(seq(1, 2, 3) + [7, 7]).pages == [10, 11, 12]
    # the query diverges inside the edge: it is split so the match ends at a node
    m = tree.match_prefix(seq(1, 2, 9))
    assert m.pages == [10, 11] and m.num_tokens == 8 and m.node.pages == [10, 11]
    assert edges(tree.root) == [([10, 11], [([12], [])])]
    # a query shorter than one page matches nothing
    assert tree.match_prefix(seq(1)[:3]).num_tokens == 0
    assert released == [] and tree.num_pages == 3


def test_insert_splits_an_edge_and_gives_back_duplicates():
    tree, released = make_tree()
    tree.insert(seq(1, 2, 3), [10, 11, 12])
    m = tree.insert(seq(1, 2, 5, 6), [20, 21, 22, 23])  # shares two pages, then diverges
    assert m.pages == [10, 11, 22, 23] and m.num_tokens == 16
    assert released == [20, 21]  # the caller's copies of pages the tree already held
    assert edges(tree.root) == [([10, 11], [([12], []), ([22, 23], [])])]
    assert tree.num_pages == tree.evictable_pages == 5
    # a full duplicate gives every page back and changes nothing
    released.clear()
    m = tree.insert(seq(1, 2, 5), [30, 31, 32])
    assert m.pages == [10, 11, 22] and released == [30, 31, 32] and tree.num_pages == 5
    # inserting pages the tree already holds (a sequence re-inserting its borrowed prefix) is a no-op
    released.clear()
    assert tree.insert(seq(1, 2), [10, 11]).pages == [10, 11] and released == []
    with pytest.raises(ValueError, match="do not fill"):
        tree.insert(seq(1, 2), [10])


def test_eviction_is_lru_among_unreferenced_leaves():
    tree, released = make_tree()
    tree.insert(seq(1, 2), [10, 11])  # oldest
    tree.insert(seq(3), [30])
    tree.insert(seq(4, 5), [40, 41])
    tree.match_prefix(seq(1, 2))  # now the most recent
    assert tree.evict(1) == 1 and released == [30]
    assert tree.evict(1) == 2 and released == [30, 40, 41]  # a whole leaf goes
    assert tree.evict(5) == 2 and released == [30, 40, 41, 10, 11]
    assert tree.num_pages == tree.evictable_pages == 0 and tree.evict(1) == 0


def test_eviction_frees_leaves_before_their_parent():
    tree, released = make_tree()
    tree.insert(seq(1, 2), [10, 11])
    tree.insert(seq(1, 3), [10, 12])  # splits: [10] -> {[11], [12]}; gives back nothing
    tree.match_prefix(seq(1, 3))
    assert released == [] and edges(tree.root) == [([10], [([11], []), ([12], [])])]
    assert tree.evict(2) == 2 and released == [11, 12]  # both leaves (LRU first); the parent stays
    assert tree.evict(1) == 1 and released == [11, 12, 10]


def test_references_protect_pages():
    tree, released = make_tree()
    a = tree.insert(seq(1, 2, 3), [10, 11, 12]).node
    tree.insert(seq(1, 2, 4), [10, 11, 13])  # [10, 11] -> {[12], [13]}
    tree.lock(a)
    assert tree.evictable_pages == 1  # only [13]: a's path is in use
    assert tree.evict(10) == 1 and released == [13]
    assert tree.match_prefix(seq(1, 2, 3)).pages == [10, 11, 12]
    tree.lock(a)
    tree.unlock(a)
    assert tree.evict(10) == 0  # still locked once
    tree.unlock(a)
    assert tree.evictable_pages == 3 and tree.evict(10) == 3 and released == [13, 12, 10, 11]
    with pytest.raises(ValueError, match="unreferenced"):
        tree.unlock(a)


def test_a_split_keeps_locks_on_the_whole_path():
    tree, _ = make_tree()
    a = tree.insert(seq(1, 2, 3), [10, 11, 12]).node
    tree.lock(a)
    head = tree.match_prefix(seq(1, 9)).node  # splits a's edge after one page
    assert head.pages == [10] and head.ref == 1 and a.pages == [11, 12] and a.parent is head
    assert tree.evictable_pages == 0 and tree.evict(5) == 0
    tree.unlock(a)
    assert head.ref == 0 and tree.evictable_pages == 3


def test_random_operations_match_a_reference():
    rng = random.Random(0)
    tree, released = make_tree()
    ref: dict[tuple, int] = {}  # page-aligned token prefix -> the page holding its last page
    next_page = iter(range(1000, 10**6))
    locked: list = []  # (node, pages of its path)

    def ref_match(tokens):
        pages = []
        for k in range(1, len(tokens) // PS + 1):
            p = ref.get(tuple(tokens[:k * PS]))
            if p is None:
                break
            pages.append(p)
        return pages

    for _ in range(3000):
        n = rng.randint(1, 6)
        tokens = [rng.randint(0, 2) for _ in range(n * PS + rng.randint(0, PS - 1))]  # small alphabet: shared prefixes
        op = rng.random()
        if op < 0.45:
            full = tokens[:n * PS]
            pages = [next(next_page) for _ in range(n)]
            before = len(released)
            got = tree.insert(full, pages)
            want = []
            for k in range(1, n + 1):
                want.append(ref.setdefault(tuple(full[:k * PS]), pages[k - 1]))
            assert got.pages == want
            assert sorted(released[before:]) == sorted(p for p in pages if p not in want)
            if rng.random() < 0.3:
                tree.lock(got.node)
                locked.append((got.node, want))
        elif op < 0.8:
            assert tree.match_prefix(tokens).pages == ref_match(tokens)
        elif op < 0.9 and locked:
            node, _ = locked.pop(rng.randrange(len(locked)))
            tree.unlock(node)
        else:
            before = len(released)
            tree.evict(rng.randint(1, 8))
            gone = set(released[before:])
            assert not gone & {p for _, ps in locked for p in ps}  # locked pages are never evicted
            for key in [k for k, p in ref.items() if p in gone]:
                del ref[key]
        # bookkeeping invariants
        assert tree.num_pages == len(ref)
        nodes = tree._nodes()
        assert tree.num_pages == sum(len(x.pages) for x in nodes)
        assert tree.evictable_pages == sum(len(x.pages) for x in nodes if x.ref == 0)
        assert all(x.ref <= x.parent.ref or x.parent is tree.root for x in nodes)
    assert len(released) == len(set(released))  # no page given back twice


# ---------------------------------------------------------------- the shared-aware page pool


def make_pool(num_pages: int = 8) -> PagedKVPool:
    return PagedKVPool(KVSpec.heads(1, 1, 2), num_pages, PS, torch.float32, torch.device("cpu"), prefix_caching=True)


def pool_pages_accounted(pool: PagedKVPool) -> bool:
    """Every page is unused, cached or owned by exactly one sequence."""
    owned = [p for s, table in pool._pages.items() for p in table[pool._borrowed.get(s, 0):]]
    cached = [p for n in pool.prefix_cache._nodes() for p in n.pages]
    every = pool._free + owned + cached
    return sorted(every) == list(range(pool.num_pages))


def test_pool_shares_pages_and_frees_only_its_own():
    pool = make_pool()
    a = seq(1, 2, 3)
    pool.allocate(1, len(a) + 2)  # 3 full pages + a partial one
    table_a = pool.page_table(1).tolist()
    pool.cache_prefix(1, a + [99, 98])  # only the 3 full pages are cached
    assert pool.cached_pages == 3 and pool.prefix_cache.evictable_pages == 0  # locked by sequence 1
    assert pool.free_pages == 4 and pool_pages_accounted(pool)

    m = pool.prefix_cache.match_prefix(seq(1, 2, 7))
    pool.attach_prefix(2, m)
    assert pool.page_table(2).tolist() == table_a[:2]
    pool.allocate(2, 12)
    assert pool.page_table(2).tolist()[:2] == table_a[:2] and pool.free_pages == 3
    assert pool.slots(2, 0, 8).tolist() == pool.slots(1, 0, 8).tolist()  # the same KV slots
    with pytest.raises(ValueError, match="already has pages"):
        pool.attach_prefix(2, m)

    pool.free(1)  # a's pages stay cached; [1, 2] is still locked by sequence 2
    assert pool.cached_pages == 3 and pool.prefix_cache.evictable_pages == 1 and pool.free_pages == 5
    pool.free(2)
    assert pool.free_pages == 8 and pool_pages_accounted(pool)


def test_pool_cache_prefix_replaces_duplicate_pages():
    pool = make_pool()
    for s in (1, 2):  # two sequences compute the same prompt concurrently
        pool.allocate(s, 9)
    own2 = pool.page_table(2).tolist()
    pool.cache_prefix(1, seq(1, 2) + [5])
    pool.cache_prefix(2, seq(1, 2) + [5])
    t1, t2 = pool.page_table(1).tolist(), pool.page_table(2).tolist()
    assert t2[:2] == t1[:2] and t2[2] == own2[2]  # sequence 2 now reads sequence 1's cached pages
    assert pool.cached_pages == 2 and pool.free_pages == 8 - 4 and pool_pages_accounted(pool)
    pool.cache_prefix(2, seq(1, 2) + [5])  # nothing new: a no-op
    assert pool.cached_pages == 2 and pool_pages_accounted(pool)
    pool.free(1), pool.free(2)
    assert pool.free_pages == 8 and pool.prefix_cache.evictable_pages == 2


def test_pool_allocation_evicts_unreferenced_cached_pages():
    pool = make_pool(num_pages=6)
    pool.allocate(1, 16)
    pool.cache_prefix(1, seq(1, 2, 3, 4))
    pool.free(1)
    assert pool.cached_pages == 4 and pool.free_pages == 6 and len(pool._free) == 2
    m = pool.prefix_cache.match_prefix(seq(1))
    pool.attach_prefix(2, m)  # locks page 1 of the path
    assert pool.free_pages == 5 and pool.can_allocate(3, 20) and not pool.can_allocate(3, 21)
    pool.allocate(3, 20)  # 5 pages: 2 unused + 3 evicted
    assert pool.cached_pages == 1 and pool.prefix_cache.match_prefix(seq(1, 2)).pages == m.pages
    with pytest.raises(KVCacheFullError):
        pool.allocate(2, 8)
    assert pool_pages_accounted(pool)
    pool.free(2), pool.free(3)
    assert pool.free_pages == 6 and pool_pages_accounted(pool)


def test_pool_without_prefix_caching_is_unchanged():
    pool = PagedKVPool(KVSpec.heads(1, 1, 2), 4, PS, torch.float32, torch.device("cpu"))
    assert pool.prefix_cache is None and pool.cached_pages == 0
    pool.allocate(1, 10)
    pool.cache_prefix(1, seq(1, 2))  # a no-op
    assert pool.free_pages == 1
    with pytest.raises(ValueError, match="prefix caching is off"):
        pool.attach_prefix(2, None)
    pool.free(1)
    assert pool.free_pages == 4
