"""One TP=2 engine, its second worker killed and then stopped mid-request, each time restarted (issue 32, faults:
"a worker that dies or hangs restarts the whole engine"):

- SIGKILLed: the request in flight fails at once naming the engine, and a restart brings back both workers serving
  the version they served, bit for bit;
- SIGSTOPped: a request fails within the engine's request timeout naming the engine as not finishing (hung), and a
  restart replaces every process of the engine - the stopped worker included, which never acts on SIGTERM - with
  two workers serving the version served before, bit for bit.

The worker killed or stopped is tensor-parallel rank 1, not the process `worker_pid` names (rank 0): any worker of
the engine, or the engine core between them, being dead is a dead engine. A stopped worker is not a dead one: no
process is missing, so only the clock can tell. What the stop would catch: a restart that waits on the stopped
worker (vLLM's graceful shutdown asks it to exit), leaves it behind, or a request on a half-stopped engine that
waits forever.

One Qwen3-MoE tiny engine (test_families' checkpoint) for the module: each test is a fault and its restart, and
starts from a checked state (`_on_version_1`: alive, on version 1, nothing in flight, its processes named afresh),
restarting the engine first if a failed test before it left it otherwise, so each test fails for its own fault.
Engine starts: the fixture's and one per restart (three, not the four of an engine per test).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from publishing import publish_version
from test_engine_tensor_parallel import _perturbed
from test_families import _eval_tokens, write_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "tp2"
REQUEST_TIMEOUT_S = 20.0
"""The engine's request timeout: a request on the stopped engine fails after it (CI machines ~2x slower: generous)."""


@dataclass
class OnVersion1:
    """A TP=2 Qwen3-MoE tiny engine serving version 1 (loaded through shared memory), and what a restart must bring
    back: its scores of `seqs` and both workers' weight digests, taken when it first served version 1. `old`: its
    processes now (2 workers, the engine core); `rank1`: the worker of tensor-parallel rank 1 (not `worker_pid`,
    rank 0)."""

    engine: Any
    transport: Any
    seqs: list
    served: list
    digests: dict
    old: list[int]
    rank1: int


def _processes(engine) -> tuple[list[int], int]:
    """The engine's processes (2 workers, the engine core) and its worker of tensor-parallel rank 1."""
    old = list(engine._model_pids)
    rank1 = [p for p in old[:2] if p != engine.worker_pid]
    assert len(old) == 3 and len(rank1) == 1, old
    return old, rank1[0]


def start_on_version_1(tmp_path, name: str, **options) -> OnVersion1:
    from moe_grpo.models.hf_config import read_hf_config, spec_from_hf_config
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport

    hf = str(tmp_path / "hf")
    write_checkpoint("qwen3_moe", hf)
    spec = spec_from_hf_config(read_hf_config(hf), name="qwen3_moe")
    transport = SharedMemoryTransport(str(tmp_path / "shm"))
    engine = VllmEngine(hf, spec, max_model_len=256, max_num_seqs=8, tensor_parallel=2, name=name, **options)
    try:
        publish_version(transport, 1, spec, tensors=_perturbed(hf, spec, 1))
        apply_version(engine, transport, 1)
        seqs = _eval_tokens()
        old, rank1 = _processes(engine)
        return OnVersion1(engine, transport, seqs, engine.score(seqs), engine.weight_digests(), old, rank1)
    except BaseException:
        engine.shutdown(kill=True)
        transport.close()
        raise


def check_back_on_version_1(tp: OnVersion1) -> None:
    """After a restart: new processes only, both workers on version 1 bit for bit, new tokens stamped 1."""
    from moe_grpo.rollout.types import SamplingSettings

    engine = tp.engine
    assert engine.policy_version == 1
    assert len(engine._model_pids) == 3 and not set(engine._model_pids) & set(tp.old)
    again = engine.score(tp.seqs)
    assert max(float(np.abs(a - b).max()) for a, b in zip(again, tp.served)) == 0.0
    assert engine.weight_digests() == tp.digests, "a worker does not hold version 1 after the restart"
    done = engine.generate([tp.seqs[1][:10]], SamplingSettings(n=1, max_tokens=8, temperature=0.0))
    assert done[0][0].routing is not None and (done[0][0].versions == 1).all()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    tp = start_on_version_1(tmp_path_factory.mktemp("tp2"), NAME, request_timeout_s=REQUEST_TIMEOUT_S)
    try:
        yield tp
    finally:
        tp.engine.shutdown(kill=True)
        tp.transport.close()


