"""Processes that end with the process that started them, and the leftovers of an owner that died anyway.

An engine actor owns vLLM's engine core and its workers (on CPU the engine core is forked from a process server
that imported vLLM, rollout/engine_core_start.py, elsewhere vLLM spawns it; the engine core forks its
workers, rollout/worker_start.py, or spawns them where vLLM must). When the actor is SIGKILLed nothing of it runs to end them, and a replacement that
started beside them would find their memory (GPU memory, `/dev/shm` ring buffers) still taken. Two parts:

- `started_processes_die_with_this_thread()`: every process this thread starts inside the block, forked or spawned,
  gets Linux's PR_SET_PDEATHSIG=SIGKILL, and so does every process those start (and theirs): the kernel kills
  them when their parent goes, however it goes. PR_SET_PDEATHSIG is cleared by fork, so it is set in each child:
  after a fork by an at-fork hook; in a spawned child (a fresh interpreter: no at-fork hook runs) by a wrapper
  around the Process's target, put there when the process is started (a patch of CPython's
  `multiprocessing.context.SpawnProcess._Popen`, checked against CPython 3.11, the project's Python; the
  spawn tests in tests/test_process_ties.py fail if a newer one changes it). A child whose parent died before it set the signal (a race the kernel cannot see) ends itself.
- `tag_processes(owner)` marks this process's environment, which every process it starts inherits (spawn and fork
  alike); `leftovers(owner)` finds, on this host, the processes of an earlier holder of the same owner name (an
  actor of the same engine that died) that are still there, and `wait_until_gone` waits for them with a timeout
  and names them when they stay.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import context
from typing import Any, Callable, Iterator

from moe_grpo.processes import process_alive, start_ticks, unlink_same

TAG_ENV = "MOE_GRPO_OWNER"
"""The environment variable that marks the processes of an owner: `<owner>/<owner pid>/<owner start time>`."""

_local = threading.local()
_whole_process = False
"""Set in a tied child: every process it starts is tied as well (vLLM's engine core starting its workers)."""
_installed = False
_install_lock = threading.Lock()


def _prctl_pdeathsig() -> bool:
    """PR_SET_PDEATHSIG=SIGKILL for this process; False where Linux's prctl is not there."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def _die_with_parent(parent_pid: int) -> None:
    """In a just-started child: be SIGKILLed when the parent goes; if it went already, go now."""
    global _whole_process
    if not _prctl_pdeathsig():
        return
    _whole_process = True
    if os.getppid() != parent_pid:  # the parent died between the fork and the prctl: nothing will signal us
        os.kill(os.getpid(), signal.SIGKILL)


def _tying() -> bool:
    return _whole_process or bool(getattr(_local, "active", False))


class _TiedTarget:
    """A spawned process's target, run after the process is tied to its parent (pickled to the child by reference
    to this module, which the child imports)."""

    def __init__(self, target, parent_pid: int) -> None:
        self.target, self.parent_pid = target, parent_pid

    def __call__(self, *args, **kwargs):
        _install()
        _die_with_parent(self.parent_pid)
        return self.target(*args, **kwargs)


def _install() -> None:
    """The at-fork hook and the spawn wrapper, once per process; both act only while `_tying()`."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
        forking = threading.local()

        def before() -> None:
            forking.parent = os.getpid() if _tying() else None

        def after_in_child() -> None:
            parent = getattr(forking, "parent", None)  # the forking thread is the child's only thread
            if parent is not None:
                _die_with_parent(parent)

        os.register_at_fork(before=before, after_in_child=after_in_child)

        original = context.SpawnProcess._Popen

        def popen(process_obj):
            target = getattr(process_obj, "_target", None)
            if _tying() and target is not None and not isinstance(target, _TiedTarget):
                process_obj._target = _TiedTarget(target, os.getpid())
            return original(process_obj)

        context.SpawnProcess._Popen = staticmethod(popen)


