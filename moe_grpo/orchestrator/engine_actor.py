"""One Ray actor per vLLM engine: every call into the engine goes through it, under a timeout.

The driver imports this module to name the actor's class (orchestrator/pools.py), so what brings in torch or vLLM
(the engine, the transports, vLLM itself) is imported inside the methods that run in the actor's process
(moe_grpo/deferred_imports.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Sequence

from moe_grpo.awake_clock import awake_now
from moe_grpo.orchestrator.logs import quiet_libraries, quiet_vllm
from moe_grpo.process_ties import forget_shm, owner_key, record_shm, remove_previous_shm, tag_processes, wait_until_gone
from moe_grpo.rollout import engine_core_start
from moe_grpo.rollout.context import context_length

if TYPE_CHECKING:  # annotations only: importing sync brings in torch (see the module's docstring)
    from moe_grpo.learner.lora_config import LoraConfig
    from moe_grpo.models.spec import MoEModelSpec
    from moe_grpo.orchestrator.config import RolloutConfig
    from moe_grpo.sync.layout import SyncLayout

LEFTOVER_TIMEOUT_S = 60.0
"""Seconds from a new engine actor's start to giving up on the processes of the engine's previous actor on its host
(an error naming them): vLLM's engine core and workers die with their actor (process_ties), so they are
normally gone before the new actor's process has even started."""

LEFTOVER_KILL_AFTER_S = 10.0
"""Seconds from a new engine actor's start after which the processes of a dead previous actor that are still there
are SIGKILLed by it."""


