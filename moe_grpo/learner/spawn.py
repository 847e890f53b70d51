"""Run one function in N local processes that form a torch.distributed group.

Used by the multi-process tests and benchmarks on a single CPU host and by the
checkpoint tools' verification (on a cluster, torchrun or Ray sets the same
environment variables). Results come back per rank; a failure in any rank raises
here with that rank's traceback, and a hung group is killed after `timeout_s`.

Ranks are forked from multiprocessing's process server (`forkserver`), which
imports torch and megatron-core once per calling process (`PRELOADED_MODULES`)
and has run nothing else: no threads, no CUDA, no patch applied, so each rank
starts as clean as a spawned interpreter without paying ~6 s of imports per
group (2 cores; tools/bench_spawn.py measures both side by side).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import socket
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

from moe_grpo.carried_env import CallerSettings
from moe_grpo.learner.parallel import SECRET_ENV

PRELOADED_MODULES: tuple[str, ...] = (
    "torch", "torch.distributed", "megatron.core.models.gpt", "megatron.core.optimizer",
    "megatron.core.distributed", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing")
"""What the process server imports before forking ranks: third-party modules only (moe_grpo's patches of
megatron-core must start unapplied in every rank, and do: importing applies none). On a host with CUDA only torch
is preloaded (`preloaded_here`): torch's import leaves CUDA uninitialised, which forking needs; megatron-core's
import is not checked for that here (no GPU on the machines this was measured on), so it stays in the ranks."""


def cuda_host() -> bool:
    """Whether torch sees a CUDA device on this host (asked in the caller; the process server is a fresh
    interpreter that only imports, so nothing this touches reaches it)."""
    import torch

    return bool(torch.cuda.is_available())


def preloaded_here() -> tuple[str, ...]:
    """`PRELOADED_MODULES` as this host uses it: all of them, or only torch on a CUDA host."""
    return PRELOADED_MODULES[:1] if cuda_host() else PRELOADED_MODULES


def _context(start_method: str = "forkserver") -> Any:
    """The forkserver context, its server told what to preload (only read when the server starts: the first
    `run_distributed` of a process; later calls reuse it); or the spawn context."""
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method={start_method!r}, expected 'forkserver' or 'spawn'")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(preloaded_here()))
    return ctx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out_dir: str, args: tuple, env: dict,
           secret: str, caller: CallerSettings) -> None:
    # The server's environment is the caller's at the server's start; a rank gets the caller's as it is now.
    caller.apply()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{SECRET_ENV: secret})
    # Each rank gets one intra-op thread: ranks share the host's cores.
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        result: Any = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        result = ("error", traceback.format_exc())
    with open(path, "wb") as f:
        pickle.dump(result, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


class DistributedRunError(RuntimeError):
    """A rank raised or the group timed out."""


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0,
                    env: dict[str, str] | None = None, start_method: str = "forkserver",
                    stop: threading.Event | None = None) -> list[Any]:
    """`fn(*args)` on ranks 0..world_size-1; returns their results in rank order. `start_method` 'spawn' for a
    one-off group in a long-lived process (a run's driver converting its checkpoint): its first forkserver group
    costs as much as a spawned one, and the server (torch and megatron-core in memory) would stay beside it.

    `stop`: set from another thread, it kills the ranks at once and raises `DistributedRunError` (a run that ends
    while its checkpoint converts on a thread; its ranks are not daemons, so the interpreter's exit would wait)."""
    ctx = _context(start_method)
    port = free_port()
    secret = secrets.token_hex(32)  # this group's rendezvous secret (parallel.init_distributed)
    with tempfile.TemporaryDirectory(prefix="moe_grpo_spawn_") as out_dir:
        caller = CallerSettings.now()
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, out_dir, args, env or {}, secret, caller),
                             daemon=False) for r in range(world_size)]
        for p in procs:
            p.start()

        deadline = time.monotonic() + timeout_s
        for p in procs:
            while p.is_alive() and time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                p.join(min(0.2 if stop is not None else timeout_s, max(0.0, deadline - time.monotonic())))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung and stop is not None and stop.is_set():
            raise DistributedRunError(f"{fn.__name__} on {world_size} processes stopped before it finished")
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: " + ("timed out" if r in hung else f"died (exit code {procs[r].exitcode})"))
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
                results.append(None)
            else:
                results.append(value)
        if errors:
            raise DistributedRunError(f"{fn.__name__} on {world_size} processes failed:\n" + "\n".join(errors))
        return results
