"""Watching what an engine's killed Ray actor leaves on the host: its vLLM processes and their /dev/shm ring buffers,
read from /proc as a user would."""

from __future__ import annotations

import os

import psutil


def environ_of(pid: int) -> dict[str, str]:
    """The environment `pid` started with."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def shm_mapped(pids: list[int]) -> set[tuple[str, int]]:
    """(name, inode) of the /dev/shm/psm_* entries (vLLM's ring buffers) that any of `pids` has mapped."""
    inodes = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            inodes |= {int(line.split()[4]) for line in f if "/dev/shm/psm_" in line}
    out = set()
    for name in os.listdir("/dev/shm"):
        if name.startswith("psm_"):
            try:
                if os.stat(f"/dev/shm/{name}").st_ino in inodes:
                    out.add((name, os.stat(f"/dev/shm/{name}").st_ino))
            except FileNotFoundError:
                pass
    return out


def gone(pid: int, started: float) -> bool:
    """Whether the process `pid` that started at `started` has ended (a zombie, or its pid reused, counts)."""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) > 1e-3 or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def shm_there(entries: set[tuple[str, int]]) -> bool:
    """Whether any of `entries` (from `shm_mapped`) is still in /dev/shm (the same file: same name, same inode)."""
    for name, ino in entries:
        try:
            if os.stat(f"/dev/shm/{name}").st_ino == ino:
                return True
        except FileNotFoundError:
            pass
    return False
