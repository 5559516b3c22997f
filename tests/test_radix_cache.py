"""Radix prefix cache: matching, splitting, duplicates, locks, LRU eviction, stats, and a brute-force model."""
from __future__ import annotations

import random

import pytest

from serve.radix_cache import PrefixMatch, RadixCache


def test_match_on_empty_tree():
    c = RadixCache(page_size=4)
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert isinstance(m, PrefixMatch)
    assert (m.length, m.pages) == (0, ())
    assert c.match_prefix([]).length == 0
    assert (c.cached_pages, c.evictable_pages) == (0, 0)


def test_insert_then_full_and_partial_match():
    c = RadixCache(page_size=2)
    node, dup = c.insert([1, 2, 3, 4, 5, 6, 7], [10, 11, 12])  # the 7th token is beyond the pages: ignored
    assert dup == []
    assert c.match_prefix([1, 2, 3, 4, 5, 6]) == PrefixMatch(6, (10, 11, 12), node)
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).pages == (10, 11, 12)
    # the partial trailing page is not matched, neither in the query nor against the tree
    m = c.match_prefix([1, 2, 3, 4, 5])
    assert (m.length, m.pages) == (4, (10, 11))
    m = c.match_prefix([1, 2, 3, 9, 5, 6])  # second page differs in its last token
    assert (m.length, m.pages) == (2, (10,))
    assert c.match_prefix([2, 2]).length == 0
    assert c.cached_pages == 3


def test_insert_needs_enough_tokens():
    c = RadixCache(page_size=4)
    with pytest.raises(ValueError):
        c.insert([1, 2, 3, 4, 5], [0, 1])


def test_divergence_inside_edge_splits_at_page_boundary():
    c = RadixCache(page_size=2)
    a, _ = c.insert([1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3])
    b, dup = c.insert([1, 2, 3, 4, 5, 9, 7, 8], [4, 5, 6, 7])  # diverges in the third page
    assert dup == [4, 5]  # the two shared pages were already held
    assert c.cached_pages == 6
    assert c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]) == PrefixMatch(8, (0, 1, 2, 3), a)
    assert c.match_prefix([1, 2, 3, 4, 5, 9, 7, 8]) == PrefixMatch(8, (0, 1, 6, 7), b)
    m = c.match_prefix([1, 2, 3, 4, 5, 0])
    assert (m.length, m.pages) == (4, (0, 1))
    # the shared prefix is now its own node, parent of both branches
    assert m.node is a.parent is b.parent
    # the edge of `a` was split, not replaced: the old handle still names the same path end
    c.lock(a)
    assert c.evictable_pages == 2  # only b's branch
    assert sorted(c.evict(100)) == [6, 7]


def test_match_ending_inside_edge_splits_so_lock_is_exact():
    c = RadixCache(page_size=2)
    c.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    m = c.match_prefix([1, 2, 3, 4])
    assert m.pages == (0, 1)
    c.lock(m.node)
    assert (c.cached_pages, c.evictable_pages) == (3, 1)
    assert c.evict(10) == [2]
    c.unlock(m.node)
    assert sorted(c.evict(10)) == [0, 1]


def test_split_of_a_locked_edge_keeps_it_locked():
    c = RadixCache(page_size=2)
    a, _ = c.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    c.lock(a)
    c.insert([1, 2, 3, 4, 9, 9], [3, 4, 5])  # splits a's edge after two pages
    assert (c.cached_pages, c.evictable_pages) == (4, 1)
    assert c.evict(100) == [5]
    c.unlock(a)
    assert c.evictable_pages == 3
    assert sorted(c.evict(100)) == [0, 1, 2]


def test_duplicate_insert_returns_duplicate_pages():
    c = RadixCache(page_size=2)
    c.insert([1, 2, 3, 4], [0, 1])
    node, dup = c.insert([1, 2, 3, 4, 5, 6], [7, 8, 9])
    assert dup == [7, 8]
    assert c.match_prefix([1, 2, 3, 4, 5, 6]) == PrefixMatch(6, (0, 1, 9), node)
    assert c.cached_pages == 3
    # re-inserting with the tree's own pages (a request that matched, then caches its whole sequence) frees nothing
    node2, dup = c.insert([1, 2, 3, 4, 5, 6, 10, 11], [0, 1, 9, 12])
    assert dup == []
    assert node2.parent is node
    assert c.cached_pages == 4


