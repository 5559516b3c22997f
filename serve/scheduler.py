"""Continuous batching over a paged V4.1 cache: admission, chunked prefill, decode, retraction.

Each step the scheduler plans a ragged batch:

1. every running request past its prefill decodes one token (a speculative one: its last
   token and the drafts proposed after it, one step in flight at most);
2. requests in the middle of a prefill continue, then waiting requests are admitted while
   slots, the per-step token budget (decodes included) and pages allow (chunked prefill), in a
   fair share between client requests: the next is the waiting one whose client request (its
   ``group``: the ``n`` samples of one call) has the fewest samples running, first come first
   among equals; and no client request holds more than ``max_running - 1`` slots, so one is
   always free for the next caller. SGLang and vLLM admit first come, first served, where one
   request with a large ``n`` holds every slot until it is done (a newcomer waits for a whole
   sample); here it takes turns with the requests behind it, at the cost of one batch row while
   it runs alone;
3. pages are taken from the free list, then from the radix cache's unlocked leaves (LRU);
   if a decode still cannot get a page, the most recently admitted request is retracted
   (its pages freed, requeued at the front; its generated tokens are recomputed, and its
   seeds are keyed by position, so the output does not change).

Prefix hits (MODEL_SPEC §6): on admission the prompt is matched against the radix cache;
a page-aligned hit longer than the window is adopted and the request restarts ``window``
tokens before the hit end (encoder replay rebuilds the window rings there; the cached
compressed entries are kept). A request needs a slot (its window rings and tails) and
pages (its compressed KV), which is the layout of ``model.state``.

DP attention (``dp`` > 1, ``sharding.mesh``): the device state is split over ``data`` on its
first axis, so slots and pages come in ``dp`` equal contiguous ranges, one per rank. A
``DpRank`` owns its range of each, and its own radix cache over its pages: a request lives on
one rank, and retraction frees memory on the rank that ran out. A new request goes to the rank
a router named (``data_parallel_rank``, as SGLang's gateway sends in its ``dp-aware`` mode),
else to the rank holding its longest cached prefix (past the window), else to the rank with
the fewest requests (shortest queue), then the most free pages.

Hierarchical cache (``hicache``, serve/hicache.py): a rank's radix cache hands the pages it evicts
to the host tier; a waiting request is admitted once its storage prefetch allows (``HiCache.ready``);
at admission the pages after the device's prefix that the host tier holds are loaded into fresh
pages and join the rank's radix tree (``_promote``), so the hit is then an ordinary device hit; and
committed or hit pages are reported (``HiCache.used``) for the write policy.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serve.radix_cache import RadixCache
from serve.request import Request

if TYPE_CHECKING:   # the scheduler stays pure Python
    from serve.hicache import HiCache


class PagePool:
    def __init__(self, pages: range):
        self.free = list(reversed(pages))
        self.num_pages = len(pages)

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = self.free[len(self.free) - n:]
        del self.free[len(self.free) - n:]
        return out

    def give(self, pages) -> None:
        self.free.extend(pages)


class DpRank:
    """One DP rank's share of the engine: its slots, its pages and its prefix cache over them."""

    def __init__(self, index: int, slots: range, pages: range, page_size: int, prefix_cache: bool,
                 hicache: HiCache | None = None):
        self.index = index
        self.free_slots = list(reversed(slots))
        self.pool = PagePool(pages)
        self.radix = RadixCache(page_size, None if hicache is None else hicache.demote) if prefix_cache else None

    def grab(self, n: int) -> list[int] | None:
        pages = self.pool.take(n)
        if pages is None and self.radix is not None:
            self.pool.give(self.radix.evict(n - len(self.pool.free)))
            pages = self.pool.take(n)
        return pages

    @property
    def evictable(self) -> int:
        return self.radix.evictable_pages if self.radix is not None else 0

    @property
    def used_pages(self) -> int:
        return self.pool.num_pages - len(self.pool.free) - self.evictable


@dataclass
class Chunk:
    req: Request
    start: int  # first position fed
    n: int  # tokens fed
    samples: bool  # the chunk reaches the request's last known token: sample the next one
    fresh: bool  # the request was admitted in this step (its slot fields must be reset)
    drafts: tuple[int, ...] = ()  # a speculative decode's drafts, fed after its last token


def _needs_flight(req: Request) -> bool:
    """Its next step needs the step in flight: its next drafts, or its grammar's next mask."""
    return (req.grammar is not None or req.spec) and req.inflight > 0


