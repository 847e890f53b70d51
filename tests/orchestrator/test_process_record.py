"""processes.json names every process and /dev/shm entry a run had, so a check after the run sees what it left."""

import json
import os
import signal
import subprocess
import sys

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
