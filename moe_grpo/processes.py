"""Whether a local process still runs, and which /dev/shm entries local processes hold: what the engine and the
driver check when a child or an actor may have died without the library in between (vLLM, Ray) noticing."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterable, Iterator

import psutil


SHM_DIR = "/dev/shm"


GONE_STATES = ("Z", "X")
"""/proc states of a process that has exited: a zombie (not yet reaped) and dead. It holds no memory and does
nothing, so it counts as gone."""
STOPPED_STATES = ("T", "t")
"""/proc states of a process stopped by a signal (SIGSTOP) or by a tracer: alive, but it answers nothing."""


def start_ticks(pid: int) -> int | None:
    """The process's start time: clock ticks since boot (/proc/<pid>/stat field 22); None if it is gone or there is
    no procfs. Unlike psutil's `create_time` (those ticks plus /proc/stat's boot time, which moves by a second when
    the system clock is adjusted) it never changes, so it tells a reused pid from the process seen before."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_state(pid: int, started: int | None = None) -> str | None:
    """The process's state letter in /proc/<pid>/stat ("R" running, "S" sleeping, "T" stopped, "t" stopped by a
    tracer, "Z" zombie, ...); None once it is gone. `started`: its `start_ticks` as they were seen; a process
    started at another time holds a reused pid, and the one seen is gone. (Compared as epoch seconds from psutil,
    with a 1 ms tolerance, a clock adjustment during a long test session made a stopped engine worker look gone,
    and the engine's shutdown left it.) Without procfs a signal-0 probe answers: "?" for a process that exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        state = fields[0]
        if started is not None and int(fields[19]) != started:
            return None
        return state
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):  # no procfs: a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # another user's process: it exists
            pass
        return "?"


def process_tree(roots: Iterable[int]) -> list[psutil.Process]:
    """Each of `roots` still there and every process below it now (a root already gone contributes nothing)."""
    out: list[psutil.Process] = []
    for pid in roots:
        try:
            top = psutil.Process(pid)
            out += [top] + top.children(recursive=True)
        except psutil.Error:
            continue
    return out


def process_alive(pid: int, started: int | None = None) -> bool:
    """False once the process has exited, including as a not yet reaped zombie (and, with `started`, once its pid
    belongs to a process started at another time: see `process_state`)."""
    state = process_state(pid, started)
    return state is not None and state not in GONE_STATES


def shm_entries_held(pids: Iterable[int], *, open_files: bool = False, prefixes: tuple[str, ...] = (),
                     created_after: float | None = None) -> dict[str, int]:
    """/dev/shm entries (top level) that these processes map (`open_files`: or hold open): name -> inode; only names
    starting with one of `prefixes` (all when empty), created at or after `created_after` (wall clock) when given.

    Matched by inode: a semaphore is mapped under the temporary name glibc created it with, then linked to its final
    name, so its mapping reads `/dev/shm/sem.XXXXXX (deleted)`; a segment is mapped under its own name."""
    if not os.path.isdir(SHM_DIR):
        return {}
    held: set[tuple[int, int]] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
                        major, minor = parts[3].split(":")
                        held.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
        except (OSError, ValueError):
            pass
        if open_files:
            held |= _shm_open_in(pid)
    out: dict[str, int] = {}
    if not held:
        return out
    for name in os.listdir(SHM_DIR):
        if prefixes and not name.startswith(prefixes):
            continue
        try:
            st = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in held and (created_after is None or st.st_ctime >= created_after):
            out[name] = st.st_ino
    return out


def _shm_open_in(pid: int) -> set[tuple[int, int]]:
    """(device, inode) of the /dev/shm files process `pid` holds open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return set()
    held = set()
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM_DIR + "/"):
                st = os.stat(f"/proc/{pid}/fd/{fd}")
                held.add((st.st_dev, st.st_ino))
        except OSError:
            continue
    return held


def same_entry(name: str, inode: int) -> bool:
    """Whether /dev/shm entry `name` is still there as the entry of that inode (a name may have been reused by
    another job's since)."""
    try:
        return os.stat(os.path.join(SHM_DIR, os.path.basename(name)), follow_symlinks=False).st_ino == int(inode)
    except (OSError, ValueError):
        return False


def unlink_same(name: str, inode: int) -> bool:
    """Remove /dev/shm entry `name` if it is still the entry of that inode (`same_entry`); whether it was removed."""
    if not same_entry(name, inode):
        return False
    try:
        os.unlink(os.path.join(SHM_DIR, os.path.basename(name)))
        return True
    except OSError:
        return False


def entries_phrase(names: list[str]) -> str:
    """'2 /dev/shm entries (a, b)' for a log line."""
    return f"{len(names)} /dev/shm entr{'y' if len(names) == 1 else 'ies'} ({', '.join(names)})"


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has ended on this machine since it booted (/proc/vmstat
    `oom_kill`, Linux >= 4.13; a memory cgroup's limit counts as well as the machine running out); None where it
    cannot be read. Machine-wide: in a container it counts the host's other containers too."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def oom_note(since: int | None) -> str:
    """For the message of a process that died: '' or a clause saying the OOM killer ended processes on this host
    after `since` (an `oom_kills()` taken before the process could die). A process the OOM killer ends is
    SIGKILLed: nothing of it says why, and what reports its death (Ray, vLLM) says only that it is gone."""
    now = oom_kills()
    if since is None or now is None or now <= since:
        return ""
    n = now - since
    return (f" (the kernel's OOM killer ended {n} process{'es' if n > 1 else ''} on this host meanwhile, "
            "/proc/vmstat oom_kill: out of memory, most likely; `dmesg` names the process)")


@contextlib.contextmanager
def ctrl_c_left_to_this_process() -> Iterator[None]:
    """Processes started inside (a local Ray cluster's servers, and the workers they start later) ignore SIGINT:
    an ignored signal stays ignored across fork and exec. A Ctrl-C in the driver's terminal reaches every process of
    the terminal's group, and in Ray's workers it raised KeyboardInterrupt inside a running task: Ray's core worker
    crashed ("An unexpected system state", a 30-line stack dump) and a learner rank could be gone before the
    driver's checkpoint (a user's trial, 2026-11-28). The driver decides what a Ctrl-C does. A Ctrl-C inside (Ray's
    start, a few seconds) is lost: this process ignores it too meanwhile."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal's rule
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
