"""What a call into a VllmEngine whose vLLM process died says (VllmEngine._call, engine_weights.load_published), with
the engine's plumbing real (its event-loop thread, its watch of its processes) and vLLM replaced by what vLLM 0.32
raises when a worker is SIGKILLed mid-call (`EngineDeadError` from the engine core). The real kill is in
tests/faults/test_engine_faults.py, phase 3.

Would have caught (CI, 2026-11-27): the worker SIGKILLed while the engine loaded a version. vLLM's EngineDeadError
passed through `_call` as it was ("EngineCore encountered an issue"), the load then tried to roll back on the dead
engine, and the restart was logged as "loading version 7 failed (EngineCore encountered an issue ...); restoring
failed too: ...": the log never named the dead process, which the run's user needs to find the cause."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

import pytest

from moe_grpo.rollout import engine_weights
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.vllm_engine import VllmEngine


class EngineDeadError(Exception):
    """Named as vLLM's (vllm.v1.engine.exceptions.EngineDeadError): the engine tells it by its name."""


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def engine():
    """A VllmEngine without vLLM: its loop thread and its process watch, one worker that has died."""
    e = VllmEngine.__new__(VllmEngine)
    e.engine_id, e.request_timeout_s, e.policy_version = "engine0", 5.0, 6
    e.worker_pid = _dead_pid()
    e._model_pids, e._closing, e._restarting, e._served, e.broken = [e.worker_pid], None, False, None, None
    e._oom_since = None  # (VllmEngine._start takes the host's OOM-kill count)
    e.weight_source = ("slot", "plan", None)  # version 6 came from published buckets: a rollback would re-read them
    e._loop = asyncio.new_event_loop()
    thread = threading.Thread(target=e._loop.run_forever, daemon=True)
    thread.start()
    yield e
    e._loop.call_soon_threadsafe(e._loop.stop)
    thread.join(5)


async def _engine_dead():
    raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")


def test_a_call_that_vllm_fails_because_a_worker_died_names_the_dead_process(engine):
    with pytest.raises(EngineError, match=rf"engine engine0: vLLM process {engine.worker_pid} died during the load "
                                          r"of version 7 \(EngineDeadError\)"):
        engine._call(_engine_dead(), "the load of version 7")


def test_a_call_that_fails_on_a_live_engine_keeps_its_own_error(engine):
    engine._model_pids = [os.getpid()]

    async def refused():
        raise ValueError("bucket 3 has the wrong shape")

    with pytest.raises(ValueError, match="bucket 3"):
        engine._call(refused(), "the load of version 7")


def test_a_load_the_dead_worker_failed_names_it_and_rolls_nothing_back(engine, monkeypatch):
    applied = []

    def apply_published(engine_, slot, plan, sources, version, only=None):
        applied.append(version)
        return _engine_dead()

    monkeypatch.setattr(engine_weights, "apply_published", apply_published)
    # alive when the load is sent, dead by the time vLLM answers
    pid = engine.worker_pid
    engine._model_pids = [os.getpid()]
    original = engine._call

    def call(coro, what, timeout_s=None):
        engine._model_pids = [pid]
        return original(coro, what, timeout_s)

    engine._call = call
    with pytest.raises(EngineError, match=rf"vLLM process {pid} died during load of version 7") as raised:
        engine_weights.load_published(engine, "slot", "plan", 7, sources=None, only=None, timeout_s=5.0)
    assert applied == [7], "a rollback was sent to an engine whose worker is dead"
    assert "restoring" not in str(raised.value)
    assert engine.broken and f"vLLM process {pid} died" in engine.broken, "it would take requests until restarted"


def test_a_load_sent_to_an_engine_already_dead_names_the_process(engine):
    with pytest.raises(EngineError, match=rf"vLLM process {engine.worker_pid} died \(version 7 not sent\)"):
        engine_weights.load_published(engine, "slot", "plan", 7, sources=None, only=None, timeout_s=5.0)
