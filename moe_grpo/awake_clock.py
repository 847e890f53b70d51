"""A monotonic clock that stands still while its process is stopped, for the deadlines that judge another part hung.

A whole job frozen and thawed (SLURM's `scontrol suspend` and gang scheduling's time slices, a cgroup freezer, a
paused VM) stops every process of a run at once. `time.monotonic()` counts the frozen time, so on thaw every
deadline running across the freeze had passed: the engine was named hung and restarted, its load failed, its
requests were sent again, although no part had been slower than any other. The engines, the learner ranks, the
reward workers and the driver were all stopped alike; what a deadline should measure is the time the waiting
process itself ran.

A daemon thread ticks every `TICK_S`. A tick that comes more than `FROZEN_AFTER_S` late means the process did not
run meanwhile; the lateness beyond that is frozen time, and `now()` leaves it out (also the lateness of a tick still
due, so a deadline checked on thaw before the thread has woken already excludes the freeze). A process starved of
CPU for that long counts the same way: its deadlines move by as much, a later verdict, never an earlier one. A
part stopped on its own (SIGSTOP to an engine alone) still misses the deadlines of the processes waiting on it,
which keep running: that is the hang the deadlines are for.

Per process: started at the first `now()`, and again in a forked child (threads do not survive a fork)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any, Awaitable

TICK_S = 0.1
"""How often the thread looks at the clock."""

FROZEN_AFTER_S = 1.0
"""Lateness of a tick beyond which the process counts as not running. Well above what a busy 2-core machine
delays a sleeping thread by (tens of ms), well below any timeout (seconds)."""


class AwakeClock:
    """`now()`: `time.monotonic()` less the time this process was seen stopped (`frozen_s`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = 0
        self._last_tick = 0.0
        self._ticker: threading.Thread | None = None
        self.frozen_s = 0.0
        """Seconds this process was seen stopped since the clock started in it."""

    def now(self) -> float:
        if self._pid != os.getpid():
            self._start()
        with self._lock:  # read under the lock: a tick recorded meanwhile cannot make the clock step back
            mono = time.monotonic()
            ticking = self._ticker is not None and self._ticker.is_alive()
            # A tick overdue counts as frozen only while the thread lives: without it the clock must still move.
            return mono - self.frozen_s - (self._late(mono) if ticking else 0.0)

    def stop(self) -> None:
        """End the ticking thread at its next tick (a clock of a test's own; a later `now()` starts it afresh)."""
        with self._lock:
            self._pid = -1

    def _late(self, mono: float) -> float:
        return max(0.0, mono - self._last_tick - TICK_S - FROZEN_AFTER_S)

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            self._pid, self._last_tick, self.frozen_s = os.getpid(), time.monotonic(), 0.0
            self._ticker = threading.Thread(target=self._tick, args=(os.getpid(),), name="awake-clock", daemon=True)
            try:
                self._ticker.start()
            except RuntimeError:  # no thread to be had (a pids limit): the clock is time.monotonic(), never stuck
                self._ticker = None

    def after_fork_in_child(self) -> None:
        """The child has no ticking thread and may hold a copy of a lock taken by the parent's: start afresh."""
        self._lock = threading.Lock()
        self._pid, self._ticker = 0, None

    def _tick(self, pid: int) -> None:
        while self._pid == pid:
            time.sleep(TICK_S)
            with self._lock:
                mono = time.monotonic()
                self.frozen_s += self._late(mono)
                self._last_tick = mono


CLOCK = AwakeClock()
"""This process's clock."""
os.register_at_fork(after_in_child=CLOCK.after_fork_in_child)


def awake_now() -> float:
    """Seconds on a monotonic clock that does not advance while this process is stopped (`AwakeClock`)."""
    return CLOCK.now()


async def wait_for(awaitable: Awaitable[Any], timeout_s: float) -> Any:
    """`asyncio.wait_for` on the awake clock (whose loop's own clock counts a freeze): the result, or TimeoutError
    naming the timeout once `timeout_s` of this process's running time passed. The awaitable is then cancelled but,
    unlike asyncio's, not awaited: the caller goes on while it ends."""
    task = asyncio.ensure_future(awaitable)
    deadline = awake_now() + timeout_s
    try:
        while not task.done():
            left = deadline - awake_now()
            if left <= 0:
                raise TimeoutError(f"no answer within {timeout_s:g} s")
            await asyncio.wait({task}, timeout=min(left, 0.5))
        return task.result()
    finally:
        if not task.done():
            task.cancel()
