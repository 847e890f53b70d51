"""The run's own directories (its private scratch directory, its weight buffers on each host), who owns them, and the
checks on its run directory.

Ray's default `/tmp/ray` and vLLM's default socket directory (the system temp dir) are shared by every user and
every run on a host: a stray `ray_current_cluster` file there made default runs fail, and sockets there can be
reached by anyone. Each run gets `/tmp/moe_grpo-<uid>-<pid>-<random>` instead, mode 0700, removed when the run
ends. Its weight buffers live in `run-<pid>-<time>-<random>` under each host's sync root (sync/layout.host_root).

A run SIGKILLed cannot remove them; the next run of the same user sweeps them. Who owns a directory is decided by a
lock, never by the pid in its name (a pid means nothing on another host sharing `sync.root`, in another pid
namespace, or once reused): every process that owns one holds a shared `flock` on its `OWNER_LOCK` file for as long
as it lives, and the kernel drops the lock when that process dies however it dies. A sweep removes a directory only
when it can take the lock exclusively, i.e. nobody holds it. A directory appears under its name with the lock
already held (made under a hidden name and renamed into place), so a sweep never sees a live one unlocked. One
without a lock file was made by an earlier moe_grpo (owner unknown): it is left alone and named in the log.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
from typing import Callable, Iterator

from moe_grpo.process_ties import remove_recorded_shm

log = logging.getLogger("moe_grpo")

PRIVATE_PREFIX = "moe_grpo-"
SYNC_PREFIX = "run-"
OWNER_LOCK = "owner.lock"
"""In each directory a run owns: the file its owners hold a shared flock on."""
MAX_BASE_CHARS = 40
"""Ray puts unix sockets under `<temp>/session_<date>_<pid>/sockets/`; AF_UNIX paths are limited to 107 bytes, so a
long TMPDIR is replaced by /tmp."""
LOCK_WAIT_S = 10.0
"""How long an owner waits for its shared lock while a sweep briefly holds it (only on a directory another owner
already holds, where the sweep lets go at once)."""

_held: dict[str, int] = {}
"""Directory -> the descriptor of its lock file this process holds (closed by `release`, or once the directory is
gone)."""


def hold(path: str) -> None:
    """Hold a shared lock on `path`'s owner file for as long as this process lives (or until `release(path)`): the
    directory is in use. Several processes may hold it (the driver and a relay agent on the same host)."""
    path = os.path.abspath(path)
    _forget_removed()
    if path in _held:
        return
    fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(f"{path}: its {OWNER_LOCK} stayed locked exclusively for {LOCK_WAIT_S:g} s (an "
                                   "orphan sweep removing it?); expected to share it with the directory's owner")
            time.sleep(0.05)
        except OSError:
            os.close(fd)
            raise
    _held[path] = fd


def release(path: str) -> None:
    """Stop holding `path` (after removing it: a directory still there becomes sweepable)."""
    fd = _held.pop(os.path.abspath(path), None)
    if fd is not None:
        os.close(fd)


def _forget_removed() -> None:
    """Close the locks of directories this process held that are gone (removed without `release`)."""
    for path, fd in list(_held.items()):
        try:
            gone = os.fstat(fd).st_nlink == 0
        except OSError:
            gone = True
        if gone:
            release(path)


def make_owned_dir(parent: str, name: Callable[[], str], *, existing_ok: bool = False) -> str:
    """A new 0700 directory `parent/<name()>`, held by this process (`hold`) before it appears under its name.
    `name` is asked again if the name is taken; with `existing_ok` the directory of that name is held instead (a
    relay agent on the driver's host, or on a host sharing its root: several owners of one directory)."""
    while True:
        final = os.path.join(parent, name())
        aside = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=parent)  # 0700, invisible to sweeps
        try:
            hold(aside)
            os.rename(aside, final)  # fails on any directory of ours there: it holds its lock file
        except OSError as e:
            release(aside)
            shutil.rmtree(aside, ignore_errors=True)
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
            if existing_ok:
                hold(final)
                return final
            continue
        _held[os.path.abspath(final)] = _held.pop(os.path.abspath(aside))
        return final