def _on_version_1(tp: OnVersion1) -> OnVersion1:
    """The shared engine as a test starts on it: alive and healthy, on version 1, nothing in flight; its processes
    named as they are now. A test that failed before may have left it dead, hung or with a request in flight: then
    it is restarted here and must come back on version 1 (or this test fails naming the reset, not its own fault)."""
    engine = tp.engine
    left = {"not alive": not engine.alive(), "broken": getattr(engine, "broken", None),
            "requests in flight": engine.in_flight(), "version": engine.policy_version != 1}
    left = {k: v for k, v in left.items() if v}
    if left:
        old, _ = _processes(engine)
        for pid in old:  # a worker a failed test stopped must go with the restart
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.restart(timeout_s=120)
        try:
            check_back_on_version_1(dataclasses.replace(tp, old=old))
        except AssertionError as e:
            raise AssertionError(f"the shared engine, left {left} by a test before, did not come back: {e}") from e
    old, rank1 = _processes(engine)
    return dataclasses.replace(tp, old=old, rank1=rank1)


def test_a_killed_second_worker_fails_the_engine_and_a_restart_brings_both_back(tp2):
    from moe_grpo.processes import process_alive
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError

    tp = _on_version_1(tp2)
    engine, seqs = tp.engine, tp.seqs
    request = engine.submit(seqs[0][:10], SamplingSettings(n=1, max_tokens=200, temperature=1.0, seed=3))
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(tp.rank1, signal.SIGKILL)
    with pytest.raises(EngineError, match=rf"engine {NAME}: "):
        request.result(60)
    assert time.monotonic() - t0 < 10, f"the lost request took {time.monotonic() - t0:.1f} s to fail"
    assert not engine.alive()

    out = engine.restart(timeout_s=120)
    assert out["policy_version"] == 1
    assert not any(process_alive(p) for p in tp.old), [p for p in tp.old if process_alive(p)]
    check_back_on_version_1(tp)


def _wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def test_a_stopped_second_worker_is_named_hung_and_a_restart_brings_both_back(tp2):
    from moe_grpo.processes import process_alive
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError

    tp = _on_version_1(tp2)
    engine, seqs, old = tp.engine, tp.seqs, tp.old
    stopped = None
    try:
        long = SamplingSettings(n=1, max_tokens=200, temperature=1.0, seed=3)
        first = engine.submit(seqs[0][:10], long)  # in flight when the worker stops
        os.kill(tp.rank1, signal.SIGSTOP)
        stopped = tp.rank1
        _wait_for(lambda: _stopped(stopped), f"worker {stopped} stopped")
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=rf"engine {NAME}: .*did not finish within {REQUEST_TIMEOUT_S:.0f} s"):
            engine.generate([seqs[1][:10]], long)
        waited = time.monotonic() - t0
        assert REQUEST_TIMEOUT_S - 1 <= waited < REQUEST_TIMEOUT_S + 30, f"named hung after {waited:.1f} s"
        assert engine.alive() and not first.done(), "a stopped worker is not a dead one: only the clock tells"

        out = engine.restart(timeout_s=120)
        with pytest.raises(EngineError, match=rf"engine {NAME}: "):
            first.result(10)  # the request in flight when it hung is lost, and says so
        assert out["policy_version"] == 1
        _wait_for(lambda: not any(process_alive(p) for p in old), f"the old processes {old} gone")
        stopped = None
        check_back_on_version_1(tp)
    finally:
        if stopped is not None:  # the test failed before the restart: let the worker go so a restart can end it
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
