"""Radix prefix cache: page-aligned token prefixes -> page ids of the paged KV pool. Pure Python.

Page j of a request holds its tokens [j*page_size, (j+1)*page_size); only whole pages are cached.

Design (and why):
- Edges hold whole pages. Children are keyed by their first page (a tuple of page_size tokens) and edges are
  compared page by page, so a page matches only if all its tokens do. Inputs are cut to a multiple of page_size.
  This is SGLang's layout for page_size > 1 (`srt/mem_cache/radix_cache.py`).
- Splits keep handles valid. When an insert diverges inside an edge, or a match ends inside one, a new node is put
  *above* the split point and the existing node object keeps the tail, so a handle a request holds still names the
  same path end. Splitting on match (as SGLang does) lets `lock` protect exactly the matched pages, no more.
- A lock counts on the whole path to the root (a running request reads every page of its prefix), so a node is
  never less locked than its descendants, and only unlocked leaves are evicted. The root is never locked.
- LRU stamps come from a monotonic operation counter, not wall time, so eviction order is deterministic. Every node
  on a touched path gets the same stamp, so a parent is never older than its children and goes after them.
- `duplicate_pages` from `insert` leaves out pages equal to the tree's own page at that position: a request that
  matched a prefix and then inserts its whole sequence passes those same pages back, and they must not be freed.
- Page counts are kept incrementally (the scheduler reads them every step); `evict` scans the tree for leaves,
  which is O(nodes) but runs only under memory pressure.
- ``on_evict(tokens, pages)`` hears of each evicted leaf before its pages are handed out again: ``pages`` are the
  last pages of ``tokens``, the leaf's whole prefix (the hierarchical cache copies them to the host: serve/hicache.py).
- A handle stays valid until its node is evicted or the cache reset; `lock` refuses a detached one. Lock right after
  `match_prefix`. Not thread-safe: the scheduler loop owns the cache.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence


class _Node:
    __slots__ = ("key", "pages", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: _Node | None, last_access: int = 0):
        self.key = key  # the edge's tokens, len(pages) * page_size of them
        self.pages = pages
        self.parent = parent  # None for the root and for detached (evicted) nodes
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first page
        self.lock_ref = 0
        self.last_access = last_access


@dataclass(frozen=True)
class PrefixMatch:
    length: int  # tokens matched, a multiple of page_size
    pages: tuple[int, ...]
    node: _Node  # opaque handle for lock/unlock


class RadixCache:
    def __init__(self, page_size: int, on_evict: Callable[[tuple[int, ...], list[int]], None] | None = None):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.on_evict = on_evict
        self._root = _Node((), [], None)
        self._clock = 0
        self._cached = 0
        self._evictable = 0
        self._requests = self._prompt_tokens = self._cached_tokens = 0

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        node, pages = self._descend(self._aligned(tokens, len(tokens)))
        return PrefixMatch(len(pages) * self.page_size, tuple(pages), node)

    def prefix_length(self, tokens: Sequence[int]) -> int:
        """The tokens ``match_prefix`` would match, leaving the tree and its LRU clock untouched."""
        return len(self._descend(self._aligned(tokens, len(tokens)), probe=True)[1]) * self.page_size

    def lock(self, node: _Node) -> None:
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: _Node) -> None:
        path = self._path(node)
        if path and path[0].lock_ref == 0:  # ancestors hold at least the node's count
            raise ValueError("unlock of a node that is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.pages)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[_Node, list[int]]:
        ps = self.page_size
        if len(tokens) < len(pages) * ps:
            raise ValueError(f"{len(pages)} pages need {len(pages) * ps} tokens, got {len(tokens)}")
        toks = self._aligned(tokens, len(pages) * ps)
        node, held = self._descend(toks)
        duplicates = [p for p, h in zip(pages, held) if p != h]
        if len(pages) > len(held):
            leaf = _Node(toks[len(held) * ps:], list(pages[len(held):]), node, self._clock)
            node.children[leaf.key[:ps]] = leaf
            self._cached += len(leaf.pages)
            self._evictable += len(leaf.pages)
            node = leaf
        return node, duplicates

    def evict(self, num_pages: int) -> list[int]:
        tie = itertools.count()  # heap tiebreak, so nodes are never compared
        heap = [(n.last_access, next(tie), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            assert parent is not None
            if self.on_evict is not None:
                self.on_evict(self._prefix(leaf), leaf.pages)
            del parent.children[leaf.key[:self.page_size]]
            leaf.parent = None
            freed += leaf.pages
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        self._cached -= len(freed)
        self._evictable -= len(freed)
        return freed

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def cached_pages(self) -> int:
        return self._cached

    def reset(self) -> list[int]:
        if any(c.lock_ref for c in self._root.children.values()):
            raise ValueError("cannot reset the radix cache while requests hold locks")
        freed = [p for n in self._nodes() for p in n.pages]
        for child in self._root.children.values():
            child.parent = None  # detaches every old handle (its path no longer reaches the root)
        self._root.children = {}
        self._cached = self._evictable = 0
        return freed

    def record_request(self, prompt_tokens: int, cached_tokens: int) -> None:
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(f"need 0 <= cached_tokens ({cached_tokens}) <= prompt_tokens ({prompt_tokens})")
        self._requests += 1
        self._prompt_tokens += prompt_tokens
        self._cached_tokens += cached_tokens

    @property
    def stats(self) -> dict[str, int | float]:
        hit_rate = self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0
        return {"requests": self._requests, "prompt_tokens": self._prompt_tokens,
                "cached_tokens": self._cached_tokens, "hit_rate": hit_rate}

    # -- helpers --

    def _aligned(self, tokens: Sequence[int], n: int) -> tuple[int, ...]:
        return tuple(map(int, tokens[:n - n % self.page_size]))

    def _descend(self, toks: tuple[int, ...], probe: bool = False) -> tuple[_Node, list[int]]:
        """Follow `toks` (page-aligned) as far as the tree holds it, splitting the last edge if the match ends
        inside it, and stamp the path. Returns the end node and the pages along the path. ``probe``: only
        the pages (no split, no stamp; the node is the last one passed whole)."""
        ps = self.page_size
        self._clock += not probe
        node, pages, i = self._root, [], 0
        while i < len(toks):
            child = node.children.get(toks[i:i + ps])
            if child is None:
                break
            n = ps  # the first page matched through the dict key
            while n < len(child.key) and i + n < len(toks) and child.key[n:n + ps] == toks[i + n:i + n + ps]:
                n += ps
            if n < len(child.key):
                if probe:
                    pages += child.pages[:n // ps]
                    break
                child = self._split(child, n)
            if not probe:
                child.last_access = self._clock
            pages += child.pages
            node, i = child, i + n
        return node, pages

    def _split(self, child: _Node, n: int) -> _Node:
        """Put a new node holding the first n tokens of child's edge above child; child keeps the rest."""
        ps, parent = self.page_size, child.parent
        assert parent is not None
        mid = _Node(child.key[:n], child.pages[:n // ps], parent, child.last_access)
        mid.lock_ref = child.lock_ref
        parent.children[mid.key[:ps]] = mid
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps:], mid
        mid.children[child.key[:ps]] = child
        return mid

    def _prefix(self, node: _Node) -> tuple[int, ...]:
        """The tokens from the root to the end of ``node``'s edge."""
        return tuple(t for n in reversed(self._path(node)) for t in n.key)

    def _path(self, node: _Node) -> list[_Node]:
        """node and its ancestors, root excluded; ValueError if node is no longer in this tree."""
        path = []
        n: _Node | None = node
        while n is not self._root:
            if n is None:
                raise ValueError("node is not in this cache (evicted or reset)")
            path.append(n)
            n = n.parent
        return path

    def _nodes(self) -> Iterator[_Node]:
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())
