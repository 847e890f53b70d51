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

import numpy as np
import pytest

from publishing import publish_version
from test_engine_tensor_parallel import _perturbed
from test_families import _eval_tokens, write_checkpoint

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
    from moe_grpo.models.hf_config import read_hf_config, spec_from_hf_config
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError, VllmEngine
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport

    hf = str(tmp_path / "hf")
    write_checkpoint("qwen3_moe", hf)
    spec = spec_from_hf_config(read_hf_config(hf), name="qwen3_moe")
    transport = SharedMemoryTransport(str(tmp_path / "shm"))
    seqs = _eval_tokens()
    engine = VllmEngine(hf, spec, max_model_len=256, max_num_seqs=8, tensor_parallel=2, name="tp2h",
                        request_timeout_s=REQUEST_TIMEOUT_S)
    stopped = None
    try:
        publish_version(transport, 1, spec, tensors=_perturbed(hf, spec, 1))
        apply_version(engine, transport, 1)
        served = engine.score(seqs)
        digests = engine.weight_digests()
        old = list(engine._model_pids)
        rank1 = [p for p in old[:2] if p != engine.worker_pid]
        assert len(old) == 3 and len(rank1) == 1, old

        long = SamplingSettings(n=1, max_tokens=200, temperature=1.0, seed=3)
        first = engine.submit(seqs[0][:10], long)  # in flight when the worker stops
        os.kill(rank1[0], signal.SIGSTOP)
        stopped = rank1[0]
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
        assert out["policy_version"] == 1 and engine.policy_version == 1
        _wait_for(lambda: not any(process_alive(p) for p in old), f"the old processes {old} gone")
        stopped = None
        assert len(engine._model_pids) == 3 and not set(engine._model_pids) & set(old)
        again = engine.score(seqs)
        assert max(float(np.abs(a - b).max()) for a, b in zip(again, served)) == 0.0
        assert engine.weight_digests() == digests, "a worker does not hold version 1 after the restart"
        done = engine.generate([seqs[1][:10]], SamplingSettings(n=1, max_tokens=8, temperature=0.0))
        assert done[0][0].routing is not None and (done[0][0].versions == 1).all()
    finally:
        if stopped is not None:  # the test failed before the restart: let the worker go so the shutdown can end it
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown(kill=True)
        transport.close()
