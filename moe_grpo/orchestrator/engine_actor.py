"""One Ray actor per vLLM engine: every call into the engine goes through it, under a timeout."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Sequence


class EngineWorker:
    """Owns one `VllmEngine` (AsyncLLM) in its own process; many `generate` calls run at once."""

    def __init__(self, name: str, model_dir: str, spec: Any, rollout: Any, run_dir: str, sync_root: str,
                 cpus: list[int] | None = None, seed: int = 0) -> None:
        from moe_grpo.orchestrator.logs import quiet_libraries, quiet_vllm

        if cpus:
            os.sched_setaffinity(0, cpus)  # the engine's processes inherit it
            os.environ["OMP_NUM_THREADS"] = str(len(cpus))
        quiet_vllm(run_dir)
        quiet_libraries()
        from moe_grpo.rollout.vllm_engine import VllmEngine
        from moe_grpo.sync.transport import SharedMemoryTransport

        self.name, self.rollout = name, rollout
        self.engine = VllmEngine(model_dir, spec, max_model_len=min(spec.max_position_embeddings, 512),
                                 max_num_seqs=rollout.max_num_seqs, kv_cache_gib=rollout.kv_cache_gib,
                                 dtype=rollout.dtype, on_update=rollout.on_update, seed=seed,
                                 request_timeout_s=rollout.request_timeout_s, name=name)
        self.transport = SharedMemoryTransport(sync_root)
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_total = 0.0

    def _enter(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_total += time.perf_counter() - self._busy_since

    async def generate(self, prompt: Sequence[int], sampling: Any) -> list[Any]:
        """`sampling.n` completions of one prompt; fails naming this engine if it dies or hangs."""
        from moe_grpo.rollout.vllm_engine import EngineError

        self._enter()
        try:
            future = asyncio.wrap_future(self.engine.submit(prompt, sampling))
            deadline = time.monotonic() + self.rollout.request_timeout_s
            while True:
                done, _ = await asyncio.wait({future}, timeout=0.5)
                if done:
                    return future.result()
                if not self.engine.alive():
                    future.cancel()
                    raise EngineError(f"engine {self.name}: vLLM process {self.engine.worker_pid} died mid-rollout")
                if time.monotonic() > deadline:
                    future.cancel()
                    raise EngineError(f"engine {self.name}: a rollout did not finish within "
                                      f"{self.rollout.request_timeout_s:.0f} s (rollout.request_timeout_s); hung")
        finally:
            self._leave()

    async def apply_version(self, version: int, timeout_s: float) -> float:
        """Load a published version between forward passes (requests in flight keep going); seconds taken."""
        from moe_grpo.sync.deliver import apply_version

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: apply_version(self.engine, self.transport, version,
                                                                      timeout_s=timeout_s))

    async def stats(self) -> dict[str, float]:
        busy = self._busy_total + (time.perf_counter() - self._busy_since if self._in_flight else 0.0)
        return {"busy_seconds": busy, "policy_version": float(self.engine.policy_version),
                **{k: float(v) for k, v in self.engine.stats.items()}}

    async def routing_buffers(self) -> int:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.num_routing_buffers)

    async def pid(self) -> int:
        return int(self.engine.worker_pid)

    async def shutdown(self) -> None:
        self.engine.shutdown()
        self.transport.unpin(self.engine.engine_id)
