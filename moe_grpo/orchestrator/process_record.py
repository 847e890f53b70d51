"""`processes.json` in the run directory: which process is which, and every process and /dev/shm entry the run has
had, kept current from start-up through the end of its cleanup.

Whoever checks a run after it ended (an operator, the fault tests) compares this record with what is still there:
a process of the run still alive, or an entry it created still in /dev/shm, was left behind, whether or not some
live process still holds it. Processes are recorded with their start time in clock ticks since boot (a pid reused
by an unrelated process is not the run's; whether one still runs is `processes.process_alive`'s rule, the one the
engine and the driver use); /dev/shm entries by inode, as created after the run began and mapped or open in one of its processes
(a multiprocessing semaphore is mapped under the temporary name it was created with, so only the inode finds it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterable

import psutil

from moe_grpo.processes import process_alive, process_tree, same_entry, shm_entries_held, start_ticks, unlink_same
from moe_grpo.rollout.engine_processes import kill_all

FULL_SCAN_S = 30.0
"""How often every process's /dev/shm entries are looked at again (new processes' are at once)."""
CLOCK_SLACK_S = 1.0
"""Start times come from /proc in whole clock ticks: a process started just after the run began may read as a little
before it."""
PID_START = "clock ticks since boot (/proc/<pid>/stat field 22)"
"""What `processes.json`'s "pids" map each pid to (its "pid_start"): `processes.start_ticks`, which never moves.
Records written before it held psutil's epoch start time, which moves with the system clock: refused."""


class ProcessRecord:
    """The run's processes and /dev/shm entries, sampled (`sample`) and written (`write`) to `processes.json`."""

    def __init__(self, run_dir: str | Path, *, sync_root: str | None = None, since: float | None = None) -> None:
        """`since`: when the run began (wall clock; default now): only processes and entries created after it are the
        run's, which matters where the driver is a process that existed before the run (a test calling `train`)."""
        self.path = Path(run_dir) / "processes.json"
        self.since = time.time() if since is None else since
        self.driver = os.getpid()
        self.learners: list[int | None] = []
        self.engines: dict[str, int] = {}
        self.pids: dict[int, int] = {}
        """pid -> start ticks (`processes.start_ticks`) of every process the run has had."""
        self.shm: dict[str, int] = {}
        """/dev/shm entry name -> inode, of every entry the run created."""
        self.sync_root = sync_root
        self._written: str | None = None
        self._full_scan = float("-inf")

    def set_roles(self, learners: Iterable[int | None], engines: dict[str, int]) -> None:
        """The learner ranks' and engines' processes (rewritten when an engine restarts)."""
        self.learners = list(learners)
        self.engines = dict(engines)

    def sample(self, *, full: bool = False) -> None:
        """Add the run's processes alive now (the driver's descendants started since the run began, the learner ranks'
        and engines' processes and theirs: on a cluster joined by address they are not the driver's) and the
        /dev/shm entries they map or hold open."""
        roots = [self.driver] + [p for p in self.learners if isinstance(p, int)] + [p for p in self.engines.values() if p]
        found: dict[int, int] = {}
        for p in process_tree(roots):
            try:
                started = p.create_time()  # wall clock, as `since` is
            except psutil.Error:
                continue
            ticks = start_ticks(p.pid)
            if ticks is not None and (p.pid == self.driver or p.pid in roots or started >= self.since - CLOCK_SLACK_S):
                found[p.pid] = ticks
        # Reading every process's memory map takes ~1 ms per thousand lines (a vLLM process has thousands): the
        # processes new since the last look each time, all of them every `FULL_SCAN_S` and whenever asked to.
        now = time.monotonic()
        if full or now - self._full_scan >= FULL_SCAN_S:
            scan, self._full_scan = found, now
        else:
            scan = {pid: t for pid, t in found.items() if self.pids.get(pid) != t}
        self.pids.update(found)
        self.shm.update(shm_held_by(scan, created_after=self.since - CLOCK_SLACK_S))

    def write(self) -> None:
        """Write `processes.json` (atomically, and only when it changed)."""
        info = {"driver": self.driver, "learners": self.learners, "engines": self.engines,
                "pid_start": PID_START,
                "pids": {str(pid): started for pid, started in sorted(self.pids.items())},
                "shm": dict(sorted(self.shm.items())), "sync_root": self.sync_root}
        text = json.dumps(info, indent=1)
        if text == self._written:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.path)
        self._written = text

    def release_shm(self) -> list[str]:
        """Remove every /dev/shm entry the run created that is still there (the same inode); returns their names.

        The last step of a run's cleanup, once its processes are stopped: an engine whose processes were killed
        rather than shut down leaves vLLM's ring buffers (`psm_*`, hundreds of MiB each; a SIGTERM to every process
        of the run, as `scancel` or `timeout` sends, left 400 MiB per run) and nothing else removes them: the engine
        actor's own record of them (process_ties.record_shm) goes with the run's weight slots. Only entries created
        after the run began and held by its processes are recorded, so a joined cluster's are never touched."""
        live = [pid for pid, started in self.pids.items() if pid != self.driver and process_alive(pid, started)]
        held = shm_entries_held(live, open_files=True) if live else {}  # a process the cleanup could not stop
        return [name for name, inode in sorted(self.shm.items()) if name not in held and unlink_same(name, inode)]

    def kill_alive(self) -> list[int]:
        """SIGKILL the run's recorded processes still alive (never the driver); returns their pids. For a cleanup that
        cannot ask Ray to end them: with the GCS gone, a run's own raylet is stopped but its agents (`ray::
        DashboardAgent`, `ray::RuntimeEnvAgent`) outlived it by about two minutes (Ray 2.60)."""
        return kill_all({pid: started for pid, started in self.pids.items() if pid != self.driver})

    def update(self, *, full: bool = False) -> None:
        """Sample and write: what the driver calls each step, and (`full`) after each step of its cleanup."""
        self.sample(full=full)
        self.write()


