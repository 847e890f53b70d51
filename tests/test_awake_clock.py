"""The awake clock (moe_grpo/awake_clock.py) leaves out the time its process was stopped, and only that."""

import os
import signal
import subprocess
import sys
import time

import pytest

from moe_grpo.awake_clock import FROZEN_AFTER_S, AwakeClock

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
        time.sleep(2.2)
        os.kill(child.pid, signal.SIGCONT)
        time.sleep(0.5)
        child.stdin.write("go\n")
        child.stdin.flush()
        awake, wall = (float(x) for x in child.stdout.readline().split())
    finally:
        child.kill()
        child.wait()
    assert wall >= 2.9, wall
    # 2.2 s stopped: all but the allowance (FROZEN_AFTER_S plus a tick) left out; the 0.8 s it ran, counted.
    assert 0.75 <= awake <= 0.8 + 0.1 + FROZEN_AFTER_S + 0.3, (awake, wall)


def test_a_deadline_checked_on_thaw_before_the_clocks_thread_wakes_already_excludes_the_freeze():
    clock = AwakeClock()
    start = clock.now()
    with clock._lock:  # the thread cannot record its tick, as on a thaw before it has run
        time.sleep(1.6)
        seen = time.monotonic() - clock._last_tick
        late = clock._late(time.monotonic())
    assert seen >= 1.6 and late == pytest.approx(seen - 0.1 - FROZEN_AFTER_S, abs=0.05)
    time.sleep(0.3)  # the thread records the same lateness as frozen: the clock moves on from where it was
    assert clock.now() - start == pytest.approx(1.9 - (1.6 - 0.1 - FROZEN_AFTER_S), abs=0.2)


def test_a_process_busy_on_its_own_thread_counts_all_its_time():
    clock = AwakeClock()
    start, mono = clock.now(), time.monotonic()
    while time.monotonic() - mono < 0.8:  # pure Python: the interpreter hands the clock's thread its turns
        sum(range(1000))
    assert clock.frozen_s == 0.0
    assert clock.now() - start == pytest.approx(time.monotonic() - mono, abs=0.05)


def test_a_forked_child_gets_a_clock_of_its_own_that_ticks():
    clock = AwakeClock()
    clock.now()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its clock must advance with its time, its thread restarted
        try:
            clock.after_fork_in_child()
            a0 = clock.now()
            time.sleep(0.6)
            os.write(write, f"{clock.now() - a0:.3f} {clock.frozen_s:.3f}".encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    elapsed, frozen = (float(x) for x in os.read(read, 100).split())
    assert elapsed == pytest.approx(0.6, abs=0.15) and frozen == 0.0


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
