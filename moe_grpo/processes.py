"""Whether a local process still runs, and which /dev/shm entries local processes hold: what the engine and the
driver check when a child or an actor may have died without the library in between (vLLM, Ray) noticing."""

from __future__ import annotations

import os
from typing import Iterable

SHM_DIR = "/dev/shm"


def process_alive(pid: int) -> bool:
    """False once the process has exited, including as a not yet reaped zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


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
