"""Process liveness (moe_grpo/processes.py): the one check the engine's reaper, the engine actor's leftovers search,
the run's process record and the tests use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


import pytest

from moe_grpo.processes import oom_kills, oom_note, process_alive, process_state, start_ticks


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


def _memory_cgroup(name: str, limit: int) -> tuple[str, list[str]] | None:
    """A memory cgroup of `limit` bytes without swap, v2 or v1 (as root, where /sys/fs/cgroup is writable): its
    cgroup.procs and the directories to remove; None where none can be made."""
    v2 = "/sys/fs/cgroup"
    candidates = []
    if os.path.exists(f"{v2}/cgroup.controllers"):
        candidates.append((f"{v2}/{name}", {"memory.max": limit, "memory.swap.max": 0}))
    if os.path.isdir(f"{v2}/memory"):
        candidates.append((f"{v2}/memory/{name}", {"memory.limit_in_bytes": limit,
                                                    "memory.memsw.limit_in_bytes": limit}))
    for path, settings in candidates:
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            for key, value in settings.items():
                if os.path.exists(f"{path}/{key}"):
                    with open(f"{path}/{key}", "w") as f:
                        f.write(str(value))
            if not os.path.exists(f"{path}/{next(iter(settings))}"):
                raise OSError("no memory controller there")
            return f"{path}/cgroup.procs", [path]
        except OSError:
            os.rmdir(path)
    return None


def test_a_process_the_oom_killer_ends_is_said_to_be_out_of_memory():
    """A part of a run that the kernel's OOM killer ends is SIGKILLed, and Ray and vLLM report only that it is
    gone; the machine's OOM-kill count (/proc/vmstat) says it happened. Made to happen here in a 64 MiB memory
    cgroup (root only; skipped where no cgroup can be made)."""
    if oom_kills() is None:
        pytest.skip("no /proc/vmstat oom_kill on this kernel")
    cgroup = _memory_cgroup(f"moe_grpo_test_{os.getpid()}", 64 << 20)
    if cgroup is None:
        pytest.skip("cannot make a memory cgroup here (not root, or no writable cgroup filesystem)")
    procs, made = cgroup
    before = oom_kills()
    try:
        assert oom_note(before) == ""
        eater = subprocess.run(["sh", "-c", f'echo $$ > {procs} && exec "$0" -c "x = bytearray(1 << 30)"',
                                sys.executable], capture_output=True, timeout=60)
        assert eater.returncode == -signal.SIGKILL, (eater.returncode, eater.stderr[-2000:])
        note = oom_note(before)
        assert note.startswith(" (the kernel's OOM killer ended ") and "out of memory, most likely" in note, note
        assert oom_note(oom_kills()) == "", "no kill after the count it is given"
    finally:
        for path in made:
            for _ in range(50):  # the killed process leaves the cgroup once reaped
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    time.sleep(0.1)
