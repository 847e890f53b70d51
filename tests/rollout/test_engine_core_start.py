"""vLLM's engine core forked from a process server that imported vLLM (rollout/engine_core_start.py): what it finds
when it starts, and that it still dies with the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from moe_grpo.processes import process_alive

pytestmark = pytest.mark.slow  # starts process servers and process trees

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report(conn) -> None:  # noqa: ANN001 - a multiprocessing connection
    """What a process started from the engine-core context finds when its target starts (nothing imported yet)."""
    conn.send({"ppid": os.getppid(), "late": os.environ.get("MOE_GRPO_TEST_LATE_VAR"),
               "vllm_core_imported": "vllm.v1.engine.core" in sys.modules, "cpus": sorted(os.sched_getaffinity(0))})


def test_a_process_from_the_engine_core_context_is_forked_from_a_server_with_vllm_and_takes_the_callers_settings():
    """A process started from `ENGINE_CORE_CONTEXT` is a child of this process's server, finds vLLM's engine core
    already imported, and has the environment variables and CPU affinity this process set after the server
    started (vLLM sets variables just before it starts the engine core; an engine actor pins its cores). The
    server has one thread (no OpenMP pool a fork would break). Would catch an engine core spawned as a fresh
    interpreter (ppid this process, vLLM not imported) or one that gets the server's environment or cores."""
    import multiprocessing

    from moe_grpo.rollout import engine_core_start

    server = engine_core_start.start_server()
    assert engine_core_start.server_pid() == server
    before = os.sched_getaffinity(0)
    pinned = {min(before)}
    parent, child = multiprocessing.Pipe()
    os.environ["MOE_GRPO_TEST_LATE_VAR"] = "set after the server started"
    os.sched_setaffinity(0, pinned)
    try:
        proc = engine_core_start.ENGINE_CORE_CONTEXT.Process(target=_report, args=(child,))
        proc.start()
    finally:
        os.environ.pop("MOE_GRPO_TEST_LATE_VAR")
        os.sched_setaffinity(0, before)
    assert parent.poll(180), "the process reported within 180 s"
    seen = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0, proc.exitcode
    assert seen == {"ppid": server, "late": "set after the server started", "vllm_core_imported": True,
                    "cpus": sorted(pinned)}, seen
    assert len(os.listdir(f"/proc/{server}/task")) == 1, "the server runs one thread"


CLIENT = textwrap.dedent("""
    import os, sys, threading, time
    sys.path.insert(0, {root!r})
    from moe_grpo.process_ties import started_processes_die_with_this_thread
    from moe_grpo.rollout import engine_core_start

    engine_core_start.ENGINE_CORE_MODULES = ()  # what the server imports is not what this checks

    def worker(q):  # reports from its target: its tie (set after the fork, before the target) is in place
        q.put(os.getpid())
        time.sleep(300)

    def core(q):  # vLLM's engine core: forks its worker
        import multiprocessing as mp
        w = mp.get_context("fork").Process(target=worker, args=(q,), daemon=True)
        w.start()
        time.sleep(300)

    if __name__ == "__main__":
        ctx = engine_core_start.ENGINE_CORE_CONTEXT
        q = ctx.Queue()
        started = []
        def start():  # the engine's loop thread (lives on), as VllmEngine._astart
            with started_processes_die_with_this_thread():
                p = ctx.Process(target=core, args=(q,))
                p.start()
            started.append(p.pid)
            time.sleep(300)
        threading.Thread(target=start, daemon=True).start()
        worker_pid = q.get(timeout=120)
        print(engine_core_start.server_pid(), started[0], worker_pid, flush=True)
        time.sleep(300)
""")


def test_a_killed_client_takes_its_server_its_engine_core_and_the_core_s_worker_with_it(tmp_path):
    """A client (an engine actor) SIGKILLed while its engine core, forked from its server, runs a worker, all three
    SIGSTOPped: the kernel kills the server, the engine core and its worker in turn (each tied with PR_SET_PDEATHSIG
    to its parent; the server to the client's starter thread). Would catch a server that only exits on its own
    (seconds of interpreter teardown with vLLM loaded, never when stopped), or an engine core not tied to the server
    (it would outlive its client, holding the engine's memory). Within 5 s: the fault run's bound
    (tests/faults/test_engine_faults.py). The worker reports its pid itself, from its target: a worker stopped
    between its fork and its tie (set in the child) would outlive everything, a case no real run has (its
    parent's death found at the tie ends it: process_ties._die_with_parent), which failed this test once in CI."""
    script = tmp_path / "client.py"  # a file: the server's children import its functions from it
    script.write_text(CLIENT.format(root=ROOT))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        assert line, f"the client started its engine core (exit {proc.poll()})"
        pids = [int(x) for x in line.split()]
        server, core, worker = pids
        assert psutil.Process(core).ppid() == server and psutil.Process(worker).ppid() == core
        for pid in pids:  # none of them can act: only the kernel's ties can end them
            os.kill(pid, signal.SIGSTOP)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5.0
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = {p: psutil.Process(p).ppid() for p in pids if process_alive(p)}
        assert not left, (f"of server {server}, engine core {core} and worker {worker}, still there 5 s after their "
                          f"client was killed (pid: its parent now): {left}")
    finally:
        proc.kill()
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.vllm
def test_the_session_engines_core_was_forked_from_this_process_s_engine_core_server(engine_and_learner):
    """The engine a test builds with `VllmEngine` (the session engine) has its engine core forked from this
    process's server, which imported vLLM once, and vLLM's `get_mp_context` in vllm.v1.engine.utils is the one
    `install()` put there. Would catch `VllmEngine` no longer installing it: its engine core spawned again, a
    fresh interpreter importing vLLM (~10 s of every engine start and restart on 2 cores)."""
    import vllm.v1.engine.utils as engine_utils

    from moe_grpo.rollout import engine_core_start

    engine, _ = engine_and_learner
    cores = engine._processes.roots()
    assert len(cores) == 1, cores
    assert engine_core_start.installed() and engine_utils.get_mp_context is engine_core_start._get_mp_context
    assert psutil.Process(cores[0]).ppid() == engine_core_start.server_pid() != os.getpid()
