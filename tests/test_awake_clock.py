"""The awake clock (moe_grpo/awake_clock.py) leaves out the time its process was stopped, and only that."""

import os
import signal
import subprocess
import sys
import time

import pytest

from moe_grpo.awake_clock import FROZEN_AFTER_S, TICK_S, AwakeClock

CHILD = """
import sys, time
from moe_grpo.awake_clock import awake_now
a0, m0 = awake_now(), time.monotonic()
print("ready", flush=True)
sys.stdin.readline()  # the parent stops this process, continues it, then writes a line
print(awake_now() - a0, time.monotonic() - m0, flush=True)
"""


def test_a_stopped_process_does_not_count_its_frozen_time_and_the_rest_it_counts():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        os.kill(child.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        time.sleep(2.2)
        os.kill(child.pid, signal.SIGCONT)
        stopped = time.monotonic() - stopped_at
        time.sleep(0.5)
        child.stdin.write("go\n")
        child.stdin.flush()
        awake, wall = (float(x) for x in child.stdout.readline().split())
    finally:
        child.kill()
        child.wait()
    # Of the stopped time, only the allowance counts (FROZEN_AFTER_S plus up to a tick); the time it ran, all of it.
    counted_of_the_stop = awake - (wall - stopped)
    # (Less by as long as the thread took to run after the SIGCONT: up to 0.4 s allowed on a loaded machine.)
    assert FROZEN_AFTER_S - 0.4 <= counted_of_the_stop <= FROZEN_AFTER_S + TICK_S + 0.2, (awake, wall, stopped)


def test_a_deadline_checked_on_thaw_before_the_clocks_thread_wakes_already_excludes_the_freeze():
    clock = AwakeClock()
    clock.now()
    try:
        with clock._lock:  # the thread's last tick 3 s ago, as on a thaw before the thread has run again
            clock._last_tick -= 3.0
            frozen_before = clock.frozen_s
        first, mono = clock.now(), time.monotonic()
        assert first == pytest.approx(mono - frozen_before - (3.0 - TICK_S - FROZEN_AFTER_S), abs=0.15)
        time.sleep(0.3)  # the thread records that lateness as frozen: the clock goes on from where it was
        assert clock.now() - first == pytest.approx(0.3, abs=0.1)
    finally:
        clock.stop()


def test_a_process_busy_on_its_own_thread_counts_all_its_time():
    clock = AwakeClock()
    try:
        start, mono = clock.now(), time.monotonic()
        while time.monotonic() - mono < 0.8:  # pure Python: the interpreter hands the clock's thread its turns
            sum(range(1000))
        assert clock.frozen_s == 0.0
        assert clock.now() - start == pytest.approx(time.monotonic() - mono, abs=0.05)
    finally:
        clock.stop()


def test_a_clock_whose_thread_is_gone_still_moves():
    clock = AwakeClock()
    clock.now()
    clock.stop()
    clock._ticker.join(timeout=5)
    clock._pid = os.getpid()  # stopped without a restart: no thread ticks any more
    start = clock.now()
    time.sleep(1.5)  # longer than the allowance: with an overdue tick held against it, the clock would stand still
    assert clock.now() - start == pytest.approx(1.5, abs=0.2)


FORKING = """
import os, threading, time
from moe_grpo.awake_clock import CLOCK, awake_now
awake_now()
held = threading.Event()
def hold():  # another thread holds the clock's lock at the fork, as its ticking thread does while recording a tick
    with CLOCK._lock:
        held.set()
        time.sleep(1.0)
threading.Thread(target=hold).start()
held.wait()
pid = os.fork()
if pid == 0:
    a0 = awake_now()  # would hang on a copy of the held lock without the clock's at-fork hook
    time.sleep(0.6)
    print(f"{awake_now() - a0:.3f} {CLOCK._ticker.is_alive()}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def test_a_forked_child_gets_a_clock_of_its_own_that_ticks():
    out = subprocess.run([sys.executable, "-c", FORKING], capture_output=True, text=True, timeout=20)
    elapsed, alive = out.stdout.split()
    assert float(elapsed) == pytest.approx(0.6, abs=0.15) and alive == "True", out


def test_wait_for_gives_the_result_or_a_timeout_naming_it_and_cancels_what_it_waited_on():
    import asyncio

    from moe_grpo.awake_clock import wait_for

    async def answer(after_s: float) -> str:
        await asyncio.sleep(after_s)
        return "done"

    async def main():
        assert await wait_for(answer(0.05), 1.0) == "done"
        slow = asyncio.ensure_future(answer(10.0))
        with pytest.raises(TimeoutError, match="no answer within 0.3 s"):
            await wait_for(slow, 0.3)
        await asyncio.sleep(0)
        assert slow.cancelled()

    asyncio.run(main())