def shm_held_by(pids: Iterable[int], *, created_after: float = 0.0) -> dict[str, int]:
    """/dev/shm entries (top level) that these processes map or hold open and that were created after `created_after`
    (wall clock): name -> inode."""
    return shm_entries_held(pids, open_files=True, created_after=created_after)


def release_previous(run_dir: str | Path) -> tuple[list[str], list[str]]:
    """What the previous run in `run_dir` left when it could not clean up (its driver SIGKILLed: a node failure, the
    OOM killer), read from its `processes.json` before this run writes its own: its /dev/shm entries still there
    that none of its live processes maps are removed (vLLM's ring buffers, ~400 MiB an engine, which nothing else
    ever removes). Returns (the names removed, its processes still alive, as `left_behind` names them)."""
    try:
        record = json.loads((Path(run_dir) / "processes.json").read_text())
        left = left_behind(record)
    except (OSError, ValueError):
        return [], []
    alive = [int(line.split()[0]) for line in left["processes"]]
    held = shm_entries_held(alive + [os.getpid()], open_files=True)  # this process: a run in it before (a test's)
    shm = record.get("shm") or {}
    # Not its weight slots (a path: swept by run_dirs), nor what a live process still maps.
    removed = [name for name in left["shm"] if "/" not in name and name not in held and unlink_same(name, shm[name])]
    return removed, left["processes"]


def left_behind(record: dict[str, Any]) -> dict[str, list[str]]:
    """What a finished run's `processes.json` (`record`, as read back) names that is still there: its processes alive
    (`processes.process_alive` with the recorded start: a zombie is not, nor a reused pid; nor the process asking,
    which is the driver of a run it called in-process) and its /dev/shm entries (the same inode) and weight slots;
    empty lists when nothing is. A record whose processes carry another kind of start time is refused."""
    pids = record.get("pids") or {}
    if pids and record.get("pid_start") != PID_START:
        raise ValueError(f"processes.json with pid_start={record.get('pid_start')!r}, expected {PID_START!r}: "
                         "written before start ticks were recorded; its start times cannot tell a reused pid")
    procs = []
    for pid, started in pids.items():
        if int(pid) == os.getpid() or not process_alive(int(pid), int(started)):
            continue
        try:
            procs.append(f"{pid} {' '.join(psutil.Process(int(pid)).cmdline())[:120]}")
        except psutil.Error:  # gone since
            continue
    shm = [name for name, inode in (record.get("shm") or {}).items() if same_entry(name, inode)]
    root = record.get("sync_root")
    if root and os.path.exists(root):
        shm.append(root)
    return {"processes": procs, "shm": shm}