def _claim_orphan(path: str) -> int | bool | None:
    """The descriptor of `path`'s owner lock, locked exclusively (nobody holds it: an orphan), True when someone
    holds it, None when its owner cannot be told (no lock file: made by an earlier moe_grpo; or a file system
    without flock)."""
    try:
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return True
    except OSError as e:  # ENOLCK / ENOSYS (e.g. Lustre without -o flock)
        os.close(fd)
        log.warning("%s: cannot test its owner lock (%s); kept", path, errno.errorcode.get(e.errno, e.errno))
        return None


def owner_alive(path: str) -> bool | None:
    """Whether a process holds `path`'s owner lock: True, False (an orphan), or None (cannot be told)."""
    claim = _claim_orphan(path)
    if claim is True or claim is None:
        return claim
    os.close(claim)
    return False


def sweep_orphans(base: str, prefix: str, before_removal: Callable[[str], object] | None = None) -> list[str]:
    """Remove this user's directories `base/<prefix>*` whose owner lock nobody holds; returns their names.
    `before_removal(path)` runs on each first, the lock held."""
    removed, unknown = [], []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        try:
            if (not name.startswith(prefix) or os.path.islink(path) or not os.path.isdir(path)
                    or os.stat(path).st_uid != os.getuid()):
                continue
        except OSError:
            continue
        claim = _claim_orphan(path)
        if claim is None:
            unknown.append(name)
        elif claim is not True:
            try:  # removed while the exclusive lock is held: no owner can appear meanwhile
                if before_removal is not None:
                    before_removal(path)
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(claim)
            removed.append(name)
    if unknown:
        log.warning("%s: left %s alone: no %s in them (made by an earlier moe_grpo, whose owner cannot be told); "
                    "remove them by hand once no run uses them", base, ", ".join(unknown), OWNER_LOCK)
    return removed


def private_bases() -> list[str]:
    """Where `make_private_dir` puts private directories."""
    return sorted({tempfile.gettempdir(), "/tmp"})


def make_private_dir(base: str | None = None) -> str:
    """A fresh 0700 directory owned by this user and held by this process (see `remove_orphaned_private_dirs`)."""
    if base is None:
        base = tempfile.gettempdir()
        if len(base) > MAX_BASE_CHARS:
            base = "/tmp"
    return make_owned_dir(base, lambda: f"{PRIVATE_PREFIX}{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}")


def remove_orphaned_private_dirs(bases: list[str] | None = None) -> list[str]:
    """Private dirs of this user's runs that no live process holds (a SIGKILLed driver could not clean up)."""
    removed = []
    for base in private_bases() if bases is None else bases:
        removed += [os.path.join(base, n) for n in sweep_orphans(base, f"{PRIVATE_PREFIX}{os.getuid()}-")]
    return removed


def make_sync_root(root: str) -> tuple[str, str]:
    """This run's weight-buffer directory under this host's sync root `root`, held by this process: (its name,
    the same on every host, and its path). What SIGKILLed runs left under `root` is swept first."""
    from moe_grpo.sync.transport import secure_root

    secure_root(root)
    remove_orphaned_sync_roots(root)
    path = make_owned_dir(root, lambda: f"{SYNC_PREFIX}{os.getpid()}-{int(time.time())}-{secrets.token_hex(4)}")
    secure_root(path)
    return os.path.basename(path), path


def remove_orphaned_sync_roots(root: str) -> list[str]:
    """Weight slots of runs no live process holds (up to twice a model's size in shared memory each): the driver on
    its host, a relay agent on the others (sync_hosts.SyncHostAgent), with the /dev/shm entries their engines
    recorded there (`process_ties.record_shm`: vLLM's ring buffers of engines killed with their run, ~400 MiB
    each). Returns the names removed."""
    shm: list[str] = []
    removed = sweep_orphans(root, SYNC_PREFIX, lambda path: shm.extend(remove_recorded_shm(path)))
    if removed:
        log.info("removed the weight slots of %d run(s) nobody holds any more: %s%s", len(removed), ", ".join(removed),
                 f", and what their engines left in /dev/shm: {', '.join(shm)}" if shm else "")
    return removed


