"""The engines' side of a weight sync: apply a published version to each engine, skipping the slow and the dead.

`apply_version` brings one engine to a version: wait until every learner
rank has written it, check it against the model the engine serves (name,
shape, element count - before anything is applied), pin its buffers, and
let the engine load all of it or roll back. `EngineSyncer.push` does that
for every engine at once with a deadline: an engine that misses it is
reported as skipped (its load may finish in the background), a failed one
as failed, and each is offered the newest version on the next push - how
an engine catches up. Nothing here is called by the learner, which only
publishes (`weight_sync.py`) and so is never held up by an engine.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from moe_grpo.sync.plan import check_plan
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError


def apply_version(engine: Any, transport: SharedMemoryTransport, version: int, *, timeout_s: float = 120.0) -> float:
    """Make `engine` serve `version` (all of it, or it keeps serving what it served). Returns seconds taken."""
    t0 = time.perf_counter()
    who = f"engine {engine.engine_id}"
    if version <= engine.policy_version:
        raise SyncError(f"{who} already serves version {engine.policy_version}; refused version {version}")
    slot, plan = transport.wait_complete(version, timeout_s)
    try:
        check_plan(plan, engine.spec)
    except ValueError as e:
        raise SyncError(f"{who} refused version {version}: {e}") from e
    serving = {engine.weight_source[0]: engine.policy_version} if isinstance(engine.weight_source, tuple) else {}
    transport.pin(engine.engine_id, {**serving, slot: version})
    try:
        engine.load_published(slot, plan, version, timeout_s=timeout_s)
    except Exception as e:
        if serving:
            transport.pin(engine.engine_id, serving)
        else:
            transport.unpin(engine.engine_id)
        raise SyncError(f"{who} failed to load version {version}: {e}") from e
    transport.pin(engine.engine_id, {slot: version})  # its rollback source from now on
    return time.perf_counter() - t0


@dataclass
class PushReport:
    version: int
    applied: dict[str, float] = field(default_factory=dict)
    """Engine id -> seconds, for engines now serving `version`."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Engine id -> why it does not serve `version` yet (busy, slow, failed); it is offered a newer one later."""


class EngineSyncer:
    """Pushes versions to many engines in parallel; no engine can hold up the others or the caller."""

    def __init__(self, engines: list[Any], transport: SharedMemoryTransport, *, deadline_s: float = 60.0) -> None:
        self.engines, self.transport, self.deadline_s = list(engines), transport, deadline_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)), thread_name_prefix="moe_grpo-deliver")
        self._busy: dict[str, tuple[int, Future]] = {}

    def push(self, version: int) -> PushReport:
        """Offer `version` to every engine; returns after all finished or `deadline_s`, whichever is first."""
        report = PushReport(version)
        started: dict[str, Future] = {}
        for engine in self.engines:
            busy = self._busy.get(engine.engine_id)
            if busy is not None and not busy[1].done():
                report.skipped[engine.engine_id] = f"still loading version {busy[0]}"
                continue
            fut = self._pool.submit(apply_version, engine, self.transport, version, timeout_s=self.deadline_s)
            self._busy[engine.engine_id] = (version, fut)
            started[engine.engine_id] = fut
        wait(list(started.values()), timeout=self.deadline_s)
        for engine_id, fut in started.items():
            if not fut.done():
                report.skipped[engine_id] = f"slow: not done after {self.deadline_s:.0f} s (finishes in the background)"
            elif fut.exception() is not None:
                report.skipped[engine_id] = f"failed: {fut.exception()}"
            else:
                report.applied[engine_id] = fut.result()
        return report

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
