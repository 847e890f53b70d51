"""An engine actor whose vLLM process hangs (SIGSTOP) or dies (SIGKILL) mid-rollout: the rollout fails naming the
engine, `EngineWorker.restart()` brings up new processes serving the version served before, and nothing of the
old processes is left: no process, no /dev/shm segment. Then a shutdown of an engine whose engine core was
killed and whose worker was stopped leaves nothing either.

One `EngineWorker` (the Ray actor's class, driven here on an event loop of its own as Ray drives an async actor)
over a tiny random model; it serves version 1 (published through a shared-memory transport), so a restart
that fell back to the model directory would show in its greedy tokens. Engine starts: the fixture's and one per
restart (two). The tests run in order on the same engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch
from publishing import publish_version

from moe_grpo.processes import process_state

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TIMEOUT_S = 8.0  # rollout.request_timeout_s: a stopped engine is named hung after this
LONG = dict(n=1, temperature=1.0, max_tokens=400, stop_token_ids=())  # still running when the signal lands
PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 3, 3, 17, 90, 4], [1, 44]]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return None


def _remains(pid: int) -> bool:
    """The process still runs (or is stopped), or is an unreaped child of this process."""
    state = process_state(pid)
    if state is None:
        return False
    return state not in ("Z", "X") or _ppid(pid) == os.getpid()


def _engine_pids(worker_pid: int) -> list[int]:
    """vLLM's worker process (what `pid()` reports), its parent (vLLM's engine core) and the children of both."""
    import psutil

    worker = psutil.Process(worker_pid)
    core = worker.parent()
    assert core is not None and core.pid != os.getpid(), "expected the worker to run under vLLM's engine core"
    procs = {p.pid for p in [core, worker] + core.children(recursive=True)}
    return sorted(procs)


def _shm_of(pids: list[int]) -> set[tuple[str, int]]:
    """(name, inode) of the /dev/shm entries these processes map (found on their own, not by the engine's code)."""
    inodes = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                    inodes.add(int(parts[4]))
    out = set()
    for name in os.listdir("/dev/shm"):
        try:
            ino = os.stat(os.path.join("/dev/shm", name)).st_ino
        except FileNotFoundError:
            continue
        if ino in inodes:
            out.add((name, ino))
    return out


def _still_there(entries: set[tuple[str, int]]) -> list[str]:
    left = []
    for name, ino in entries:
        try:
            if os.stat(os.path.join("/dev/shm", name)).st_ino == ino:
                left.append(name)
        except FileNotFoundError:
            pass
    return left


class Actor:
    """Runs an EngineWorker's coroutines on one event loop in its own thread, as Ray runs an async actor."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, method: str, *args):
        """A concurrent.futures.Future of `worker.method(*args)`, with its completion time in `.finished_at`."""
        future = asyncio.run_coroutine_threadsafe(getattr(self.worker, method)(*args), self.loop)
        future.finished_at = None

        def mark(f) -> None:
            f.finished_at = time.monotonic()

        future.add_done_callback(mark)
        return future

    def call(self, method: str, *args, timeout: float = 600):
        return self.submit(method, *args).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _random_model(spec, directory):
    """A random checkpoint of `spec` (norms 1, the rest N(0, 0.05)) written as a vLLM model directory."""
    from moe_grpo.rollout.export import export_model_dir
    from moe_grpo.sync.plan import plan_buckets

    g = torch.Generator().manual_seed(0)
    plan = plan_buckets(spec, torch.float32, 1 << 16)
    state = {e.name: (torch.ones(e.shape) if "norm" in e.name else 0.05 * torch.randn(e.shape, generator=g))
             for b in plan.buckets for e in b.entries}
    return export_model_dir(spec, state, directory), state


def _greedy(actor):
    from moe_grpo.rollout.types import SamplingSettings

    greedy = SamplingSettings(n=1, temperature=0.0, max_tokens=12, stop_token_ids=())
    out = [actor.call("generate", p, greedy, timeout=120)[0] for p in PROMPTS]
    return [c.token_ids.tolist() for c in out], [set(c.versions.tolist()) for c in out]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """An EngineWorker serving version 1 (random weights perturbed, through the transport); its greedy tokens
    at version 0 and at version 1 (they differ)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "learner"))
    from layout_scenarios import tiny_spec
    from moe_grpo.orchestrator.config import RolloutConfig
    from moe_grpo.orchestrator.engine_actor import EngineWorker
    from moe_grpo.sync.transport import SharedMemoryTransport

    root = tmp_path_factory.mktemp("restart")
    spec = tiny_spec()
    model_dir, state = _random_model(spec, root / "model")
    env = dict(os.environ)  # the worker sets vLLM's logging variables, as it does in its own actor process
    rollout = RolloutConfig(max_num_seqs=8, request_timeout_s=TIMEOUT_S)
    worker = EngineWorker("engine7", str(model_dir), spec, rollout, str(root), str(root / "sync"))
    actor = Actor(worker)
    transport = SharedMemoryTransport(str(root / "sync"))
    try:
        at_v0, _ = _greedy(actor)
        g = torch.Generator().manual_seed(1)
        publish_version(transport, 1, spec, tensors={k: t + 0.5 * t.abs().mean() * torch.randn(t.shape, generator=g)
                                      for k, t in state.items()})
        actor.call("apply_version", 1, 60.0)
        at_v1, versions = _greedy(actor)
        assert versions == [{1}] * len(PROMPTS)
        assert at_v1 != at_v0, "version 1 must generate differently from the model directory"
        yield actor, at_v1
    finally:
        try:
            actor.call("shutdown", timeout=120)
        finally:
            actor.close()
            transport.close()
            os.environ.clear()
            os.environ.update(env)


