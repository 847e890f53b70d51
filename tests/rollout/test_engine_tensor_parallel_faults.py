"""A TP=2 engine whose second worker is SIGKILLed mid-request: the request fails at once naming the engine, and a
restart brings back both workers serving the version they served, bit for bit (issue 32, faults).

The worker killed is tensor-parallel rank 1, not the process `worker_pid` names (rank 0): any worker of the engine,
or the engine core between them, being dead is a dead engine. One Qwen3-MoE tiny engine (test_families' checkpoint).
"""

from __future__ import annotations

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


@dataclass
class OnVersion1:
    """A TP=2 Qwen3-MoE tiny engine serving version 1 (loaded through shared memory), and what a restart must bring
    back: its scores of `seqs` and both workers' weight digests. `old`: its processes (2 workers, the engine core);
    `rank1`: the worker of tensor-parallel rank 1 (not `worker_pid`, rank 0)."""

    engine: Any
    transport: Any
    seqs: list
    served: list
    digests: dict
    old: list[int]
    rank1: int


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
        old = list(engine._model_pids)
        rank1 = [p for p in old[:2] if p != engine.worker_pid]
        assert len(old) == 3 and len(rank1) == 1, old
        return OnVersion1(engine, transport, seqs, engine.score(seqs), engine.weight_digests(), old, rank1[0])
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


def test_a_killed_second_worker_fails_the_engine_and_a_restart_brings_both_back(tmp_path):
    from moe_grpo.processes import process_alive
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError

    tp = start_on_version_1(tmp_path, "tp2f")
    engine, seqs = tp.engine, tp.seqs
    try:
        request = engine.submit(seqs[0][:10], SamplingSettings(n=1, max_tokens=200, temperature=1.0, seed=3))
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(tp.rank1, signal.SIGKILL)
        with pytest.raises(EngineError, match=r"engine tp2f: "):
            request.result(60)
        assert time.monotonic() - t0 < 10, f"the lost request took {time.monotonic() - t0:.1f} s to fail"
        assert not engine.alive()

        out = engine.restart(timeout_s=120)
        assert out["policy_version"] == 1
        assert not any(process_alive(p) for p in tp.old), [p for p in tp.old if process_alive(p)]
        check_back_on_version_1(tp)
    finally:
        engine.shutdown()
        tp.transport.close()
