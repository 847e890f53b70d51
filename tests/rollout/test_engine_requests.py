"""What a request on a VllmEngine returns when its routing cannot be fetched (engine_requests.request), with a
stand-in engine (the logic between vLLM's output and the Completion; the real engine's kill is in
tests/faults/test_engine_faults.py, phase 3).

Would have caught (CI-like run of test_engine_faults, 2026-11-27): a vLLM worker SIGKILLed after a request's tokens
came back but before its routing was fetched failed the fetch ("Call to collective_rpc method failed: cancelled",
then "collective_rpc should not be called on follower node"); each such completion was counted as a bad sample and
its group dropped (16 requests lost), instead of the engine failure it is, whose requests are sent again."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from moe_grpo.rollout import engine_requests
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.types import SamplingSettings


class StandInEngine:
    """What `engine_requests.request` reads of a VllmEngine: one request's tokens come back, then the routing fetch
    (a collective RPC to the workers) fails; `dead` says whether a worker process died meanwhile."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.engine_id, self.worker_pid, self.policy_version = "engine0", 4242, 3
        self._ids, self._inflight, self._served, self._closing = itertools.count(), {}, None, None
        self._oom_since = None  # (no OOM kill counted: the message stays as it was)
        self.stats = {"requests": 0, "capture_errors": 0}
        self.capture, self.native, self.extension = True, False, "moe_grpo"
        self.request_timeout_s, self._capture_indices, self.spec = 5.0, [0], SimpleNamespace(num_experts=4)
        self.llm = SimpleNamespace(generate=self._generate)

    async def _generate(self, prompt, params, request_id, lora_request=None):
        logprobs = [{7: SimpleNamespace(logprob=-0.5)}, {8: SimpleNamespace(logprob=-0.25)}]
        yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8], logprobs=logprobs, finish_reason="length")])

    def _dead_pid(self) -> int | None:
        return 4243 if self.dead and self.fetched else None

    fetched = False

    async def _collective_rpc(self, method, args=()):
        self.fetched = True  # the worker is killed between the generation and this call
        raise RuntimeError("Call to collective_rpc method failed: cancelled")


def _request(engine: StandInEngine):
    return asyncio.run(engine_requests.request(engine, [1, 2, 3], SamplingSettings(max_tokens=2), max_tokens=2))


def test_a_routing_fetch_failed_by_a_dead_worker_is_an_engine_failure():
    with pytest.raises(EngineError, match=r"vLLM process 4243 died during the routing fetch of request mg0"):
        _request(StandInEngine(dead=True))


def test_a_routing_fetch_failed_on_a_live_engine_fails_only_that_completion():
    engine = StandInEngine(dead=False)
    done = _request(engine)
    assert done.finish_reason == "error" and "could not fetch routing" in done.error
    np.testing.assert_array_equal(done.token_ids, [7, 8])
    assert engine.stats["capture_errors"] == 1
