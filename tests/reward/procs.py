"""Which reward workers a process has (read from /proc; Linux), for the tests that check none is left behind."""

import os


def workers_of(pid: int, fn: str = "") -> list[int]:
    """Live (not zombie) child processes of `pid` that are reward workers (of the function `fn`, if given)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
        except OSError:
            continue
        if stat[1] == str(pid) and stat[0] != "Z" and b"_serve" in cmd and fn.encode() in cmd:
            found.append(int(d))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