def tied_target(target: Callable[..., Any], parent_pid: int) -> Callable[..., Any]:
    """`target` as a process started now from this thread should run it: tied to `parent_pid` (the process that
    forks it: a process server's, `rollout/engine_core_start.py`) while `started_processes_die_with_this_thread`
    is active here, else unchanged. For process kinds the spawn wrapper does not see."""
    if not _tying() or isinstance(target, _TiedTarget):
        return target
    _install()
    return _TiedTarget(target, parent_pid)


@contextlib.contextmanager
def started_processes_die_with_this_thread() -> Iterator[None]:
    """Processes this thread starts inside the block (os.fork, multiprocessing fork or spawn), and every process
    they start, are SIGKILLed by the kernel when their parent thread ends (this process dying included).

    Only this thread's starts are tied: another thread's children (a pool started from a short-lived thread)
    would otherwise die when that thread ends. The process that starts them must keep this thread alive as long
    as they should live (an engine's own event-loop thread does)."""
    _install()
    before = getattr(_local, "active", False)
    _local.active = True
    try:
        yield
    finally:
        _local.active = before


# ---------------------------------------------------------------------- finding an earlier owner's processes
def owner_key(*parts: str) -> str:
    """An owner name for `tag_processes` from free text (a run directory and an engine name): no '/' or NUL."""
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:16]


def tag_processes(owner: str) -> str:
    """Mark this process as `owner`'s current holder: every process started from here on carries the mark."""
    pid = os.getpid()
    tag = f"{owner}/{pid}/{start_ticks(pid)}"
    os.environ[TAG_ENV] = tag
    return tag


@dataclass(frozen=True)
class Leftover:
    """A process still there from an earlier holder of an owner."""

    pid: int
    holder: int
    """The pid of the holder that started it (the dead engine actor)."""
    holder_alive: bool
    """Whether that holder itself is still there (then it is a leftover too, listed with its own pid)."""
    command: str

    def __str__(self) -> str:
        return f"{self.pid} ({self.command or '?'})"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return ""


def leftovers(owner: str) -> list[Leftover]:
    """Processes on this host, other than this one's, marked by an earlier holder of `owner`, that are still
    there (a zombie is gone: it holds no memory), and those holders themselves. Processes of other users are not
    readable and not listed."""
    me, mine = os.getpid(), start_ticks(os.getpid())
    holders: dict[tuple[int, int], bool] = {}
    found: list[tuple[int, int]] = []
    prefix = f"{TAG_ENV}={owner}/".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        at = env.find(prefix)
        if at < 0 or (at > 0 and env[at - 1] != 0):
            continue
        value = env[at + len(prefix):].split(b"\0", 1)[0].decode(errors="replace")
        try:
            holder, ticks = (int(x) for x in value.split("/"))
        except ValueError:
            continue
        if (holder, ticks) == (me, mine) or not process_alive(int(entry)):
            continue
        found.append((int(entry), holder))
        holders.setdefault((holder, ticks), start_ticks(holder) == ticks and process_alive(holder))
    alive = {h for (h, _), up in holders.items() if up}
    out = [Leftover(pid, holder, holder in alive, _command(pid)) for pid, holder in found]
    out += [Leftover(h, h, True, _command(h)) for h in sorted(alive) if h not in {p for p, _ in found}]
    return sorted(out, key=lambda x: x.pid)


class LeftoverProcessesError(RuntimeError):
    """Processes of an earlier holder of an owner were still there at the timeout; names them."""