def _in_flight(actor):
    """Start a long rollout and wait until the engine is generating it (its routing buffer exists)."""
    from moe_grpo.rollout.types import SamplingSettings

    future = actor.submit("generate", [1, 7, 8, 9], SamplingSettings(**LONG))
    engine = actor.worker.engine
    deadline = time.monotonic() + 60
    while engine.num_routing_buffers() < 1:
        assert time.monotonic() < deadline and not future.done(), "the rollout never started"
        time.sleep(0.005)
    assert not future.done()
    return future


def _restarted_serves_version_1(actor, at_v1, old_pid, restarts_before, out):
    assert out["old_pid"] == old_pid and out["pid"] != old_pid and out["policy_version"] == 1
    assert actor.call("pid") == out["pid"]
    stats = actor.call("stats")
    assert stats["restarts"] == restarts_before + 1 and stats["policy_version"] == 1.0
    tokens, versions = _greedy(actor)
    assert versions == [{1}] * len(PROMPTS)
    assert tokens == at_v1, "the restarted engine must serve version 1's weights, not the model directory's"


def test_a_stopped_engine_is_named_hung_and_a_restart_replaces_it(engine, record_property):
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError

    actor, at_v1 = engine
    old = actor.call("pid")
    pids = _engine_pids(old)
    shm = _shm_of(pids)
    # vLLM's ring buffers; the executor's lock is no /dev/shm entry: its workers are forked (rollout/worker_start.py),
    # and a fork-context semaphore is unlinked as it is made.
    assert any(n.startswith("psm_") for n, _ in shm), shm
    restarts = actor.call("stats")["restarts"]

    t0 = time.monotonic()
    hung = _in_flight(actor)
    os.kill(old, signal.SIGSTOP)
    try:
        with pytest.raises(EngineError, match=r"engine engine7: .*within 8 s .*hung"):
            hung.result(TIMEOUT_S + 30)
        took = hung.finished_at - t0
        assert TIMEOUT_S - 0.5 <= took <= TIMEOUT_S + 5, took
        # A rollout sent to the stopped engine is in flight when the restart begins: it must end (EngineError
        # naming the engine) as the old engine goes, not at its timeout and not never.
        lost = actor.submit("generate", [1, 2, 3], SamplingSettings(**LONG))
        time.sleep(0.5)
        assert not lost.done()
        t1 = time.monotonic()
        out = actor.call("restart", 60.0, timeout=300)
        left = [(p, process_state(p)) for p in pids if _remains(p)]
    finally:
        if process_state(old) == "T":
            os.kill(old, signal.SIGKILL)  # only if the restart left it behind (the test fails below)
    with pytest.raises(EngineError, match=r"engine engine7: .*(lost|restarting)"):
        lost.result(0)
    assert lost.finished_at - t1 < 5, "a rollout in flight on the old engine ends when the restart kills it"
    record_property("restart_hung", {k: out[k] for k in ("seconds", "shutdown_seconds", "start_seconds")})
    print("restart of a hung engine:", {k: round(out[k], 2) for k in ("seconds", "shutdown_seconds", "start_seconds")},
          "shutdown phases", {k: round(v, 2) for k, v in out["shutdown_phases"].items()})
    assert out["shutdown_seconds"] < 15, out
    assert set(pids) <= set(out["killed"]), (pids, out["killed"])
    assert not left, left
    assert not _still_there(shm), _still_there(shm)
    _restarted_serves_version_1(actor, at_v1, old, restarts, out)