class EngineWorker:
    """Owns one `VllmEngine` (AsyncLLM) in its own process; many `generate` calls run at once."""

    def __init__(self, name: str, model_dir: str | None, spec: MoEModelSpec, rollout: RolloutConfig, run_dir: str,
                 sync: SyncLayout | str, cpus: list[int] | None = None, seed: int = 0, lora: LoraConfig | None = None,
                 lora_apply: str = "merge", tensor_parallel: int = 1, pipeline_parallel: int = 1,
                 expert_parallel: bool = False, placement_group: Any = None,
                 host_agents: dict[str, Any] | None = None) -> None:
        """`sync`: the run's `SyncLayout` (or a shared-memory root directory): where this host's versions arrive.
        `lora`, `lora_apply`: the run's `lora` section and `sync.lora_apply` (VllmEngine). `tensor_parallel`:
        `cluster.engine_tensor_parallel`, the engine's vLLM workers (on CPU they split `cpus`, or this process's
        cores, one set each). `pipeline_parallel`: `cluster.engine_pipeline_parallel`, the engine's stages (each of
        `tensor_parallel` workers). `expert_parallel`: `cluster.engine_expert_parallel`, the routed experts sharded
        over the same workers (vLLM `enable_expert_parallel`; GPU only, refused on CPU by the engine).
        `placement_group`: the engine's own, one GPU bundle per worker over several nodes, when its stages span
        nodes (vLLM's Ray executor: VllmEngine); None: every worker on this actor's node. `host_agents`: with it,
        the `SyncHostAgent` of each other host of the engine's workers (host -> actor): each worker then reads the
        version from its own host (sync/engine_hosts.py).

        `model_dir` None: get ready (imports included) and wait for `start(model_dir)`; a run starts its engines'
        actors this way while its learner ranks build the weights the model directory is written from, so vLLM's
        import (about 10 s on CPU) is not added to the run's start-up."""
        # This actor's processes carry its mark (the previous actor's are told apart by it, process_ties.leftovers),
        # and vLLM logs into the run directory from its first import on. The engine core's process server starts
        # first, before anything here imports torch or vLLM: its imports (vLLM's engine core, ~12 s of a core) are
        # the longest part of an engine's start, and run beside this process's own. It starts no engine core and
        # takes no memory an engine needs until `start`; restarts reuse it (rollout/engine_core_start.py).
        started = time.monotonic()
        self.owner = owner_key(os.path.realpath(run_dir), name)
        tag_processes(self.owner)
        quiet_vllm(run_dir)
        quiet_libraries()
        engine_core_start.start_server_on_cpu()

        from moe_grpo.sync.transports import make_receiver  # brings in torch: see the module's docstring

        self.transport = make_receiver(sync, host_agents, _ray_node() if host_agents else None)
        self.record_dir = str(self.transport.root)
        """Where this host keeps the engine's record of its /dev/shm entries: the run's weight slots on this host,
        which the run removes at its end."""
        import vllm.v1.engine.async_llm  # noqa: F401 - the slow import, done before the model directory is needed

        # The engine's previous actor (killed, or dead) may have left processes holding memory this one needs (GPU
        # memory, /dev/shm ring buffers): the engine starts only once they are gone, and the ring buffers they left
        # are removed (nothing of a SIGKILLed actor does). The imports above take none of that memory (vLLM forks
        # its workers from processes that imported it: its import leaves CUDA uninitialised); they ran beside the
        # leftovers' end, and the limits count from this actor's start.
        t0 = time.monotonic()
        self.previous_processes = [p.pid for p in wait_until_gone(
            self.owner, f"engine {name}", LEFTOVER_TIMEOUT_S, kill_after_s=LEFTOVER_KILL_AFTER_S, since=started)]
        """Processes of the previous actor still there when this one started (it waited until they were gone)."""
        self.previous_shm = remove_previous_shm(self.owner, self.record_dir)
        """/dev/shm entries of the previous actor's engine this one removed before starting."""
        self.waited_s = time.monotonic() - t0
        if cpus:
            os.sched_setaffinity(0, cpus)  # the engine's processes inherit it (the server's children: carried_env)
            os.environ["OMP_NUM_THREADS"] = str(len(cpus))
        if self.previous_processes or self.previous_shm:
            logging.getLogger("moe_grpo").warning(
                "engine %s: waited %.1f s for %d process(es) of its previous actor (%s) to go before starting; "
                "removed what its engine left in /dev/shm (%s)", name, self.waited_s, len(self.previous_processes),
                ", ".join(map(str, self.previous_processes)) or "none left", ", ".join(self.previous_shm) or "nothing")

        self.name, self.rollout = name, rollout
        self._engine_args = (spec, rollout, seed, lora, lora_apply, tensor_parallel, pipeline_parallel, expert_parallel,
                             placement_group)
        self.engine: Any = None
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_total = 0.0
        self._restart_lock = asyncio.Lock()
        if model_dir is not None:
            self._start_engine(model_dir)

    def _start_engine(self, model_dir: str) -> None:
        from moe_grpo.rollout.vllm_engine import VllmEngine  # brings in torch (and vLLM when it starts)

        if self.engine is not None:
            raise RuntimeError(f"engine {self.name} was started already (on {self.engine.model_dir})")
        (spec, rollout, seed, lora, lora_apply, tensor_parallel, pipeline_parallel, expert_parallel,
         placement_group) = self._engine_args
        self.engine = VllmEngine(model_dir, spec, max_model_len=context_length(rollout, spec.max_position_embeddings),
                                 max_num_seqs=rollout.max_num_seqs, kv_cache_gib=rollout.kv_cache_gib,
                                 dtype=rollout.dtype, on_update=rollout.on_update, seed=seed,
                                 routing_source=rollout.routing_source,
                                 request_timeout_s=rollout.request_timeout_s, name=self.name, lora=lora,
                                 lora_apply=lora_apply, tensor_parallel=tensor_parallel,
                                 pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel,
                                 placement_group=placement_group)
        self._record_shm()

    async def start(self, model_dir: str) -> int:
        """Start the engine of an actor made without a model directory; returns its vLLM process (as `pid`)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: self._start_engine(model_dir))
        return await self.pid()

    def _record_shm(self) -> None:
        """Note the engine's /dev/shm entries for the next actor of this engine (should this one be killed)."""
        record_shm(self.owner, self.record_dir, self.engine.shm_inodes())

    def _enter(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
        self._in_flight += 1

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_total += time.perf_counter() - self._busy_since

    async def generate(self, prompt: Sequence[int], sampling: Any) -> list[Any]:
        """`sampling.n` completions of one prompt; fails (EngineError naming this engine) if its vLLM process dies,
        hangs (nothing back within `rollout.request_timeout_s`, e.g. SIGSTOPped) or is restarted meanwhile."""
        from moe_grpo.rollout.vllm_engine import EngineError  # brings in torch

        self._enter()
        try:
            future = asyncio.wrap_future(self.engine.submit(prompt, sampling))
            deadline = awake_now() + self.rollout.request_timeout_s  # a whole-job freeze is no hang
            while True:
                done, _ = await asyncio.wait({future}, timeout=0.5)
                if done:
                    return future.result()
                if not self.engine.alive():
                    future.cancel()
                    why = self.engine.closing
                    raise EngineError(f"engine {self.name}: a rollout was lost: {why}" if why else
                                      f"engine {self.name}: vLLM process {self.engine.worker_pid} died mid-rollout")
                if awake_now() > deadline:
                    future.cancel()
                    raise EngineError(f"engine {self.name}: a rollout did not finish within "
                                      f"{self.rollout.request_timeout_s:.0f} s (rollout.request_timeout_s); hung "
                                      f"(vLLM process {self.engine.worker_pid})")
        finally:
            self._leave()

    async def apply_version(self, version: int, timeout_s: float) -> float:
        """Load a published version between forward passes (requests in flight keep going); seconds taken."""
        from moe_grpo.sync.deliver import apply_version  # brings in torch

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
        """The vLLM process that holds the model (0 while the engine is restarting or not started)."""
        return int(self.engine.worker_pid or 0) if self.engine is not None else 0

    async def restart(self, timeout_s: float | None = None) -> dict[str, Any]:
        """New vLLM processes for this engine (its old ones dead, hung or alive), serving the version it served.

        The old processes are SIGKILLed with everything below them and their /dev/shm segments removed; rollouts
        in flight fail with EngineError naming the engine. `timeout_s` bounds the reload of the served version
        (default `rollout.request_timeout_s`; the start gets at least 300 s). Returns {"pid": the new vLLM
        process, "old_pid", "policy_version": the version it serves, "seconds": in all, "shutdown_seconds",
        "start_seconds", "killed": pids, "shm_removed": names}. Concurrent calls run one after the other."""
        timeout_s = self.rollout.request_timeout_s if timeout_s is None else timeout_s
        async with self._restart_lock:
            loop = asyncio.get_running_loop()
            try:
                return await loop.run_in_executor(None, lambda: self.engine.restart(timeout_s=timeout_s))
            finally:
                self._record_shm()  # the new processes' entries (none if they did not start)

    async def shutdown(self, kill: bool = True) -> dict[str, Any]:
        """End the engine at the end of the run. `kill` (default): SIGKILL its processes and remove what they left
        in /dev/shm (VllmEngine.shutdown's path for a hung engine) rather than wait for vLLM's graceful shutdown:
        nothing an engine holds outlives the run, and the graceful one took 5.8 of a small run's 8.5 s of cleanup
        (its worker's exit 3.2 s, then the engine core's 2.5 s, on 2 cores)."""
        if self.engine is None:  # never started: nothing of vLLM's to end
            return {"processes_left": []}
        out = self.engine.shutdown(kill=kill)
        self.transport.unpin(self.engine.engine_id)
        if not out.get("processes_left"):
            forget_shm(self.owner, self.record_dir)  # it removed them itself
        return out


def _ray_node() -> str:
    """This actor's Ray node id (the sync layout's name for its host)."""
    import ray

    return ray.get_runtime_context().get_node_id()
