"""One request's life on a vLLM engine's loop (rollout/vllm_engine.py): sampled (and resubmitted when a weight
update aborted it), scored, failed with an EngineError naming the engine, its routing fetched and freed however it
ended."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from moe_grpo import awake_clock
from moe_grpo.processes import oom_note
from moe_grpo.rollout import engine_adapters
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.engine_outputs import (completion_of, join_segments, join_stage_routing, sampling_params,
                                            unpack_routing)
from moe_grpo.rollout.types import Completion, SamplingSettings

if TYPE_CHECKING:  # the engine these coroutines run on imports this module
    from moe_grpo.rollout.vllm_engine import VllmEngine


async def sample(engine: VllmEngine, prompt: list[int], sampling: SamplingSettings, k: int) -> Completion:
    """Sample `k` of a prompt; with `on_update="abort"` an update's abort resubmits prompt + tokens so far, and
    the segments are joined (`join_segments`)."""
    done: Completion | None = None
    task = asyncio.current_task()
    engine._tasks.add(task)
    try:
        while True:
            await engine._updating.wait()  # no new request starts while weights change
            engine._check_serving()
            room = min(sampling.max_tokens - (len(done.token_ids) if done else 0),
                       engine.max_model_len - len(prompt) - (len(done.token_ids) if done else 0))
            ids = prompt + ([int(t) for t in done.token_ids] if done else [])
            part = await request(engine, ids, sampling, room, k, len(done.token_ids) if done else 0)
            done = part if done is None else join_segments(done, part)
            if part.finish_reason != "abort" or engine.on_update != "abort" or room - len(part.token_ids) <= 0:
                break
            engine.stats["resubmitted"] += 1
    except asyncio.CancelledError:
        if engine._closing:  # shutdown or restart: the request is lost, and says so
            raise EngineError(f"engine {engine.engine_id}: a request in flight was lost: {engine._closing}") from None
        raise
    finally:
        engine._tasks.discard(task)
    return done


def died(engine: VllmEngine, pid: int | None, when: str) -> str:
    """The message of the engine's vLLM process `pid` found dead `when`, saying so where the kernel's OOM killer
    ended processes on this host since the engine (re)started (a user's trial, 2026-11-28: four OOM kills under a
    memory limit were each "died during generation (EngineDeadError)", the kill only in vLLM's log)."""
    return f"engine {engine.engine_id}: vLLM process {pid} died {when}{oom_note(engine._oom_since)}"


def failure(engine: VllmEngine, e: BaseException, what: str) -> EngineError:
    """The EngineError for a vLLM call that raised `e`: the engine shut down, its process died, or vLLM failed."""
    dead = engine._dead_pid()
    pid = dead or engine.worker_pid
    if engine._closing:
        return EngineError(f"engine {engine.engine_id}: {what} was lost: {engine._closing}")
    if type(e).__name__ == "EngineDeadError" or dead is not None:
        return EngineError(died(engine, pid, f"during {what} ({type(e).__name__})"))
    return EngineError(f"engine {engine.engine_id}: {what} failed: {e}")


async def request(engine: VllmEngine, prompt: list[int], sampling: SamplingSettings, max_tokens: int, k: int = 0,
                  offset: int = 0) -> Completion:
    """One vLLM request (a segment of a sample, `offset` tokens into it) -> its Completion ("abort" if aborted)."""
    request_id = f"mg{next(engine._ids)}"
    params = sampling_params(sampling, max_tokens, k, offset)
    final, task = None, asyncio.current_task()
    engine._inflight[request_id] = task
    engine.stats["requests"] += 1
    adapter = engine._served.acquire() if engine._served is not None else None
    version = adapter.version if adapter is not None else engine.policy_version
    try:
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id,
                                             lora_request=adapter.request if adapter is not None else None):
            final = out
    except asyncio.CancelledError:
        if engine._closing:
            raise
        final = None
    except Exception as e:
        raise failure(engine, e, f"generation of request {request_id}") from e
    finally:
        engine._inflight.pop(request_id, None)
        if engine._served is not None:
            await engine_adapters.retire(engine, engine._served.release(adapter))
        routing = await pop_routing(engine, [f"{request_id}-"])  # freed however the request ended
    if "error" in routing and (engine._closing or engine._dead_pid() is not None):
        # The engine died (or is shutting down) while the routing was fetched: an engine failure, whose requests are
        # sent again, not a bad sample dropped with its group (a killed worker fails the fetch, not the generation).
        raise failure(engine, RuntimeError(routing["error"]), f"the routing fetch of request {request_id}")
    done = completion_of(final, prompt, routing, request_id=request_id, spec=engine.spec, capture=engine.capture,
                         native=engine.native, version=engine.policy_version,
                         adapter_version=version if engine._served is not None else None)
    if done.error is not None:  # the only error a completion gets here: its routing capture failed
        engine.stats["capture_errors"] += 1
    return done


async def pop_routing(engine: VllmEngine, prefixes: list[str]) -> dict[str, Any]:
    """The routing the workers captured for these requests, their buffers freed (`unpack_routing`'s form)."""
    if not (engine.capture and not engine.native and engine.extension):
        return {}
    if engine._closing or engine.llm is None or engine._dead_pid() is not None:
        return {"error": f"engine {engine.engine_id} is not serving; routing not fetched"}  # its buffers went with it
    try:
        answers = await awake_clock.wait_for(engine._collective_rpc("moe_grpo_pop_routing", (prefixes,)),
                                             engine.request_timeout_s)
        stages = [answers[i] for i in engine._capture_indices]  # one capturing worker per pipeline stage
    except Exception as e:  # noqa: BLE001 - a dead engine is reported by the caller's watchdog
        return {"error": f"could not fetch routing: {type(e).__name__}: {e}"}
    return join_stage_routing([unpack_routing(packed) for packed in stages])


async def score_one(engine: VllmEngine, seq: Sequence[int], params: Any) -> np.ndarray:
    """The log-prob of each token of `seq` after the first (`VllmEngine.score`)."""
    request_id = f"mg{next(engine._ids)}"
    final = None
    engine._check_serving()
    task = asyncio.current_task()
    engine._tasks.add(task)
    adapter = engine._served.acquire() if engine._served is not None else None
    try:
        async for out in engine.llm.generate({"prompt_token_ids": [int(t) for t in seq]}, params,
                                             request_id=request_id,
                                             lora_request=adapter.request if adapter is not None else None):
            final = out
    except asyncio.CancelledError:
        if engine._closing:
            raise failure(engine, RuntimeError("cancelled"), f"scoring request {request_id}") from None
        raise
    finally:
        engine._tasks.discard(task)
        if engine._served is not None:
            await engine_adapters.retire(engine, engine._served.release(adapter))
        await pop_routing(engine, [f"{request_id}-"])  # scoring must not leave routing buffers behind
    lps = final.prompt_logprobs[1:]
    return np.asarray([lp[int(t)].logprob for lp, t in zip(lps, seq[1:])], dtype=np.float32)
