"""Process liveness (moe_grpo/processes.py): the one check the engine's reaper, the engine actor's leftovers search,
the run's process record and the tests use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


from moe_grpo.processes import process_alive, process_state, start_ticks


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_state(pid: int, want: str, timeout_s: float = 10.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while (state := process_state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_a_running_process_is_alive_a_zombie_and_a_reaped_one_are_not():
    """A zombie holds no memory and does nothing: it counts as gone before its parent reaps it (what a SIGKILLed
    vLLM engine core is until multiprocessing joins it). Would catch a check that asks only `kill(pid, 0)`."""
    child = _sleeper()
    try:
        assert process_alive(child.pid) and process_state(child.pid) in ("R", "S")
        os.kill(child.pid, signal.SIGKILL)
        assert _wait_state(child.pid, "Z") == "Z"
        assert not process_alive(child.pid), "an unreaped zombie counted as alive"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) is None and not process_alive(child.pid)


def test_a_stopped_process_is_alive_and_says_so():
    """A SIGSTOPped process is alive (it holds memory and segments) and its state says stopped, which the engine's
    shutdown reads as unresponsive."""
    child = _sleeper()
    try:
        os.kill(child.pid, signal.SIGSTOP)
        assert _wait_state(child.pid, "T") == "T"
        assert process_alive(child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_pid_now_held_by_another_process_is_not_the_one_started_then():
    """With the start time it was seen with (its start ticks), a pid that now belongs to a later process
    is gone: the engine's reaper must not SIGKILL a stranger that reused an engine worker's pid."""
    child = _sleeper()
    try:
        started = start_ticks(child.pid)
        assert started is not None and process_alive(child.pid, started)
        assert process_state(child.pid, started - 5) is None, "another start time: another process"
        assert not process_alive(child.pid, started - 5)
    finally:
        child.kill()
        child.wait()
