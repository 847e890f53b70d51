"""The bucket files' mapping cache (sync.transport._MapCache) is shared by every thread of a process: the relay's
receiver threads (one per sending learner rank) map buckets at the same time.

Would have caught (whole suite, 2026-11-27): two receiver threads each unmapping the same gone file (a slot of an
earlier sync) in `_drop_missing`; the second `del` raised KeyError, that receiver thread died and the learner rank
sending to it timed out ("Operation timed out!" broadcasting a bucket) in tests/sync/test_shard_relay.py."""

from __future__ import annotations

import threading

from moe_grpo.sync.transport import _MapCache

THREADS = 4
GONE = 300


def test_threads_mapping_at_once_while_gone_files_are_dropped(tmp_path):
    for attempt in range(5):
        cache = _MapCache()
        gone = []
        for i in range(GONE):  # mapped once, then removed: each `get` that maps anew drops them
            path = tmp_path / f"gone{attempt}_{i}.bin"
            path.write_bytes(b"\0" * 4096)
            cache.get(str(path), writable=False)
            gone.append(path)
        for path in gone:
            path.unlink()
        fresh = [tmp_path / f"fresh{attempt}_{t}.bin" for t in range(THREADS)]
        for path in fresh:
            path.write_bytes(b"\1" * 4096)
        start, errors = threading.Barrier(THREADS), []

        def map_one(path):
            start.wait()
            try:
                assert cache.get(str(path), writable=False)[0] == 1
            except Exception as e:  # noqa: BLE001 - reported below, with the thread's path
                errors.append(f"{path.name}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=map_one, args=(p,)) for p in fresh]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert len(cache._maps) == THREADS, "every gone file unmapped, each fresh one mapped once"