class Scheduler:
    def __init__(self, max_running: int, page_size: int, num_pages: int, prefill_budget: int, window: int,
                 max_len: int, prefix_cache: bool, fixed_verify: bool = False, dp: int = 1,
                 hicache: HiCache | None = None):
        self.page_size, self.window, self.max_len = page_size, window, max_len
        self.prefill_budget, self.max_running = prefill_budget, max_running
        self.fixed_verify = fixed_verify  # verify every draft, even past max_new_tokens (benchmarks)
        if max_running % dp or num_pages % dp:
            raise ValueError(f"{max_running} slots and {num_pages} pages do not split over {dp} DP ranks")
        slots, pages = max_running // dp, num_pages // dp
        self.hicache = hicache if prefix_cache else None
        self.ranks = [DpRank(r, range(r * slots, (r + 1) * slots), range(r * pages, (r + 1) * pages), page_size,
                             prefix_cache, self.hicache) for r in range(dp)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admissions = 0
        self.retractions = 0
        self.starved: DpRank | None = None  # the rank whose decode found no page (``schedule`` returned None)

    def rank_of(self, req: Request) -> DpRank:
        return self.ranks[req.rank]

    # ------------------------------------------------------------------ pages
    def _reserve(self, req: Request, upto: int) -> bool:
        """Own pages covering positions ``< upto``."""
        need = -(-upto // self.page_size) - len(req.pages)
        if need <= 0:
            return True
        pages = self.rank_of(req).grab(need)
        if pages is None:
            return False
        req.pages += pages
        return True

    @property
    def used_pages(self) -> int:
        return sum(r.used_pages for r in self.ranks)

    @property
    def free_slots(self) -> int:
        return sum(len(r.free_slots) for r in self.ranks)

    # ------------------------------------------------------------------ lifecycle
    def submit(self, req: Request) -> None:
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """ValueError when ``req`` can never run here (too long for the context or a rank's pages)."""
        total = len(req.prompt) + req.params.max_new_tokens
        if total > self.max_len:
            raise ValueError(f"prompt of {len(req.prompt)} tokens plus max_new_tokens "
                             f"{req.params.max_new_tokens} exceeds the context length {self.max_len}")
        per_rank = self.ranks[0].pool.num_pages
        if -(-total // self.page_size) > per_rank:
            where = f"{per_rank} pages" + (" per DP rank" if len(self.ranks) > 1 else "")
            raise ValueError(f"the page pool ({where}) cannot hold a request of {total} tokens")

    def reserve(self, n: int, dp_rank: int | None) -> tuple[int, list[int]] | None:
        """``n`` pages set aside on a rank (``dp_rank``, else the one with the most room) for a prompt
        whose state arrives later (disaggregated decode); None while no rank has them."""
        ranks = [r for r in self.ranks if dp_rank in (None, r.index)]
        rank = max(ranks, key=lambda r: (len(r.pool.free) + r.evictable, -r.index))
        if len(rank.pool.free) + rank.evictable < n:
            return None   # (evicting now would empty the prefix cache for a grab that still fails)
        return rank.index, rank.grab(n) if n else []

    def unreserve(self, rank: int, pages: list[int]) -> None:
        self.ranks[rank].pool.give(pages)

    def adopt(self, req: Request, rank: int, pages: list[int]) -> None:
        """Queue ``req`` on ``rank`` with ``pages`` (reserved there) holding its prompt's first whole
        pages: they join the rank's radix cache, held until its admission matches them (a prefix
        hit, encoder replay included)."""
        self.check(req)
        req.dp_rank = rank
        if pages:
            radix = self.ranks[rank].radix
            node, dup = radix.insert(req.prompt[:len(pages) * self.page_size], pages)
            self.ranks[rank].pool.give(dup)
            radix.lock(node)
            req.held_node = node
        self.waiting.append(req)

    def _unhold(self, req: Request) -> None:
        if req.held_node is not None:
            self.ranks[req.dp_rank].radix.unlock(req.held_node)
            req.held_node = None

    def discard(self, req: Request) -> None:
        """Drop a waiting request that ended before admission (aborted)."""
        self._unhold(req)
        self.waiting.remove(req)

    def release(self, req: Request, cache: bool) -> None:
        """Free a request's slot and pages; with ``cache`` its full pages go to the radix cache."""
        if req.rank is not None:
            rank = self.rank_of(req)
            pages = req.pages[req.shared_pages:]  # the prefix-hit pages belong to the radix cache
            if rank.radix is not None:
                if cache:
                    full = min(req.computed, len(req.ids)) // self.page_size
                    _, dup = rank.radix.insert(req.ids[:full * self.page_size], req.pages[:full])
                    rank.pool.give(dup)
                    if self.hicache is not None:
                        self.hicache.used(self._keys(req, req.ids[:full * self.page_size]), req.pages[:full],
                                          req.shared_pages)
                    pages = req.pages[max(full, req.shared_pages):]
                if req.radix_node is not None:
                    rank.radix.unlock(req.radix_node)
            rank.pool.give(pages)
            rank.free_slots.append(req.slot)
        req.pages, req.radix_node, req.shared_pages = [], None, 0
        req.slot = req.rank = None
        if req in self.running:
            self.running.remove(req)

    def retract(self, req: Request) -> None:
        self.release(req, cache=False)
        req.computed, req.cached_tokens, req.drafts = 0, 0, []
        self.retractions += 1
        self.waiting.appendleft(req)

    def _usable(self, req: Request) -> list[int] | None:
        """The prompt tokens a prefix hit may cover (None: no hit allowed)."""
        # A hit skips the prompt rows before it, which the repetition penalty would have to see: no hit then.
        if req.params.repetition_penalty != 1.0:
            return None
        return req.ids[:(len(req.ids) - 1) // self.page_size * self.page_size]  # always compute the last token

    def _place(self, req: Request, budget: int, full: set[int]) -> DpRank | None:
        """The rank to admit ``req`` on now (module docstring), or None when none can take it. A
        cached prefix draws it only to a rank that is not much busier than the least busy one
        (at most 2 requests more, or half as many again), so a shared system prompt cannot pile
        every request onto the rank that cached it first."""
        first_pages = -(-min(len(req.ids), budget) // self.page_size)
        fits = [r for r in self.ranks if r.free_slots and r.index not in full and req.dp_rank in (None, r.index)
                and first_pages <= len(r.pool.free) + r.evictable]
        if len(fits) < 2:
            return fits[0] if fits else None
        usable = self._usable(req)
        load = {r.index: 0 for r in self.ranks}
        for other in self.running:
            load[other.rank] += 1
        least = min(load[r.index] for r in fits)

        def hit(r: DpRank) -> int:
            if not usable or r.radix is None or load[r.index] > max(least + 2, 1.5 * least):
                return 0
            n = r.radix.prefix_length(usable)
            return n if n > self.window else 0
        return min(fits, key=lambda r: (-hit(r), load[r.index], -len(r.pool.free), r.index))

    def _admit(self, req: Request, rank: DpRank) -> int:
        """Give ``req`` a slot on ``rank`` and its prefix hit there; the first position to compute."""
        req.rank, req.slot = rank.index, rank.free_slots.pop()
        req.admitted_at = self._admissions
        self._admissions += 1
        req.admissions += 1
        req.recount_upto = len(req.ids)
        start = 0
        radix = rank.radix
        if radix is not None and (usable := self._usable(req)) is not None:
            tiers = self._promote(rank, req, usable) if self.hicache is not None else None
            m = radix.match_prefix(usable)
            if m.length > self.window:
                radix.lock(m.node)
                req.radix_node, req.pages, req.shared_pages = m.node, list(m.pages), len(m.pages)
                if req.held_node is None:   # received pages (disaggregation) were computed, not cached
                    req.cached_tokens = min(m.length, len(req.prompt))
                start = m.length - self.window
                if tiers is not None:
                    if req.admissions == 1:   # a retracted request's readmission is not a new hit
                        self.hicache.record_hit(**tiers)
                    self.hicache.used(self._keys(req, usable), m.pages)
        self._unhold(req)   # its match holds the pages now
        if radix is not None and req.admissions == 1:
            radix.record_request(len(req.prompt), req.cached_tokens)
        req.computed = start
        self.running.append(req)
        return start

    def _keys(self, req: Request, tokens: list[int]) -> list[bytes]:
        """The page keys of ``tokens`` (a prefix of ``req.ids``), hashed once a request: each call
        extends the keys it kept."""
        n = len(tokens) // self.page_size
        if len(req.page_keys) < n:
            req.page_keys = self.hicache.keys(tokens, req.page_keys)
        return req.page_keys[:n]

    def _promote(self, rank: DpRank, req: Request, usable: list[int]) -> dict[str, int]:
        """Load the pages after the device's prefix of ``usable`` that the host tier holds into fresh
        pages of ``rank`` and add them to its radix tree (as many as its pages allow, and only if the
        hit then passes the window); the hit's pages by the tier they came from."""
        radix, ps = rank.radix, self.page_size
        m = radix.match_prefix(usable)
        found = self.hicache.match(self._keys(req, usable), len(m.pages))
        n = min(len(found), len(rank.pool.free) + rank.evictable - len(m.pages) * (m.node.lock_ref == 0))
        tiers = {"device": len(m.pages), "host": 0, "storage": 0}
        if n <= 0 or (len(m.pages) + n) * ps <= self.window:
            return tiers
        radix.lock(m.node)   # evictions for the new pages must not take the prefix they extend
        pages = rank.grab(n)
        loaded = None if pages is None else self.hicache.load(pages, found[:n])
        if loaded is not None:
            tiers |= loaded
            _, dup = radix.insert(usable[:(len(m.pages) + n) * ps], list(m.pages) + pages)
            rank.pool.give(dup)
        elif pages is not None:   # the copy failed: a miss, its pages back to the pool
            rank.pool.give(pages)
        radix.unlock(m.node)
        return tiers

    def _prefetched(self, req: Request) -> bool:
        """Whether ``req``'s storage prefetch lets it be admitted now (``HiCache.ready``)."""
        if self.hicache is None or self.hicache.storage is None:
            return True
        usable = self._usable(req)
        if not usable:
            return True
        # the shortest rank's prefix: whichever rank the request lands on, the prefetched pages follow it
        local = min((r.radix.prefix_length(usable) for r in self.ranks), default=0) // self.page_size
        return self.hicache.ready(req.rid, self._keys(req, usable), local)

    # ------------------------------------------------------------------ planning
    def waiting_on_flight(self) -> bool:
        """Whether at least half the decoding requests need the step in flight to plan their next
        (their drafts or their grammar's mask). Planned now, they would sit this step out and so
        decode every other step; the engine then lands the step first: the requests that don't
        need it give up the overlap's hidden host time, the majority double its step rate. A few
        such requests (one grammar client among many) keep the overlap for the rest."""
        decoding = [r for r in self.running if not (r.finished or r.prefilling)]
        return bool(decoding) and 2 * sum(map(_needs_flight, decoding)) >= len(decoding)

    def schedule(self) -> list[Chunk] | None:
        """The next step's chunks; None when a decode needs a page that only retraction can free."""
        chunks: list[Chunk] = []
        self.starved = None
        for req in sorted(self.running, key=lambda r: r.admitted_at):
            if req.finished or req.prefilling:
                continue
            if _needs_flight(req):
                continue
            drafts = self._drafts(req)
            if not self._reserve(req, req.computed + 1 + len(drafts)):
                self.starved = self.rank_of(req)
                return None
            chunks.append(Chunk(req, req.computed, 1 + len(drafts), True, False, drafts))
        budget = self.prefill_budget - sum(c.n for c in chunks)  # the step's decodes count (its token bucket)
        full: set[int] = set()   # ranks out of pages this step: their later prefills wait, the others go on
        for req in sorted(self.running, key=lambda r: r.admitted_at):
            if budget <= 0:
                break
            if req.finished or not req.prefilling or req.rank in full:
                continue
            chunk = self._prefill_chunk(req, budget, fresh=False)
            if chunk is None:
                full.add(req.rank)
                continue
            chunks.append(chunk)
            budget -= chunk.n
        passed: set[str] = set()   # waiting requests no rank can take this step (a full named rank)
        while budget > 0 and self.waiting and self.free_slots:
            req = self._next_waiting(passed)
            if req is None:
                break
            if req.finished:
                self.waiting.remove(req)
                continue
            rank = self._place(req, budget, full) if self._prefetched(req) else None
            if rank is None:
                passed.add(req.rid)
                continue
            self.waiting.remove(req)
            self._admit(req, rank)
            chunk = self._prefill_chunk(req, budget, fresh=True)
            if chunk is None:  # could not get pages after all: back to the queue
                full.add(rank.index)
                self.retract(req)
                passed.add(req.rid)
                continue
            chunks.append(chunk)
            budget -= chunk.n
        return chunks

    def _drafts(self, req: Request) -> tuple[int, ...]:
        """The drafts a speculative decode verifies: all, but none past the context length and,
        unless verification is fixed, none that could only follow the last token allowed."""
        room = self.max_len - req.computed - 1
        if not self.fixed_verify:
            room = min(room, req.params.max_new_tokens - len(req.output) - 1)
        return tuple(req.drafts[:max(room, 0)])

    def _next_waiting(self, passed: set[str]) -> Request | None:
        """The fair share's next admission (module docstring, step 2) but for ``passed``, or None."""
        running: dict[str, int] = {}
        for r in self.running:
            if not r.finished:
                running[r.group or r.rid] = running.get(r.group or r.rid, 0) + 1
        cap = max(self.max_running - 1, 1)
        held = [(running.get(r.group or r.rid, 0), i, r) for i, r in enumerate(self.waiting) if r.rid not in passed]
        return min(((n, i, r) for n, i, r in held if n < cap or r.finished), default=(0, 0, None))[2]

    def _prefill_chunk(self, req: Request, budget: int, fresh: bool) -> Chunk | None:
        n = min(budget, len(req.ids) - req.computed)
        if not self._reserve(req, req.computed + n):
            return None
        return Chunk(req, req.computed, n, req.computed + n == len(req.ids), fresh)

    def victim(self) -> Request | None:
        """The request to retract when memory runs out: the most recently admitted one on the
        rank that ran out."""
        live = [r for r in self.running if not r.finished and (self.starved is None or r.rank == self.starved.index)]
        return max(live, key=lambda r: r.admitted_at) if live else None
