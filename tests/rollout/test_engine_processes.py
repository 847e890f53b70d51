"""The engine's process set and reaper (rollout/engine_processes.py) on a process tree of its own, without vLLM."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import time
from multiprocessing.shared_memory import SharedMemory

import pytest

from moe_grpo.processes import SHM_DIR, process_alive, process_state
from moe_grpo.rollout.engine_processes import EngineProcesses, descendants, mapped_shm

pytestmark = pytest.mark.slow  # starts a process tree


def _hold(name: str, conn: object) -> None:
    """A stand-in engine core: maps a /dev/shm segment of vLLM's kind (`psm_*`), starts a process below itself
    (a worker), says the worker's pid, and waits."""
    shm = SharedMemory(name)
    worker = subprocess.Popen(["sleep", "600"])
    conn.send(worker.pid)  # type: ignore[attr-defined]
    time.sleep(600)
    shm.close()


def _wait_for(predicate: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


def test_end_kills_a_stopped_engine_core_and_the_processes_below_it_and_removes_its_shm_segment():
    """`EngineProcesses.end` (VllmEngine.shutdown's process part): a SIGSTOPped engine core is found unresponsive,
    so it is SIGKILLed at once (kill=None), with the worker below it, and the /dev/shm segment it mapped is removed;
    the engine's own requests are quiesced first. Would catch a reaper that waits on SIGTERM (a stopped process
    never acts on it), leaves the processes below the engine core, or leaves its ring buffers in /dev/shm."""
    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR}")
    segment = SharedMemory(create=True, size=4096)  # psm_<hex>: a name of vLLM's kind
    name = segment.name.lstrip("/")
    parent, child = multiprocessing.Pipe()
    core = multiprocessing.get_context("fork").Process(target=_hold, args=(name, child), daemon=True)
    core.start()
    worker = None
    try:
        assert parent.poll(30), "the stand-in engine core started its worker"
        worker = parent.recv()
        recorded = EngineProcesses(descendants([core.pid]), [core], mapped_shm([core.pid]))
        assert set(recorded.procs) >= {core.pid, worker} and name in recorded.shm, recorded
        assert recorded.shm_inodes() == {name: os.stat(os.path.join(SHM_DIR, name)).st_ino}

        os.kill(core.pid, signal.SIGSTOP)
        _wait_for(lambda: process_state(core.pid) in ("T", "t"), "the engine core stopped")
        quiesced = []
        out = recorded.end(None, kill=None, timeout_s=1.0, name="test", quiesce=lambda: quiesced.append(True))

        assert quiesced == [True]
        assert out["hard"] and core.pid in out["unresponsive"], out
        assert {core.pid, worker} <= set(out["killed"]) and out["processes_left"] == [], out
        assert not process_alive(core.pid) and not process_alive(worker)
        assert out["shm_removed"] == [name] and not os.path.exists(os.path.join(SHM_DIR, name))
        assert recorded.alive() == {} and recorded.shm_inodes() == {}
    finally:
        for pid in [core.pid, worker]:
            if pid and process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        core.join(10)
        segment.close()
        if os.path.exists(os.path.join(SHM_DIR, name)):
            segment.unlink()


def test_end_kills_a_stopped_worker_orphaned_by_its_dead_engine_core():
    """The engine core SIGKILLed, its worker SIGSTOPped and so orphaned (no longer below the engine core, deaf to
    SIGTERM and to its parent's death): `end` still finds it among the processes recorded at start and kills it.
    (A real vLLM worker no longer outlives its engine core: it is forked with PR_SET_PDEATHSIG, see
    tests/rollout/test_engine_restart.py; a worker started another way, or a future vLLM, could.) Would catch a
    reaper that only looks below the live engine core."""
    parent, child = multiprocessing.Pipe()
    core = multiprocessing.get_context("fork").Process(target=_hold_no_shm, args=(child,), daemon=True)
    core.start()
    worker = None
    try:
        assert parent.poll(30), "the stand-in engine core started its worker"
        worker = parent.recv()
        recorded = EngineProcesses(descendants([core.pid]), [core], {})
        assert set(recorded.procs) >= {core.pid, worker}, recorded
        os.kill(worker, signal.SIGSTOP)
        os.kill(core.pid, signal.SIGKILL)
        core.join(10)
        _wait_for(lambda: process_state(worker) in ("T", "t") and worker not in descendants([core.pid]),
                  "the stopped worker orphaned")
        out = recorded.end(None, kill=None, timeout_s=1.0, name="test", quiesce=lambda: None)
        assert worker in out["killed"] and out["processes_left"] == [], out
        _wait_for(lambda: not process_alive(worker), "the orphaned worker gone")
    finally:
        for pid in [core.pid, worker]:
            if pid and process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        core.join(10)


def _hold_no_shm(conn: object) -> None:
    """A stand-in engine core without a segment: starts a worker below itself, says its pid, and waits."""
    worker = subprocess.Popen(["sleep", "600"])
    conn.send(worker.pid)  # type: ignore[attr-defined]
    time.sleep(600)


def _hold_tied_worker(conn: object) -> None:
    """A stand-in engine core whose worker dies with it (PR_SET_PDEATHSIG, as vLLM's forked workers here)."""
    import ctypes

    def tie() -> None:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG

    worker = subprocess.Popen(["sleep", "600"], preexec_fn=tie)
    conn.send(worker.pid)  # type: ignore[attr-defined]
    time.sleep(600)


def test_end_names_every_process_it_killed_when_workers_die_with_their_core(monkeypatch):
    """A hung engine's shutdown reports each of its processes as killed (tests/rollout/test_engine_restart.py
    asserts it of a real engine). A worker tied to its engine core dies with it; killing the core first let the
    kernel take the worker before the reaper reached it, so the report left the worker out (seen in a whole-suite
    run, 2026-11-27). Each signal here is followed by a pause long enough for that to happen every time: the test
    fails when the core is signalled before its worker."""
    import moe_grpo.rollout.engine_processes as engine_processes

    parent, child = multiprocessing.Pipe()
    core = multiprocessing.get_context("fork").Process(target=_hold_tied_worker, args=(child,), daemon=True)
    core.start()
    worker = None
    real_kill = os.kill

    def kill_then_pause(pid: int, sig: int) -> None:
        real_kill(pid, sig)
        time.sleep(0.5)

    try:
        assert parent.poll(30), "the stand-in engine core started its worker"
        worker = parent.recv()
        recorded = EngineProcesses(descendants([core.pid]), [core], {})
        assert list(recorded.procs)[0] == core.pid and worker in recorded.procs, recorded
        os.kill(core.pid, signal.SIGSTOP)
        _wait_for(lambda: process_state(core.pid) in ("T", "t"), "the engine core stopped")
        monkeypatch.setattr(engine_processes.os, "kill", kill_then_pause)
        out = recorded.end(None, kill=None, timeout_s=1.0, name="test", quiesce=lambda: None)
        monkeypatch.undo()
        assert {core.pid, worker} <= set(out["killed"]) and out["processes_left"] == [], out
    finally:
        monkeypatch.undo()
        for pid in [core.pid, worker]:
            if pid and process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        core.join(10)