def wait_until_gone(owner: str, what: str, timeout_s: float, kill_after_s: float | None = None, *,
                    since: float | None = None) -> list[Leftover]:
    """Return once no process of an earlier holder of `owner` is left on this host (at once if none is); returns
    those there were. `kill_after_s`: SIGKILL after that many seconds those whose holder is dead (nothing else
    will end them: the tie did not reach them). `since`: the `time.monotonic()` both count from (default: now; a
    caller that did other work first, beside the leftovers, counts from its own start). Raises
    LeftoverProcessesError naming `what` and the pids left."""
    t0 = time.monotonic() if since is None else since
    first = left = leftovers(owner)
    killed: set[int] = set()
    while left:
        waited = time.monotonic() - t0
        if kill_after_s is not None and waited >= kill_after_s:
            for p in left:
                if not p.holder_alive and p.pid not in killed:
                    with contextlib.suppress(OSError):
                        os.kill(p.pid, signal.SIGKILL)
                    killed.add(p.pid)
        if waited > timeout_s:
            raise LeftoverProcessesError(
                f"{what}: processes of its previous actor still there after {timeout_s:.0f} s: "
                f"{', '.join(map(str, left))}" + (f" (SIGKILLed: {sorted(killed)})" if killed else "") +
                "; not starting beside them (their memory is still taken)")
        time.sleep(0.05)
        left = leftovers(owner)
    return first


# ---------------------------------------------------------------------- what a holder leaves in /dev/shm


RECORD_PREFIX = "moe_grpo-owner-"
"""A holder's record of its /dev/shm entries: `<directory>/moe_grpo-owner-<owner>.json`."""


def _record_path(owner: str, directory: str) -> str:
    return os.path.join(directory, f"{RECORD_PREFIX}{owner}.json")


def record_shm(owner: str, directory: str, entries: dict[str, int]) -> None:
    """Note the /dev/shm entries (name -> inode) this holder's processes created, in `directory` on this host:
    nothing of a SIGKILLed holder removes them (multiprocessing's resource tracker, which would, goes with it), so
    the next holder of `owner` does (`remove_previous_shm`)."""
    path = _record_path(owner, directory)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"holder": os.environ.get(TAG_ENV, ""), "shm": entries}, f)
    except FileNotFoundError:  # the run's buffers already removed: it is ending, and its cleanup reads no more
        return
    os.replace(tmp, path)


def forget_shm(owner: str, directory: str) -> None:
    """This holder removed its entries itself (an orderly shutdown): drop the record."""
    with contextlib.suppress(OSError):
        os.unlink(_record_path(owner, directory))


def remove_previous_shm(owner: str, directory: str) -> list[str]:
    """Remove the /dev/shm entries an earlier holder of `owner` recorded (each only if it is still the same inode),
    and the record; returns the names removed. Call it once that holder's processes are gone (`wait_until_gone`):
    nothing maps them any more."""
    return _remove_recorded(_record_path(owner, directory))


def remove_recorded_shm(directory: str, *, dead_holders_only: bool = False) -> list[str]:
    """At a run's end, once its engines are stopped: what every holder recorded in `directory` (`record_shm`) and did
    not remove itself (an engine killed, or restarting, when the run ended); returns the names removed.
    `dead_holders_only`: only what holders no longer alive recorded (a relay agent's host while that host's engines
    still run: they remove their own when they stop)."""
    removed: list[str] = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(directory)):
            if name.startswith(RECORD_PREFIX) and name.endswith(".json"):
                removed += _remove_recorded(os.path.join(directory, name), dead_holders_only)
    return sorted(removed)


def _holder_alive(tag: str) -> bool:
    """Whether the holder a `TAG_ENV` value names (`<owner>/<pid>/<start ticks>`) is still there; False when the tag
    cannot be read (nothing else could remove what it recorded)."""
    try:
        _, pid, ticks = tag.rsplit("/", 2)
        return process_alive(int(pid), int(ticks))
    except ValueError:
        return False


def _remove_recorded(path: str, dead_holders_only: bool = False) -> list[str]:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(record, dict) or not isinstance(record.get("shm", {}), dict):
        return []  # not a record this module wrote: nothing to act on (and no sweep may fail on it)
    if record.get("holder") and record.get("holder") == os.environ.get(TAG_ENV):
        return []  # this holder's own
    if dead_holders_only and _holder_alive(str(record.get("holder", ""))):
        return []
    removed = [name for name, inode in dict(record.get("shm", {})).items() if unlink_same(name, inode)]
    with contextlib.suppress(OSError):
        os.unlink(path)
    return sorted(removed)