def release_private_dir(private_dir: str | None, run_dir: str) -> None:
    """Once Ray is down: keep Ray's logs (the run dir's `ray_logs` link pointed into `private_dir`: it becomes a copy)
    and remove the private directory."""
    if not private_dir:
        return
    link = os.path.join(run_dir, "ray_logs")
    try:
        if os.path.islink(link) and os.path.realpath(link).startswith(os.path.realpath(private_dir) + os.sep):
            target = os.path.realpath(link)
            os.unlink(link)
            if os.path.isdir(target):
                shutil.copytree(target, link, ignore_dangling_symlinks=True)
    except OSError:
        pass  # the logs are a convenience; the private directory goes either way
    shutil.rmtree(private_dir, ignore_errors=True)
    release(private_dir)


RECORD = ("metrics.jsonl", "checkpoints")
"""What marks a directory as holding a run's record (run_record.py, run_checkpoint.py)."""


class RunDirTaken(RuntimeError):
    """The run directory holds another run's record and `resume=true` was not given."""


def unwritable(run_dir: str) -> str | None:
    """Why `run_dir` cannot be made or written (the directory, or its nearest existing parent, is on a read-only
    file system or not writable by this user), or None."""
    where = os.path.abspath(run_dir)
    while not os.path.lexists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    if not os.path.isdir(where):  # a file, or a symlink to nothing
        return f"{where} is not a directory"
    try:
        if os.statvfs(where).f_flag & os.ST_RDONLY:
            return f"{where} is on a read-only file system"
    except OSError as e:
        return f"{where}: {e.strerror}"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"{where} is not writable by this user"
    return None


def check_run_dir(run_dir: str, resume: bool) -> None:
    """Refuse `run_dir` when it holds a run's record (`metrics.jsonl`, `checkpoints/`) unless `resume`: two runs
    in one directory interleave their metrics and overwrite each other's config and policy."""
    if resume or not os.path.isdir(run_dir):
        return
    found = [name for name in RECORD if os.path.exists(os.path.join(run_dir, name))
             and not (os.path.isdir(os.path.join(run_dir, name)) and not os.listdir(os.path.join(run_dir, name)))]
    if found:
        raise RunDirTaken(f"hydra.run.dir={run_dir} already holds a run's record ({', '.join(found)}); continue that "
                          "run with resume=true, or leave hydra.run.dir unset for a fresh directory")


DRIVER_LOCK = ".driver.lock"
"""The file in a run directory whose exclusive lock its driver holds while the run goes (`driving`)."""


@contextlib.contextmanager
def driving(run_dir: str) -> Iterator[None]:
    """Hold `run_dir` for this driver while the block runs. A second driver started on it (a requeued job racing the
    one still running, a double submit, `resume=true` in a second terminal) is refused with `RunDirTaken` naming the
    first; before, both ran, interleaving their checkpoints and records and removing each other's files. Where the
    file system has no flock (ENOLCK), the run goes on unguarded, with a warning; where flock is per node only (Lustre
    `localflock`, NFS `local_lock=flock`), only drivers on the same node are refused."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, DRIVER_LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:  # a symlink there, a read-only or full file system: unguarded, as without flock
        log.warning("%s: cannot open it (%s): a second driver started there would not be refused", path, e)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "its pid unknown"
            raise RunDirTaken(f"another driver is running in hydra.run.dir={run_dir} ({holder}): stop it before "
                              "continuing the run there (two drivers interleave checkpoints and records), or leave "
                              "hydra.run.dir unset for a fresh directory (if that process is gone, as after a node "
                              f"crash on NFS, which can keep its lock for a while, remove {path})") from None
        except OSError as e:  # ENOLCK / ENOSYS (e.g. Lustre without -o flock)
            log.warning("%s: cannot lock it (%s): a second driver started there would not be refused", path,
                        errno.errorcode.get(e.errno, e.errno))
        else:
            with contextlib.suppress(OSError):  # who holds it, for the refusal's message only (a full disk: unsaid)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # the lock goes with it


def low_disk_note(path: str) -> str:
    """"; its file system has N MiB free" when the file system holding `path` has under 1 GiB free, else "": a write
    failing there shows up as errors that do not say so (a checkpoint on a full disk ended in "unexpected pos 704 vs
    598", a user's trial, 2026-11-28). Quotas are not seen."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ""
    if usage.free >= 1 << 30:
        return ""
    return f"; {path}'s file system has {usage.free / (1 << 20):.0f} MiB free"

