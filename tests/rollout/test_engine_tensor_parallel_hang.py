"""A TP=2 engine whose second worker is SIGSTOPped mid-request: the request fails within the engine's request timeout
naming the engine as not finishing (hung), and a restart replaces every process of the engine - the stopped worker
included, which never acts on SIGTERM - with two workers serving the version served before, bit for bit (issue 32,
faults: "a worker that dies or hangs restarts the whole engine").

The SIGKILL version is test_engine_tensor_parallel_faults.py (same setup). A stopped worker is not a dead one: no
process is missing, so only the clock can tell; the worker stopped is tensor-parallel rank 1, not the process
`worker_pid` names (rank 0). What it would catch: a restart that waits on the stopped worker (vLLM's graceful
shutdown asks it to exit), leaves it behind, or a request on a half-stopped engine that waits forever.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from test_engine_tensor_parallel_faults import check_back_on_version_1, start_on_version_1

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REQUEST_TIMEOUT_S = 20.0
"""The engine's request timeout: a request on the stopped engine fails after it (CI machines ~2x slower: generous)."""


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


def test_a_stopped_second_worker_is_named_hung_and_a_restart_brings_both_back(tmp_path):
    from moe_grpo.processes import process_alive
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError

    tp = start_on_version_1(tmp_path, "tp2h", request_timeout_s=REQUEST_TIMEOUT_S)
    engine, seqs, old = tp.engine, tp.seqs, tp.old
    stopped = None
    try:
        long = SamplingSettings(n=1, max_tokens=200, temperature=1.0, seed=3)
        first = engine.submit(seqs[0][:10], long)  # in flight when the worker stops
        os.kill(tp.rank1, signal.SIGSTOP)
        stopped = tp.rank1
        _wait_for(lambda: _stopped(stopped), f"worker {stopped} stopped")
        t0 = time.monotonic()
        with pytest.raises(EngineError, match=rf"engine tp2h: .*did not finish within {REQUEST_TIMEOUT_S:.0f} s"):
            engine.generate([seqs[1][:10]], long)
        waited = time.monotonic() - t0
        assert REQUEST_TIMEOUT_S - 1 <= waited < REQUEST_TIMEOUT_S + 30, f"named hung after {waited:.1f} s"
        assert engine.alive() and not first.done(), "a stopped worker is not a dead one: only the clock tells"

        out = engine.restart(timeout_s=120)
        with pytest.raises(EngineError, match=r"engine tp2h: "):
            first.result(10)  # the request in flight when it hung is lost, and says so
        assert out["policy_version"] == 1
        _wait_for(lambda: not any(process_alive(p) for p in old), f"the old processes {old} gone")
        stopped = None
        check_back_on_version_1(tp)
    finally:
        if stopped is not None:  # the test failed before the restart: let the worker go so the shutdown can end it
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown(kill=True)
        tp.transport.close()
