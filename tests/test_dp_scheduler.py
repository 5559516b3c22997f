"""DP attention in the scheduler: each rank owns its slots, pages and prefix cache; placement
by a router's rank, then prefix affinity, then the shortest queue (host only, no model)."""
from __future__ import annotations

import itertools

import pytest

from serve.request import Request
from serve.sampling import SamplingParams
from serve.scheduler import Scheduler

PAGE, WINDOW = 4, 8
_ids = itertools.count()


def _sched(dp: int = 2, slots: int = 4, pages: int = 32, prefix_cache: bool = True) -> Scheduler:
    return Scheduler(slots, PAGE, pages, prefill_budget=256, window=WINDOW, max_len=128,
                     prefix_cache=prefix_cache, dp=dp)


def _req(prompt: list[int], dp_rank: int | None = None, new: int = 4) -> Request:
    return Request(f"r{next(_ids)}", prompt, SamplingParams(max_new_tokens=new), 0, dp_rank=dp_rank)


def _admit(s: Scheduler, *reqs: Request) -> list:
    for r in reqs:
        s.submit(r)
    return s.schedule()


def _finish(s: Scheduler, req: Request) -> None:
    """As the engine does when a request's prefill landed and it stopped."""
    req.computed = len(req.ids)
    req.finish_reason = "length"
    s.release(req, cache=True)


def _owns(s: Scheduler, req: Request) -> bool:
    slots, pages = s.max_running // len(s.ranks), s.ranks[0].pool.num_pages
    return req.slot // slots == req.rank and all(p // pages == req.rank for p in req.pages)


def test_requests_spread_over_ranks_and_stay_in_their_ranges():
    s = _sched()
    reqs = [_req(list(range(100 * i, 100 * i + 10))) for i in range(4)]
    _admit(s, *reqs)
    assert sorted(r.rank for r in reqs) == [0, 0, 1, 1]   # shortest queue alternates
    assert all(_owns(s, r) for r in reqs)
    assert s.free_slots == 0
    for r in reqs:
        _finish(s, r)
    assert s.used_pages == 0 and s.free_slots == 4


def test_a_cached_prefix_draws_its_request_to_its_rank():
    s = _sched()
    shared = list(range(1, 33))   # 8 pages, longer than the window
    first = _req(shared + [40, 41])
    _admit(s, first)
    home = first.rank
    _finish(s, first)
    _admit(s, _req(list(range(500, 510)), dp_rank=home))   # the home rank is now the busier one
    again = _req(shared + [50, 51, 52])
    _admit(s, again)
    assert again.rank == home and again.cached_tokens == 32 and _owns(s, again)
    assert s.ranks[home].radix.stats["cached_tokens"] == 32
    assert s.ranks[1 - home].radix.stats["cached_tokens"] == 0
    elsewhere = _req(list(range(600, 640)))   # no hit anywhere: the shortest queue
    _admit(s, elsewhere)
    assert elsewhere.rank == 1 - home


def test_a_cached_prefix_does_not_pile_requests_on_one_rank():
    s = _sched(slots=16, pages=64)
    system = list(range(1, 33))   # a shared system prompt past the window, cached on one rank
    first = _req(system + [99])
    _admit(s, first)
    home = first.rank
    _finish(s, first)
    ranks = []
    for i in range(8):
        req = _req(system + [100 + i])
        _admit(s, req)
        ranks.append(req.rank)
    # affinity while the home rank is at most 2 requests (or half again) busier, then the other
    assert ranks[:3] == [home] * 3 and ranks.count(1 - home) >= 3, ranks


def test_probing_a_rank_leaves_its_cache_and_lru_order_alone():
    s = _sched(dp=1)
    older, newer = list(range(1, 35)), list(range(100, 134))   # 8 full pages cached each
    for prompt in (older, newer):
        req = _req(prompt)
        _admit(s, req)
        _finish(s, req)
    radix = s.ranks[0].radix
    assert radix.prefix_length(older[:19]) == 16   # page-aligned, ending inside an edge
    assert radix.prefix_length([9, 9, 9, 9]) == 0
    assert radix.evictable_pages == 16
    radix.evict(8)   # the least recently used branch goes: still the older one
    assert radix.prefix_length(older) == 0 and radix.prefix_length(newer) == 32


def test_a_named_rank_is_kept_even_when_busier():
    s = _sched()
    a, b = _req(list(range(10)), dp_rank=1), _req(list(range(20, 30)), dp_rank=1)
    _admit(s, a, b)
    assert a.rank == b.rank == 1
    c = _req(list(range(40, 50)), dp_rank=1)   # rank 1 has no free slot left: c waits for it
    d = _req(list(range(60, 70)))              # ... but does not hold up a request behind it
    chunks = _admit(s, c, d)
    assert c.rank is None and c in s.waiting and not any(ch.req is c for ch in chunks)
    assert d.rank == 0
    _finish(s, a)
    s.schedule()
    assert c.rank == 1


def test_retraction_frees_the_rank_that_ran_out():
    s = _sched(pages=8, prefix_cache=False)   # 4 pages (16 tokens) a rank
    long, short = _req(list(range(10)), new=6), _req([5, 6, 7], new=2)
    _admit(s, long, short)
    assert (long.rank, short.rank) == (0, 1)
    late = _req(list(range(30, 33)), dp_rank=0, new=8)
    _admit(s, late)
    assert late.rank == 0 and len(s.ranks[0].pool.free) == 0 and len(s.ranks[1].pool.free) == 3
    long.output += [1, 1, 1]   # its next decode needs a fourth page of rank 0: none is free
    for r in (long, short, late):
        r.computed = len(r.ids) - 1
    newest = _req([8, 9], dp_rank=1, new=2)   # admitted after ``late``, on the other rank
    _admit(s, newest)
    newest.computed = len(newest.ids) - 1
    assert s.schedule() is None and s.starved is s.ranks[0]
    assert s.victim() is late   # the most recent on the rank that ran out, not ``newest``


def test_a_request_must_fit_one_rank():
    s = _sched(pages=8)
    with pytest.raises(ValueError, match="per DP rank"):
        s.submit(_req(list(range(15)), new=8))   # 23 tokens: 6 pages, a rank has 4


def test_slots_and_pages_must_split_evenly():
    with pytest.raises(ValueError, match="DP ranks"):
        Scheduler(3, PAGE, 8, 64, WINDOW, 128, True, dp=2)