def test_lock_protects_from_eviction_and_unlock_reenables():
    c = RadixCache(page_size=2)
    a, _ = c.insert([1, 2, 3, 4], [0, 1])
    c.insert([5, 6], [2])
    c.lock(a)
    c.lock(a)  # two requests on the same path
    assert (c.cached_pages, c.evictable_pages) == (3, 1)
    assert c.evict(3) == [2]
    assert c.evict(3) == []
    c.unlock(a)
    assert c.evict(3) == []  # still held by the second lock
    c.unlock(a)
    assert c.evictable_pages == 2
    assert c.evict(1) == [0, 1]  # a whole leaf goes, even past the request
    with pytest.raises(ValueError):
        c.unlock(a)


def test_unlock_below_zero_and_stale_handles():
    c = RadixCache(page_size=2)
    a, _ = c.insert([1, 2], [0])
    with pytest.raises(ValueError):
        c.unlock(a)
    assert c.evict(1) == [0]
    with pytest.raises(ValueError):
        c.lock(a)  # evicted: locking it would protect nothing
    b, _ = c.insert([1, 2, 3, 4], [5, 6])
    c.reset()
    with pytest.raises(ValueError):
        c.lock(b)


def test_locking_a_child_locks_ancestors():
    c = RadixCache(page_size=2)
    c.insert([1, 2, 3, 4], [0, 1])
    leaf, _ = c.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    c.insert([1, 2, 9, 9], [0, 3])
    c.lock(leaf)
    assert c.evictable_pages == 1
    assert c.evict(10) == [3]


def test_lru_order_older_leaf_first_parent_after_children():
    c = RadixCache(page_size=2)
    c.insert([1, 2, 3, 4], [0, 1])       # shared [1,2] -> 0, then branch [3,4] -> 1
    c.insert([1, 2, 5, 6], [0, 2])       # branch [5,6] -> 2
    c.insert([7, 8], [3])                # separate leaf
    c.match_prefix([1, 2, 3, 4])         # touches 0 and 1: now [5,6] and [7,8] are older
    assert c.evict(1) == [2]             # older of the two branch leaves
    assert c.evict(1) == [3]
    assert c.evict(1) == [1]             # the child goes before its parent...
    assert c.evict(1) == [0]             # ...which then became an evictable leaf
    assert c.cached_pages == 0


def test_match_refreshes_lru():
    c = RadixCache(page_size=2)
    c.insert([1, 2], [0])
    c.insert([3, 4], [1])
    assert c.evict(1) == [0]
    c.insert([1, 2], [2])
    c.match_prefix([3, 4, 5])             # refreshes page 1: page 2 is now older
    assert c.evict(1) == [2]


def test_evict_more_than_available_returns_what_it_can():
    c = RadixCache(page_size=4)
    locked, _ = c.insert(list(range(8)), [0, 1])
    c.insert(list(range(4)) + [9, 9, 9, 9], [0, 2])
    c.insert([5] * 4, [3])
    c.lock(locked)
    assert sorted(c.evict(100)) == [2, 3]
    assert (c.cached_pages, c.evictable_pages) == (2, 0)
    assert c.evict(0) == []


def test_counts_and_reset():
    c = RadixCache(page_size=2)
    a, _ = c.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    c.insert([1, 2, 7, 7], [0, 3])
    assert (c.cached_pages, c.evictable_pages) == (4, 4)
    c.lock(a)
    assert (c.cached_pages, c.evictable_pages) == (4, 1)
    with pytest.raises(ValueError):
        c.reset()
    assert c.cached_pages == 4  # a refused reset changes nothing
    c.unlock(a)
    assert sorted(c.reset()) == [0, 1, 2, 3]
    assert (c.cached_pages, c.evictable_pages) == (0, 0)
    assert c.match_prefix([1, 2, 3, 4]).length == 0


