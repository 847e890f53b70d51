"""The processes of one vLLM engine and what they map in /dev/shm: recorded when they start, ended however they are.

`restart` and `shutdown` (rollout/vllm_engine.py) end every process of the engine, whatever state it is in:
vLLM's engine core and its workers, recorded when they start, are SIGKILLed (a SIGSTOPped process never acts on
vLLM's SIGTERM; a worker whose engine core died is orphaned, no longer below it). What they mapped in /dev/shm is
removed: a killed vLLM 0.32 engine leaves its message queues' ring buffers (`psm_*`, hundreds of MiB) and its
executor's lock (`sem.mp-*`) there until this process exits, and any engine of TP or PP > 1 on CPU its workers'
all-reduce buffers (`vllm_dist_*`) for good. And when the process that owns the engine dies
without a shutdown (a SIGKILLed engine actor), the kernel kills vLLM's processes with it: each is started with
PR_SET_PDEATHSIG (`moe_grpo/process_ties.py`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import Any, Callable, Sequence

import psutil

from moe_grpo.processes import (SHM_DIR, STOPPED_STATES, process_alive, process_state, process_tree, same_entry,
                                shm_entries_held, start_ticks, unlink_same)

SHM_KINDS = ("psm_", "sem.mp-", "vllm_dist_")
"""What a vLLM 0.32 engine leaves in /dev/shm when its processes are killed: the ring buffers of the message
queues between engine core and workers (multiprocessing SharedMemory, `psm_<8 hex>`: about 240 and 160 MiB on
CPU) and, where vLLM spawns its workers, the lock the executor shares with them (a multiprocessing semaphore,
`sem.mp-<8 chars>`; forked workers, rollout/worker_start.py, share one unlinked as it is made). On CPU an
engine of TP or PP > 1 also leaves, even after an orderly shutdown, one 4 MiB file per worker of the CPU
all-reduce's shared memory (`vllm_dist_<hex>-tp:0-[0-1]-cpushm_<rank>`, `_CPUSHMDistributed` in vLLM's
cpu_communicator.py: its C++ manager never unlinks it). Their names are random, so an engine's own are found by
what its processes map (`mapped_shm`)."""


def shm_snapshot() -> dict[str, int]:
    """This user's /dev/shm entries of vLLM's kinds (`SHM_KINDS`) now: name -> inode."""
    out: dict[str, int] = {}
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SHM_KINDS)]
    except OSError:
        return out
    for name in names:
        try:
            st = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == os.getuid():
            out[name] = st.st_ino
    return out


def remove_unheld_since(before: dict[str, int], wait_s: float = 5.0) -> list[str]:
    """Remove this user's /dev/shm entries of vLLM's kinds made since `before` (`shm_snapshot`) that no process of
    this user maps or holds open, waiting up to `wait_s` for the processes still holding some to go: what an engine
    that failed to start left (vLLM's ring buffers, ~400 MiB, which nothing else removes: its processes were never
    recorded). An entry another engine made meanwhile is mapped by it from its creation on, and kept."""
    deadline, seen_unheld = time.monotonic() + wait_s, None
    while True:
        new = {name: inode for name, inode in shm_snapshot().items() if before.get(name) != inode}
        if not new:
            return []
        mine = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == os.getuid()]
        held = shm_entries_held(mine, open_files=True, prefixes=SHM_KINDS)
        unheld = {name: inode for name, inode in new.items() if held.get(name) != inode}
        # Unheld in two scans 0.2 s apart: one caught between its shm_open and its mmap by another engine is not
        sure = {name: inode for name, inode in unheld.items() if seen_unheld and seen_unheld.get(name) == inode}
        if (sure and len(sure) == len(new)) or time.monotonic() > deadline:
            return unlink_shm(sure)
        seen_unheld = unheld
        time.sleep(0.2)


def descendants(roots: Sequence[int]) -> dict[int, int]:
    """pid -> start time (`processes.start_ticks`), for `roots` and every process below them that exists now."""
    out: dict[int, int] = {}
    for p in process_tree(roots):
        ticks = start_ticks(p.pid)
        if ticks is not None:
            out[p.pid] = ticks
    return out


def mapped_shm(pids: Sequence[int]) -> dict[str, int]:
    """/dev/shm entries of vLLM's kinds (`SHM_KINDS`) that these processes map: name -> inode."""
    return shm_entries_held(pids, prefixes=SHM_KINDS)


def unlink_shm(entries: dict[str, int]) -> list[str]:
    """Remove these /dev/shm entries (each only if it is still the same inode); returns the names removed.

    The engine's processes registered them with this process's multiprocessing resource tracker (they were
    spawned from here and share it); it is told they are gone, or it would warn of a leak at exit."""
    removed = []
    for name, inode in entries.items():
        if not unlink_same(name, inode):
            continue
        removed.append(name)
        if getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None) is None:
            continue  # no tracker in this process: nothing registered there
        try:
            if name.startswith("psm_"):
                resource_tracker.unregister("/" + name, "shared_memory")
            elif name.startswith("sem."):
                resource_tracker.unregister("/" + name[len("sem."):], "semaphore")
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass
    return removed


