"""Who owns a run's weight buffers and private directory: a lock its owner holds for as long as it lives, never the
pid in the directory's name (which means nothing on another host sharing `sync.root`, in another pid namespace, or
once the pid is reused). The sweeps a starting run makes remove only what nobody holds."""

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from moe_grpo.orchestrator.run_dirs import (OWNER_LOCK, make_private_dir, make_sync_root, release,
                                            remove_orphaned_private_dirs, remove_orphaned_sync_roots)

ROOT = Path(__file__).resolve().parents[2]
HOLD = """import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], "owner.lock"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(600)
"""


def _process(code, *args):
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    line = proc.stdout.readline().strip()
    assert line, "the owner process did not start"
    return proc, line


def _kill(proc):
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _dead_pid():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


@pytest.fixture
def owners():
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            _kill(proc)


def test_a_live_runs_slots_are_kept_whatever_pid_their_name_carries_and_go_with_their_owner(tmp_path, owners):
    """Would have caught: the sweep read the pid in `run-<pid>-<time>`; a run whose driver's pid is not alive here
    (a driver on another host sharing sync.root, or in another pid namespace) lost its weight slots mid-run to any
    run starting here."""
    elsewhere = tmp_path / f"run-{_dead_pid()}-1795460000"
    elsewhere.mkdir()
    proc, _ = _process(HOLD, elsewhere)  # the run's owner, holding the directory as a run does
    owners.append(proc)
    assert remove_orphaned_sync_roots(str(tmp_path)) == []
    assert elsewhere.is_dir()
    _kill(proc)  # however the owner ends, the kernel drops its lock
    assert remove_orphaned_sync_roots(str(tmp_path)) == [elsewhere.name]
    assert not elsewhere.exists()


def test_a_reused_pid_does_not_keep_a_dead_runs_slots(tmp_path):
    """Would have caught: a dead run whose pid was reused by a live process (here: this test's own pid) kept its
    slots, up to twice the model in shared memory, until that unrelated process ended."""
    orphan = tmp_path / f"run-{os.getpid()}-1795460000"
    orphan.mkdir()
    (orphan / OWNER_LOCK).touch()  # its owner is gone: nobody holds the lock
    (orphan / "slot0").mkdir()
    other = tmp_path / "other"
    other.mkdir()
    assert remove_orphaned_sync_roots(str(tmp_path)) == [orphan.name]
    assert [p.name for p in tmp_path.iterdir()] == ["other"]


def test_a_dead_runs_slots_go_with_what_its_engines_recorded_in_dev_shm(tmp_path, monkeypatch):
    """A run SIGKILLed with its engines on a host other than its driver's (or its whole Ray job killed): the next
    run there sweeps its weight slots, and with them the vLLM ring buffers its engines recorded in them. Would
    have caught: the sweep removed the records unread, leaving ~400 MiB of /dev/shm per engine for good."""
    from moe_grpo.process_ties import TAG_ENV, owner_key, record_shm

    orphan = tmp_path / "run-1-1795460000-dead"
    orphan.mkdir()
    (orphan / OWNER_LOCK).touch()  # nobody holds it
    names = [f"psm_moe_grpo_test_{os.getpid()}_sweep_{i}" for i in range(2)]
    for name in names:
        open(f"/dev/shm/{name}", "w").close()
    try:
        owner = owner_key(str(orphan), "engine0")
        monkeypatch.setenv(TAG_ENV, f"{owner}/1/1")  # the killed engine actor
        record_shm(owner, str(orphan), {names[0]: os.stat(f"/dev/shm/{names[0]}").st_ino})
        monkeypatch.delenv(TAG_ENV)  # the next run's driver or relay agent
        assert remove_orphaned_sync_roots(str(tmp_path)) == [orphan.name]
        assert [os.path.exists(f"/dev/shm/{n}") for n in names] == [False, True], "its entry only"
    finally:
        for name in names:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_a_runs_own_directory_appears_held_and_another_owner_keeps_it_after_the_first_is_gone(tmp_path, owners):
    """The driver's directory (make_sync_root) is held from the moment it has its name; a relay agent on the same
    host (or on a host sharing the root) holds the same directory; a sweep removes it only once both are gone."""
    driver, line = _process("import sys, time\nfrom moe_grpo.orchestrator.run_dirs import make_sync_root\n"
                            "print(*make_sync_root(sys.argv[1]), flush=True)\ntime.sleep(600)", tmp_path)
    owners.append(driver)
    name, path = line.split()
    assert name.startswith(f"run-{driver.pid}-") and Path(path) == tmp_path / name
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert [p.name for p in tmp_path.iterdir()] == [name], "nothing else (the hidden name it was made under) is left"
    agent, _ = _process(HOLD, path)
    owners.append(agent)
    assert remove_orphaned_sync_roots(str(tmp_path)) == []
    _kill(driver)
    assert remove_orphaned_sync_roots(str(tmp_path)) == [], "the agent still holds it"
    _kill(agent)
    assert remove_orphaned_sync_roots(str(tmp_path)) == [name]


