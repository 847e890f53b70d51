"""processes.json names every process and /dev/shm entry a run had, so a check after the run sees what it left."""

import json
import os
import signal
import subprocess
import sys
import time

from moe_grpo.orchestrator.process_record import ProcessRecord, left_behind

HOLDER = """
import mmap, os, sys, time
name = f"moe_grpo_leak_test_{os.getpid()}"
fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
print(name, flush=True)
time.sleep(600)
"""
"""A process of the run that maps a /dev/shm segment it created (as vLLM's engine core maps its message queues)."""


def read(record: ProcessRecord) -> dict:
    return json.loads(record.path.read_text())


def test_a_live_leaked_process_and_the_segment_it_holds_are_named(tmp_path):
    """A run's process left alive after the run, holding a segment the run created: the fault tests' checks could not
    see either. `shm_left_behind` subtracted every entry a live process maps (so a leaked live process's segments were
    invisible), and `leftovers()` knew only pids sampled while the test waited. The record names both; once the
    process is gone its segment is still named (nobody removed it); once that is gone, nothing is."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "faults"))
    from runs import shm_entries, shm_left_behind

    before = shm_entries()
    record = ProcessRecord(tmp_path, sync_root=str(tmp_path / "slots"))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    name = holder.stdout.readline().strip()
    try:
        record.update()
        saved = read(record)
        assert saved["driver"] == os.getpid() and str(holder.pid) in saved["pids"] and name in saved["shm"]
        left = left_behind(saved)
        assert [p.split()[0] for p in left["processes"]] == [str(holder.pid)], left
        assert left["shm"] == [name], left
        assert name not in shm_left_behind(before), "the old check is blind to a segment a live process holds"

        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert left_behind(saved) == {"processes": [], "shm": [name]}
        (tmp_path / "slots").mkdir()  # the run's weight slots, not removed
        assert left_behind(saved)["shm"] == [name, str(tmp_path / "slots")]
    finally:
        holder.kill()
        holder.wait()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
    (tmp_path / "slots").rmdir()
    assert left_behind(saved) == {"processes": [], "shm": []}


def test_release_removes_what_a_killed_process_of_the_run_left_and_nothing_from_before_it(tmp_path):
    """A SIGTERM to every process of a run (`scancel`, `timeout`) killed its engine's processes; their vLLM ring
    buffers (psm_*, ~400 MiB a run) stayed in /dev/shm after the run had cleaned up (a user's trial, 2026-11-28).
    The cleanup's last look removes every entry the run created that is still there; a segment from before the
    run, held by a process of the same driver, stays."""
    old = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    old_name = old.stdout.readline().strip()
    time.sleep(1.5)  # past the record's clock slack
    record = ProcessRecord(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    name = holder.stdout.readline().strip()
    try:
        record.update(full=True)
        os.kill(holder.pid, signal.SIGKILL)  # killed, not shut down: its segment stays
        holder.wait()
        assert os.path.exists(f"/dev/shm/{name}")
        assert record.release_shm() == [name] and not os.path.exists(f"/dev/shm/{name}")
        assert os.path.exists(f"/dev/shm/{old_name}"), "not the run's: created before it began"
        assert record.release_shm() == [], "each entry once"
    finally:
        for p, n in ((holder, name), (old, old_name)):
            p.kill()
            p.wait()
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_the_next_run_in_the_directory_removes_what_a_killed_driver_left(tmp_path):
    """A driver SIGKILLed (a node failure, the OOM killer) cleans nothing: its engines' ring buffers (~400 MiB)
    stayed in /dev/shm for good, and `resume=true` in the same directory rewrote processes.json without reading it
    (a user's trial, 2026-11-28). The next run there removes the entries none of the old run's live processes maps,
    and names those processes."""
    from moe_grpo.orchestrator.process_record import release_previous

    dead = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    dead_name = dead.stdout.readline().strip()
    alive = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    alive_name = alive.stdout.readline().strip()
    try:
        record = ProcessRecord(tmp_path, since=time.time() - 60)
        record.driver = dead.pid  # the killed run's processes: its driver and a process it left alive
        record.set_roles([alive.pid], {})
        record.update(full=True)
        assert {dead_name, alive_name} <= set(read(record)["shm"])
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        removed, still = release_previous(tmp_path)
        assert removed == [dead_name] and not os.path.exists(f"/dev/shm/{dead_name}")
        assert os.path.exists(f"/dev/shm/{alive_name}"), "still mapped by a live process of that run"
        assert [p.split()[0] for p in still] == [str(alive.pid)]
        assert release_previous(tmp_path / "no_run_here") == ([], [])
    finally:
        for p, n in ((dead, dead_name), (alive, alive_name)):
            p.kill()
            p.wait()
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_processes_and_entries_from_before_the_run_are_not_its_own(tmp_path):
    """A driver that existed before the run (a test calling `train`) has other children and segments: not the run's."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    name = holder.stdout.readline().strip()
    try:
        import time

        time.sleep(1.5)  # past the record's clock slack
        record = ProcessRecord(tmp_path)
        record.update(full=True)
        saved = read(record)
        assert str(holder.pid) not in saved["pids"] and name not in saved["shm"]
    finally:
        holder.kill()
        holder.wait()
        os.unlink(f"/dev/shm/{name}")


def test_left_behind_uses_the_one_liveness_rule_of_processes_py(tmp_path, monkeypatch):
    """`left_behind` judged liveness itself (psutil's epoch start time within 1 ms, psutil's zombie status) beside
    `processes.process_alive`. psutil's start time is /proc's start ticks plus the boot time in /proc/stat, which moves
    by whole seconds when the system clock is adjusted: after such an adjustment a process the run left alive read
    as gone, and the fault tests' check passed over it. The record now keeps start ticks, which never move. Pinned with
    it, as `process_alive` rules: a pid held by a process started at another time (a reused pid) is not the run's, a
    zombie is gone, and a record from before start ticks were kept is refused, naming what it lacks."""
    import psutil
    import pytest

    record = ProcessRecord(tmp_path)  # before the holder: it is the run's
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True)
    name = holder.stdout.readline().strip()
    try:
        record.update()
        saved = read(record)
        assert str(holder.pid) in saved["pids"]
        real_boot_time = psutil._pslinux.boot_time
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_boot_time() + 1.0)  # the clock moved 1 s
        assert [p.split()[0] for p in left_behind(saved)["processes"]] == [str(holder.pid)]
        monkeypatch.undo()

        reused = dict(saved, pids={pid: started + 1 for pid, started in saved["pids"].items()})
        assert left_behind(reused)["processes"] == []  # every pid now held by a process started at another time

        old = {key: value for key, value in saved.items() if key != "pid_start"}
        with pytest.raises(ValueError, match="pid_start"):
            left_behind(old)
        assert left_behind({}) == {"processes": [], "shm": []}  # no record yet (a run killed before it wrote one)

        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while psutil.Process(holder.pid).status() != psutil.STATUS_ZOMBIE:  # killed, not yet reaped
            assert time.monotonic() < deadline, "the killed holder never became a zombie"
            time.sleep(0.05)
        assert left_behind(saved)["processes"] == []
    finally:
        holder.kill()
        holder.wait()
        os.unlink(f"/dev/shm/{name}")