def test_stats_and_hit_rate():
    c = RadixCache(page_size=2)
    assert c.stats == {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": 0.0}
    c.record_request(100, 0)
    c.record_request(300, 200)
    assert c.stats == {"requests": 2, "prompt_tokens": 400, "cached_tokens": 200, "hit_rate": 0.5}
    c.record_request(0, 0)
    assert c.stats["requests"] == 3
    with pytest.raises(ValueError):
        c.record_request(10, 11)
    c.reset()
    assert c.stats["cached_tokens"] == 200  # counters are cumulative, like the Prometheus ones


class _Model:
    """Brute force: every cached page keyed by the whole token prefix it ends (prefix-closed)."""

    def __init__(self, ps: int):
        self.ps = ps
        self.page_of: dict[tuple[int, ...], int] = {}

    def match(self, toks: list[int]) -> list[int]:
        pages = []
        while len(toks) >= (len(pages) + 1) * self.ps:
            p = self.page_of.get(tuple(toks[:(len(pages) + 1) * self.ps]))
            if p is None:
                break
            pages.append(p)
        return pages

    def insert(self, toks: list[int], pages: list[int]) -> list[int]:
        dup = []
        for j, p in enumerate(pages):
            held = self.page_of.setdefault(tuple(toks[:(j + 1) * self.ps]), p)
            if held != p:
                dup.append(p)
        return dup

    def remove(self, pages: list[int]) -> None:
        gone = set(pages)
        self.page_of = {k: p for k, p in self.page_of.items() if p not in gone}
        for k in self.page_of:  # only whole subtrees can have gone: the model stays prefix-closed
            assert len(k) == self.ps or k[:-self.ps] in self.page_of


@pytest.mark.parametrize("ps,seed", [(2, 0), (2, 1), (4, 2), (4, 3), (1, 4)])
def test_random_against_brute_force(ps: int, seed: int):
    rng = random.Random(seed)
    c, model = RadixCache(ps), _Model(ps)
    next_page = 0
    locks: list[tuple[object, list[int]]] = []  # handle, the pages its path holds

    def seq() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randrange(0, 7 * ps))]

    def check_match(toks: list[int]) -> PrefixMatch:
        m = c.match_prefix(toks)
        want = model.match(toks)
        assert m.pages == tuple(want), (toks, m, want)
        assert m.length == len(want) * ps
        return m

    for _ in range(600):
        op = rng.random()
        if op < 0.4:
            toks = seq()
            pages = list(range(next_page, next_page + rng.randrange(len(toks) // ps + 1)))
            next_page += len(pages)
            if rng.random() < 0.5:  # as a finished request would: reuse the pages it matched
                held = model.match(toks)[:len(pages)]
                pages[:len(held)] = held
            node, dup = c.insert(toks, pages)
            assert dup == model.insert(toks, pages)
            assert c.match_prefix(toks[:len(pages) * ps]).node is node
            if rng.random() < 0.3:  # a request still running holds what it cached (chunked prefill)
                c.lock(node)
                locks.append((node, model.match(toks[:len(pages) * ps])))
        elif op < 0.75:
            m = check_match(seq())
            if rng.random() < 0.3:
                c.lock(m.node)
                locks.append((m.node, list(m.pages)))
        elif op < 0.85 and locks:
            c.unlock(locks.pop(rng.randrange(len(locks)))[0])
        else:
            want = rng.randrange(0, 6)
            before = c.evictable_pages
            freed = c.evict(want)
            locked = {p for _, held in locks for p in held}
            assert not set(freed) & locked
            assert len(set(freed)) == len(freed) and set(freed) <= set(model.page_of.values())
            assert len(freed) >= min(want, before)
            model.remove(freed)
        locked = {p for _, held in locks for p in held}
        assert c.cached_pages == len(model.page_of)
        assert c.evictable_pages == len(model.page_of) - len(locked)
        # every still-cached inserted sequence matches up to exactly what the model holds
        for toks in [list(k) for k in model.page_of][:20]:
            check_match(toks)

    for node, _ in locks:
        c.unlock(node)
    assert sorted(c.reset()) == sorted(model.page_of.values())