def test_a_killed_engine_is_named_dead_and_a_restart_replaces_it(engine, record_property):
    from moe_grpo.rollout.vllm_engine import EngineError

    actor, at_v1 = engine
    old = actor.call("pid")
    pids = _engine_pids(old)
    shm = _shm_of(pids)
    assert any(n.startswith("psm_") for n, _ in shm), shm
    restarts = actor.call("stats")["restarts"]

    dead = _in_flight(actor)
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    with pytest.raises(EngineError, match=rf"engine engine7: .*process {old} died"):
        dead.result(60)
    assert dead.finished_at - t0 < 5, dead.finished_at - t0
    # What vLLM leaves on its own: the engine core exits when its worker dies, but keeps its queues' segments in
    # /dev/shm.
    deadline = time.monotonic() + 30
    while any(_remains(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked = _still_there(shm)
    assert leaked, "vLLM 0.32 leaves its engine core's segments behind when the worker is killed (what is cleaned)"
    out = actor.call("restart", 60.0, timeout=300)
    record_property("restart_dead", {k: out[k] for k in ("seconds", "shutdown_seconds", "start_seconds")})
    print("restart of a dead engine:", {k: round(out[k], 2) for k in ("seconds", "shutdown_seconds", "start_seconds")},
          "shutdown phases", {k: round(v, 2) for k, v in out["shutdown_phases"].items()}, "vLLM left", leaked,
          "removed", out["shm_removed"])
    assert sorted(out["shm_removed"]) == sorted(leaked)
    assert not _still_there(shm), _still_there(shm)
    assert not [p for p in pids if _remains(p)], [(p, process_state(p)) for p in pids]
    _restarted_serves_version_1(actor, at_v1, old, restarts, out)


def test_a_stopped_worker_dies_with_its_engine_core_and_the_shutdown_leaves_no_process_and_no_segment(engine):
    """Its worker SIGSTOPped, then its engine core SIGKILLed: a stopped worker never acts on SIGTERM or on vLLM's
    own watch of its parent, so the kernel must end it (PR_SET_PDEATHSIG, set in the worker as it is forked:
    moe_grpo/process_ties.py); the shutdown after it leaves no process and removes the segments. (The reaper's
    search for a worker that does outlive its core: tests/rollout/test_engine_processes.py.)"""
    actor, _ = engine
    worker = actor.call("pid")
    pids = _engine_pids(worker)
    shm = _shm_of(pids)
    assert shm
    core = _ppid(worker)
    os.kill(worker, signal.SIGSTOP)
    os.kill(core, signal.SIGKILL)
    try:
        deadline = time.monotonic() + 30
        while process_state(worker) not in (None, "Z", "X"):
            assert time.monotonic() < deadline, (f"the stopped worker {worker} outlived its engine core "
                                                 f"({process_state(worker)})")
            time.sleep(0.01)
        t0 = time.monotonic()
        out = actor.call("shutdown", timeout=120)
        took = time.monotonic() - t0
        left = [(p, process_state(p)) for p in pids if _remains(p)]
    finally:
        if process_state(worker) == "T":
            os.kill(worker, signal.SIGKILL)  # only if it outlived its core (the test fails above)
    print("shutdown after a half-dead engine:", round(took, 2), "s; phases",
          {k: round(v, 2) for k, v in out["phases"].items()}, "removed", out["shm_removed"])
    assert took < 20, took
    assert not left, left
    assert not _still_there(shm), _still_there(shm)
    assert sorted(out["shm_removed"]) == sorted(n for n, _ in shm) and not out["processes_left"], out
