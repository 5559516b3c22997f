"""The hierarchical prefix cache (serve/hicache.py): host (L2) and file storage (L3) tiers under the radix cache.

Every engine here has the same shapes (one set of compiled programs) and a device pool of 12 pages of 16
tokens, too small to keep four 60-token prompts: a repeat after the others ran is a device miss. The
reference for a repeat's greedy tokens is the same prompt's device (L1) hit in an engine without tiers.
"""
from __future__ import annotations

import errno
import logging
import os
import time

import jax
import numpy as np
import pytest

from serve.cache_storage import FileStorage
from serve.cli_args import add_engine, add_model, engine_config
from serve.engine import Engine, EngineConfig
from serve.hicache import HiCache, HiCacheConfig
from serve.kv_pages import PageLayout, page_keys
from serve.metrics import Metrics

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
BASE = dict(max_running=2, max_len=96, page_size=16, prefill_budget=64, decoder_replay="off", prefix_cache=True,
            num_pages=12)
HIT = 48   # a repeat's cached tokens: the whole pages of its 59 usable prompt tokens


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 500, size=60).tolist() for _ in range(4)]


def _engine(tiny, hicache: HiCacheConfig | None = None, kv_cache_dtype: str = "auto") -> Engine:
    return Engine(tiny.params, tiny.cfg, EngineConfig(**BASE, hicache=hicache, kv_cache_dtype=kv_cache_dtype))


def _run(engine, prompt) -> dict:
    return engine.generate([prompt], GREEDY, decode_text=False)[0]


def _storage(directory, **kw) -> HiCacheConfig:
    return HiCacheConfig(storage_backend="file", storage_dir=str(directory), prefetch_policy="wait_complete",
                         prefetch_threshold=16, **kw)


@pytest.fixture(scope="module")
def l1_hits(tiny, prompts):
    """Each prompt's greedy tokens on its device hit, and a control: without tiers, a repeat after the
    others ran is a miss (the pool is too small)."""
    engine = _engine(tiny)
    out = []
    for p in prompts[:2]:
        _run(engine, p)
        hit = _run(engine, p)
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == HIT
        out.append(hit["output_ids"])
    for p in prompts:
        _run(engine, p)
    assert _run(engine, prompts[0])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out


