"""The run's private scratch directory (Ray's temp dir, vLLM's RPC sockets) and the checks on its run directory.

Ray's default `/tmp/ray` and vLLM's default socket directory (the system temp dir) are shared by every user and
every run on a host: a stray `ray_current_cluster` file there made default runs fail, and sockets there can be
reached by anyone. Each run gets `/tmp/moe_grpo-<uid>-<pid>-<random>` instead, mode 0700, removed when the run
ends (and, after a SIGKILL, by the next run of the same user, as the weight slots are).
"""

from __future__ import annotations

import os
import shutil
import tempfile

PRIVATE_PREFIX = "moe_grpo-"
MAX_BASE_CHARS = 40
"""Ray puts unix sockets under `<temp>/session_<date>_<pid>/sockets/`; AF_UNIX paths are limited to 107 bytes, so a
long TMPDIR is replaced by /tmp."""


def make_private_dir() -> str:
    """A fresh 0700 directory owned by this user, named after this process (see `remove_orphaned_private_dirs`)."""
    base = tempfile.gettempdir()
    if len(base) > MAX_BASE_CHARS:
        base = "/tmp"
    return tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getuid()}-{os.getpid()}-", dir=base)  # mkdtemp: 0700


def remove_orphaned_private_dirs() -> list[str]:
    """Private dirs of this user's runs whose driver is gone (SIGKILLed: it could not clean up)."""
    from moe_grpo.sync.transport import _pid_alive

    removed = []
    bases = {tempfile.gettempdir(), "/tmp"}
    mine = f"{PRIVATE_PREFIX}{os.getuid()}-"
    for base in bases:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            rest = name[len(mine):].split("-") if name.startswith(mine) else []
            path = os.path.join(base, name)
            if (len(rest) == 2 and rest[0].isdigit() and not _pid_alive(int(rest[0]))
                    and os.path.isdir(path) and not os.path.islink(path) and os.stat(path).st_uid == os.getuid()):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
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


RECORD = ("metrics.jsonl", "checkpoints")
"""What marks a directory as holding a run's record (run_record.py, run_checkpoint.py)."""


class RunDirTaken(RuntimeError):
    """The run directory holds another run's record and `resume=true` was not given."""


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