def test_a_run_in_this_process_keeps_its_directory_from_its_own_sweeps_until_released(tmp_path):
    name, path = make_sync_root(str(tmp_path))
    other_name, _ = make_sync_root(str(tmp_path))  # the second sweeps first: the first is held
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, other_name]) and name != other_name
    release(path)
    assert remove_orphaned_sync_roots(str(tmp_path)) == [name]


def test_a_directory_without_a_lock_file_is_left_alone_and_named(tmp_path, caplog):
    """Made by an earlier moe_grpo, which named directories by pid only: its owner cannot be told, so it is kept."""
    old = tmp_path / f"run-{_dead_pid()}-1795460000"
    old.mkdir()
    with caplog.at_level(logging.WARNING, logger="moe_grpo"):
        assert remove_orphaned_sync_roots(str(tmp_path)) == []
    assert old.is_dir()
    assert f"left {old.name} alone: no {OWNER_LOCK} in them" in caplog.text


def test_private_directories_are_swept_by_their_lock_too(tmp_path, owners):
    """Would have caught: the private directory (Ray's temp dir, vLLM's sockets) of a run whose pid was reused was
    kept, and one whose owner's pid is not visible here was removed under it."""
    proc, private = _process("import sys, time\nfrom moe_grpo.orchestrator.run_dirs import make_private_dir\n"
                             "print(make_private_dir(sys.argv[1]), flush=True)\ntime.sleep(600)", tmp_path)
    owners.append(proc)
    assert Path(private).parent == tmp_path and Path(private).name.startswith(f"moe_grpo-{os.getuid()}-{proc.pid}-")
    stale = tmp_path / f"moe_grpo-{os.getuid()}-{os.getpid()}-0000"  # a live pid (reused), nobody holds it
    stale.mkdir()
    (stale / OWNER_LOCK).touch()
    assert remove_orphaned_private_dirs([str(tmp_path)]) == [str(stale)]
    assert os.path.isdir(private)
    _kill(proc)
    assert remove_orphaned_private_dirs([str(tmp_path)]) == [private]
    mine = make_private_dir(str(tmp_path))
    assert remove_orphaned_private_dirs([str(tmp_path)]) == [] and os.path.isdir(mine)
    release(mine)


def test_a_second_driver_on_a_run_directory_is_refused_naming_the_first_and_let_in_once_it_is_gone(tmp_path):
    """A requeued job racing the one still running, or `resume=true` in a second terminal: before, the second driver
    was let in with a warning, and the two interleaved their checkpoints and records (a user's trial, 2026-11-28)."""
    from moe_grpo.orchestrator.run_dirs import RunDirTaken, driving

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom moe_grpo.orchestrator.run_dirs import "
                               f"driving\nwith driving({str(tmp_path)!r}):\n    print('held', flush=True)\n"
                               "    sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirTaken, match=rf"another driver is running in hydra.run.dir={tmp_path} \(pid "
                                              rf"{holder.pid} on .*\): stop it before continuing the run there"):
            with driving(str(tmp_path)):
                pass
        # From the command line: refused before Hydra writes its .hydra/ files (or a log) into the live run's
        cli = subprocess.run([sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", "resume=true",
                              f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
        assert cli.returncode == 2 and "another driver is running" in cli.stderr, cli.stderr[-2000:]
        assert sorted(p.name for p in tmp_path.iterdir()) == [".driver.lock"]
    finally:
        holder.communicate("\n", timeout=30)
    with driving(str(tmp_path)):  # the first driver ended (however it did: the lock goes with its process)
        with pytest.raises(RunDirTaken):
            with driving(str(tmp_path)):  # and a second call while held, in this process too
                pass