def bounded(fn: Callable[[], Any], timeout_s: float, name: str) -> bool:
    """Run `fn` in a daemon thread for at most `timeout_s`; whether it returned in time (its errors are dropped)."""
    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort teardown
            pass

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def engine_core_processes(llm: Any) -> list[Any]:
    """vLLM 0.32's engine-core Process objects of an AsyncLLM (started from this process, which reaps them)."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


def kill_all(targets: dict[int, int]) -> list[int]:
    """SIGKILL each process of `targets` (pid -> start ticks) still alive (a stopped one too); the pids signalled.

    Youngest first: a process starts after its parent, so each worker is signalled before its engine core. The
    other way round, a worker tied to its core (PR_SET_PDEATHSIG, worker_start.py) may be killed by the kernel as
    the core goes, before this loop reaches it, and a shutdown's report would not name it."""
    done = []
    for pid, started in sorted(targets.items(), key=lambda item: item[1], reverse=True):
        if not process_alive(pid, started):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return done


@dataclass
class EngineProcesses:
    """One engine's vLLM processes and /dev/shm entries, noted once they are up: what a shutdown kills and removes,
    even after the processes died."""

    procs: dict[int, int] = field(default_factory=dict)
    """pid -> start ticks of each vLLM process of the engine (engine core and workers)."""
    core: list[Any] = field(default_factory=list)
    """vLLM's engine-core Process objects (this process reaps them)."""
    shm: dict[str, int] = field(default_factory=dict)
    """/dev/shm entries of the engine (name -> inode)."""

    @classmethod
    def record(cls, llm: Any) -> EngineProcesses:
        """The processes of a just started AsyncLLM (its engine core and everything below it) and what they map."""
        core = engine_core_processes(llm)
        procs = descendants([int(p.pid) for p in core if p.pid])
        return cls(procs, core, mapped_shm(list(procs)))

    def roots(self) -> list[int]:
        return [int(p.pid) for p in self.core if p.pid]

    def alive(self) -> dict[int, int]:
        """pid -> start time of every process of the engine alive now (recorded or below its engine core now)."""
        procs = {**self.procs, **descendants(self.roots())}
        return {pid: t for pid, t in procs.items() if process_alive(pid, t)}

    def shm_inodes(self) -> dict[str, int]:
        """The engine's /dev/shm entries (recorded at start and mapped by its live processes) that exist now, with
        each one's inode (what identifies it, as its name may be reused once removed)."""
        known = {**self.shm, **mapped_shm(list(self.alive()))}
        return {name: inode for name, inode in known.items() if same_entry(name, inode)}

    def wait_gone(self, targets: dict[int, int], limit_s: float) -> None:
        """Until no process of `targets` is alive or `limit_s` passed, reaping the engine core meanwhile (vLLM leaves
        a SIGKILLed engine core a zombie)."""
        deadline = time.monotonic() + limit_s
        while True:
            for p in self.core:
                try:
                    p.join(0)
                except Exception:  # noqa: BLE001
                    pass
            if not any(process_alive(pid, t) for pid, t in targets.items()) or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def end(self, llm: Any, *, kill: bool | None, timeout_s: float, name: str,
            quiesce: Callable[[], None]) -> dict[str, Any]:
        """End every process of the engine and remove what they left in /dev/shm (`VllmEngine.shutdown`);
        `quiesce` stops the engine's own requests first. Returns what it did: processes killed, those found
        unresponsive, whether it killed at once (`hard`), /dev/shm entries removed, processes left, seconds."""
        t0 = time.perf_counter()
        alive = self.alive()
        procs = {**self.procs, **alive}
        shm = {**self.shm, **mapped_shm(list(alive))}
        unresponsive = sorted(pid for pid, t in procs.items()
                              if not process_alive(pid, t) or process_state(pid, t) in STOPPED_STATES)
        hard = bool(unresponsive) if kill is None else kill
        quiesce()
        phases: dict[str, float] = {"quiesce": time.perf_counter() - t0}
        if hard and llm is not None:
            # vLLM 0.32's engine-core monitor (core_client.MPClient.start_engine_core_monitor) prints "engine core
            # exited unexpectedly" on the console when the processes it watches die, unless the client is already
            # marked dead; here they die because this shutdown ends them.
            resources = getattr(getattr(llm, "engine_core", None), "resources", None)
            if resources is not None and hasattr(resources, "engine_dead"):
                resources.engine_dead = True
        killed = kill_all(procs) if hard else []
        if hard:  # a SIGKILLed process takes a moment to go; vLLM's shutdown then finds nothing left to wait for
            self.wait_gone(procs, 5.0)
        phases["kill"] = time.perf_counter() - t0 - sum(phases.values())
        if llm is not None:  # vLLM's own teardown (sockets, threads); bounded, it can wait on a hung engine
            grace = 1.0 if hard else timeout_s
            bounded(lambda: llm.shutdown(timeout=grace), grace + 10.0, f"moe_grpo-{name}-shutdown")
        phases["vllm_shutdown"] = time.perf_counter() - t0 - sum(phases.values())
        procs = {**procs, **descendants(self.roots())}
        killed += kill_all(procs)  # whatever vLLM's shutdown left (it kills the engine core, not always below it)
        self.wait_gone(procs, 5.0)
        for pid in set(procs) - set(self.roots()):  # multiprocessing reaps the engine core (wait_gone's join);
            try:                                     # a worker re-parented to this process (a subreaper) is reaped here
                os.waitpid(pid, os.WNOHANG)
            except (ChildProcessError, OSError):
                pass
        phases["sweep"] = time.perf_counter() - t0 - sum(phases.values())
        removed = unlink_shm(shm)
        left = sorted(pid for pid, t in procs.items() if process_alive(pid, t))
        return {"killed": sorted(set(killed)), "unresponsive": unresponsive, "hard": hard,
                "shm_removed": sorted(removed), "processes_left": left,
                "seconds": time.perf_counter() - t0, "phases": phases}