def _cached(result) -> int:
    return result["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])   # pools of values, or NVFP4 records
def test_host_tier_serves_repeats_the_device_pool_lost(tiny, prompts, l1_hits, kv_cache_dtype):
    engine = _engine(tiny, HiCacheConfig(), kv_cache_dtype)
    for p in prompts:
        _run(engine, p)
    pools = lambda: [np.asarray(x) for m in [engine.runner.state.model]  # noqa: E731
                     for x in jax.tree.leaves((m.comp_kv, m.index_k))]
    before = pools()
    engine.hicache.warmup(8)   # compiles the page copies; its writes land past the pool
    assert all(np.array_equal(a, b) for a, b in zip(before, pools()))
    repeats = [_run(engine, p) for p in prompts[:2]]
    assert [_cached(r) for r in repeats] == [HIT, HIT]
    assert [r["output_ids"] for r in repeats] == l1_hits
    m = engine.load()["hicache"]
    assert m["hit_tokens"]["host"] == 2 * HIT and m["bytes_moved"]["host_to_device"] > 0
    text = Metrics("m").render(engine.load())
    assert f'sglang:hicache_hit_tokens_total{{model_name="m",tier="host"}} {2 * HIT}' in text
    assert engine.scheduler.used_pages == 0


def test_restart_and_a_second_engine_share_the_storage_dir(tiny, prompts, l1_hits, tmp_path):
    first = _engine(tiny, _storage(tmp_path))
    _run(first, prompts[0])
    first.hicache.drain()
    assert len(list(tmp_path.glob("*.page"))) >= HIT // 16
    restarted = _engine(tiny, _storage(tmp_path))   # a fresh process's view: nothing on its device or host
    r = _run(restarted, prompts[0])
    assert _cached(r) == HIT and r["output_ids"] == l1_hits[0]
    assert restarted.load()["hicache"]["hit_tokens"]["storage"] == HIT
    _run(restarted, prompts[1])   # pages written by one live engine, read by the other
    restarted.hicache.drain()
    r = _run(first, prompts[1])
    assert _cached(r) == HIT and r["output_ids"] == l1_hits[1]


def test_a_restarted_server_reports_storage_hits(tiny, prompts, l1_hits, tmp_path):
    """Over HTTP: a server, then a new one on the same directory (what a restart leaves it)."""
    import json

    from serve.server import Server
    from test_server import LiveServer

    body = {"input_ids": prompts[0], "sampling_params": {**GREEDY, "max_new_tokens": 4}}
    replies = []
    for _ in range(2):
        engine = _engine(tiny, _storage(tmp_path))
        live = LiveServer(Server(engine, "tiny", enable_metrics=True))
        try:
            status, text, _ = live.request("/generate", body)
            assert status == 200, text
            replies.append(json.loads(text))
            metrics = live.request("/metrics")[1]
        finally:
            live.close()   # a shutdown: the engine stops, committing what finished (Engine.stop)
            engine.hicache.close()
    assert [r["meta_info"]["cached_tokens"] for r in replies] == [0, HIT]
    assert replies[1]["output_ids"] == l1_hits[0]
    assert f'sglang:hicache_hit_tokens_total{{model_name="tiny",tier="storage"}} {HIT}' in metrics


def test_bad_pages_degrade_to_misses(tiny, prompts, l1_hits, tmp_path, caplog):
    writer = _engine(tiny, _storage(tmp_path))
    cold = _run(writer, prompts[2])
    writer.hicache.drain()
    files = sorted(tmp_path.glob("*.page"))
    assert files
    for i, f in enumerate(files):   # corrupt one, truncate the next, ...
        data = f.read_bytes()
        f.write_bytes(data[:len(data) // 2] if i % 2 else data[:-1] + bytes([data[-1] ^ 1]))
    reader = _engine(tiny, _storage(tmp_path))
    with caplog.at_level(logging.WARNING, "megajax"):
        r = _run(reader, prompts[2])
    assert _cached(r) == 0 and r["output_ids"] == cold["output_ids"]
    bad = [m for m in caplog.messages if "a miss" in m]
    # one line, for the prompt's first page (the pages after it are no use without it)
    assert len(bad) == 1 and reader.load()["hicache"]["storage"]["bad_pages"] == 1
    assert any(f.name in bad[0] for f in files)


def test_write_policies(tiny, prompts, tmp_path):
    def pages_after(policy, runs):
        d = tmp_path / policy
        engine = _engine(tiny, _storage(d, write_policy=policy))
        counts = []
        for p in runs:
            _run(engine, p)
            engine.hicache.drain()
            counts.append(len(list(d.glob("*.page"))))
        return counts + [engine.scheduler.ranks[0].radix.cached_pages]

    # write_through: on commit; selective: on the second use; write_back: when the host pool evicts
    first, committed = pages_after("write_through", prompts[:1])
    assert first == committed > HIT // 16   # the prompt's pages and the output's
    assert pages_after("write_through_selective", [prompts[0], prompts[0]])[:2] == [0, committed]
    assert pages_after("write_back", prompts)[:4] == [0] * 4   # host pool (24 pages) holds all of them


def test_eviction_under_concurrent_load_loses_no_request(tiny, prompts):
    engine = _engine(tiny, HiCacheConfig(ratio=0.5))   # a host pool of 6 pages: it evicts too
    subs = [prompts[i % 4][:40 + 4 * i] for i in range(10)]
    engine.start()
    try:
        handles = [engine.submit(p, GREEDY, stream=False) for p in subs]
        deadline = time.time() + 120
        while engine.has_work and time.time() < deadline:
            time.sleep(0.05)
        done = [engine._requests[h.rids[0]] for h in handles]
    finally:
        engine.stop()
    alone = _engine(tiny).generate(subs, GREEDY, decode_text=False)   # no tiers, no pressure from the others
    assert all(r.finish_reason == "length" for r in done)
    # a hit and a cold prefill round differently (random-tiny's logits are flat), so a request is
    # compared where its hit was as long in both runs (the repeats' tokens by tier: the tests above)
    same = [i for i, (r, a) in enumerate(zip(done, alone)) if r.cached_tokens == _cached(a)]
    assert len(same) >= 8
    assert [done[i].output for i in same] == [alone[i]["output_ids"] for i in same]
    assert engine.scheduler.used_pages == 0 and engine.scheduler.free_slots == 2
    assert engine.load()["hicache"]["bytes_moved"]["device_to_host"] > 0


# ---------------------------------------------------------------- the file backend alone (no engine)

LAYOUT_BYTES = 64
ID = b"i" * 32   # a model identity (a SHA-256)


def _file(tmp_path, identity=b"m" * 32, **kw) -> FileStorage:
    return FileStorage(tmp_path, identity, LAYOUT_BYTES, **kw)


def test_file_storage_checks_every_page(tmp_path, caplog):
    s = _file(tmp_path)
    keys = [bytes([i]) * 32 for i in range(5)]
    assert s.batch_set(keys, [bytes([i]) * LAYOUT_BYTES for i in range(5)]) == [True] * 5
    assert s.batch_exists(keys) == 5 and s.batch_exists([keys[0], b"x" * 32, keys[2]]) == 1
    assert s.batch_get(keys[:1]) == [b"\0" * LAYOUT_BYTES]
    with caplog.at_level(logging.WARNING, "megajax"):
        assert _file(tmp_path, identity=b"o" * 32).batch_get(keys[4:]) == [None]        # another model's
    assert "belongs to another model" in caplog.text
    caplog.clear()
    os.replace(tmp_path / (keys[3].hex() + ".page"), tmp_path / (keys[2].hex() + ".page"))
    f0, f1 = (tmp_path / (k.hex() + ".page") for k in keys[:2])
    f0.write_bytes(f0.read_bytes()[:-1] + b"\1")
    f1.write_bytes(f1.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, "megajax"):
        assert s.batch_get(keys[:4]) == [None] * 4    # corrupted, truncated, holds another key, gone (renamed)
    assert [m.split(": ", 1)[1] for m in caplog.messages] == [
        f"{f0.name} fails its checksum: a miss (removed)", f"{f1.name} is truncated: a miss (removed)",
        f"{keys[2].hex()}.page holds another page: a miss (removed)"]
    assert not f0.exists() and s.batch_exists(keys) == 0
    assert not list(tmp_path.glob(".tmp-*"))                                               # no temporary left


def test_file_storage_refuses_a_directory_it_cannot_make(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="--hicache-storage-dir"):
        _file(tmp_path / "a-file" / "pages")


def test_file_storage_size_bound_evicts_least_recently_used(tmp_path):
    page = 150 + LAYOUT_BYTES   # a page file's size, with its header
    s = _file(tmp_path, max_bytes=3 * page)
    keys = [bytes([i]) * 32 for i in range(5)]
    s.batch_set(keys[:3], [b"a" * LAYOUT_BYTES] * 3)
    time.sleep(0.01)
    s.batch_get(keys[:1])   # recently used: stays
    s.batch_set(keys[3:], [b"b" * LAYOUT_BYTES] * 2)
    held = [k for k in keys if (tmp_path / (k.hex() + ".page")).exists()]
    assert keys[0] in held and len(held) == 3 and sum(f.stat().st_size for f in tmp_path.iterdir()) <= 3 * page


def test_file_storage_write_failures_are_misses(tmp_path, caplog, monkeypatch):
    tiny_bound = _file(tmp_path / "small", max_bytes=10)
    with caplog.at_level(logging.WARNING, "megajax"):
        assert tiny_bound.batch_set([b"k" * 32] * 2, [b"a" * LAYOUT_BYTES] * 2) == [False, False]
    assert caplog.text.count("below one page") == 1   # logged once
    full = _file(tmp_path / "full")

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    assert full.batch_set([b"k" * 32], [b"a" * LAYOUT_BYTES]) == [False]
    assert "the disk is full" in caplog.text and not list((tmp_path / "full").iterdir())
    assert full.batch_get([b"k" * 32]) == [None]


def test_read_only_storage_dir_still_serves_reads(tmp_path, caplog, monkeypatch):
    s = _file(tmp_path)
    s.batch_set([b"k" * 32], [b"a" * LAYOUT_BYTES])
    tmp_path.chmod(0o555)
    try:
        if os.geteuid() == 0:   # root ignores the mode: fail the write as a read-only mount would
            real_open = open

            def ro_open(path, mode="r", *a, **k):
                if "w" in mode:
                    raise OSError(errno.EROFS, "Read-only file system")
                return real_open(path, mode, *a, **k)
            monkeypatch.setattr("builtins.open", ro_open)
        with caplog.at_level(logging.WARNING, "megajax"):
            assert s.batch_set([b"j" * 32], [b"b" * LAYOUT_BYTES]) == [False]
            assert s.batch_get([b"k" * 32]) == [b"a" * LAYOUT_BYTES]
        assert "read-only" in caplog.text or "not writable" in caplog.text
    finally:
        tmp_path.chmod(0o755)


class _SlowStorage(FileStorage):
    def batch_get(self, keys):
        time.sleep(0.3)
        return super().batch_get(keys)


def test_prefetch_policies(tiny, tmp_path):
    layout = PageLayout.of(tiny.cfg, 16, np.float32)
    tokens = list(range(64))
    keys = page_keys(ID, tokens, 16)
    slow = _SlowStorage(tmp_path, ID, layout.page_bytes)
    slow.batch_set(keys, [b"\0" * layout.page_bytes] * 4)

    def cache(policy, **kw):
        c = HiCache(HiCacheConfig(storage_backend="file", storage_dir=str(tmp_path), prefetch_policy=policy,
                                  prefetch_threshold=32, **kw), layout, ID, device=None, device_pages=8)
        c.storage = slow
        return c

    best = cache("best_effort")
    assert best.ready("r", keys, 0)   # admitted at once; the prefetch goes on
    wait = cache("wait_complete")
    assert not wait.ready("r", keys, 0)
    while not wait.ready("r", keys, 0):
        time.sleep(0.05)
    assert wait.host.prefix(keys) == 4
    timed = cache("timeout", prefetch_timeout_base=0.1, prefetch_timeout_per_ki_token=0)
    assert not timed.ready("r", keys, 0)
    time.sleep(0.15)
    assert timed.ready("r", keys, 0) and timed.host.prefix(keys) < 4   # gave up before the last page
    assert cache("wait_complete").ready("short", keys[:1], 0)          # under the threshold: no prefetch
    for c in (best, wait, timed):
        c.close()


def test_page_keys_chain_the_prefix_and_the_model():
    a = page_keys(b"m1", list(range(48)), 16)
    assert len(a) == 3 and len(set(a)) == 3
    assert page_keys(b"m1", list(range(40)), 16) == a[:2]                      # partial pages have no key
    assert page_keys(b"m1", [99] + list(range(1, 48)), 16)[1:] != a[1:]        # a key names its whole prefix
    assert page_keys(b"m2", list(range(48)), 16)[0] != a[0]                    # and the model
    assert page_keys(b"m1", list(range(48)), 16, known=a[:1]) == a              # a request's keys grow
    assert page_keys(b"m1", list(range(32)), 16, known=a) == a[:2]


def test_flags_make_the_config():
    import argparse

    ap = argparse.ArgumentParser()
    add_model(ap, required=False)
    add_engine(ap)
    args = ap.parse_args(["--enable-hierarchical-cache", "--hicache-write-policy", "write_back",
                          "--hicache-storage-backend", "file", "--hicache-storage-dir", "/tmp/x",
                          "--hicache-storage-prefetch-policy", "timeout",
                          "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 512}'])
    h = engine_config(args).hicache
    assert (h.write_policy, h.storage_dir, h.prefetch_policy, h.prefetch_threshold) == ("write_back", "/tmp/x",
                                                                                         "timeout", 512)
    assert engine_config(ap.parse_args([])).hicache is None
    for bad in ('{"prefetch_threshold": "x"}', "{", '{"nope": 1}'):
        with pytest.raises(ValueError):
            engine_config(ap.parse_args(["--enable-hierarchical-cache", "--hicache-storage-backend-extra-config",
                                         bad]))
    with pytest.raises(ValueError, match="radix"):
        EngineConfig(prefix_cache=False, hicache=HiCacheConfig())
