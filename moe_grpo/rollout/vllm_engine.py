"""The rollout engine on vLLM's AsyncLLM: token ids in, completions with log-probs, versions and routing out.

One class, `VllmEngine`, owns one AsyncLLM on a private event loop (a
daemon thread), so it serves both kinds of callers:
- blocking calls from any thread (`generate`, `score`, `load_published`),
  each under a timeout that also watches the engine process;
- many requests in flight at once (`submit` returns a future per prompt),
  which is how the orchestrator keeps the engine busy.

Routing comes from one of two paths with one output format:
- vLLM's native `enable_return_routed_experts` (Model Runner V2; GPU only:
  V2 needs Triton, which has no CPU backend);
- otherwise the worker extension in `worker_extension.py`, which hooks every
  MoE router (what runs on CPU).
Either way each completion carries a `RoutingTrace` of `prompt + generated - 1`
rows over the MoE layers only.

Tensor parallelism (`tensor_parallel` > 1, vLLM's multiprocessing executor): every worker computes the same
routing, so tensor-parallel rank 0 alone captures it (one trace per request); every worker loads every
bucket of a version through vLLM's weight loaders, which keep its slices, and a version is served only
when each worker answered each reload. Any dead worker (or the engine core between them) is a dead engine.

Weights change between forward passes, with requests in flight:
- `on_update="keep"` (default): pause the scheduler keeping requests and their
  KV cache, reload, stamp the new version, resume. vLLM labels each engine
  step's tokens with the version it ran under, so a completion that spans an
  update reports both versions, and its trace stays complete.
- `on_update="abort"` (AReaL's way): abort the requests in flight and resubmit
  prompt + tokens so far under the new weights; the completion joins both
  segments' tokens, log-probs, versions and routing (rows for positions the
  first segment computed come from it, the rest from the second).

Bad requests (empty prompt, ids outside the vocabulary, longer than the
context) are refused one by one, with the reason on their completions; the
rest is served. A request the worker could not capture routing for fails
alone (`finish_reason="error"`); the engine serves on. Routing buffers of
every request are freed when it ends, however it ends.

A dead or hung engine is replaced by `restart` (the version it served comes
back). `restart` and `shutdown` end every process of the engine, whatever
state it is in: vLLM's engine core and its workers, recorded when they start,
are SIGKILLed (a SIGSTOPped process never acts on vLLM's SIGTERM; a worker
whose engine core died is orphaned, no longer below it). What they mapped in
/dev/shm is removed: a killed vLLM 0.32 engine leaves its message queues'
ring buffers (`psm_*`, hundreds of MiB) and its executor's lock
(`sem.mp-*`) there until this process exits. Requests in flight fail with
EngineError naming the engine; no call waits on a dead engine. And when the
process that owns the engine dies without a shutdown (a SIGKILLed engine
actor), the kernel kills vLLM's processes with it: each is started with
PR_SET_PDEATHSIG (`moe_grpo/process_ties.py`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import signal
import tempfile
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Awaitable, Collection, Sequence

import numpy as np
import psutil
import torch

from moe_grpo.checkpoint.hf_io import SafetensorsDir
from moe_grpo.checkpoint.peft import ADAPTER_WEIGHTS, adapter_scale, read_adapter_config
from moe_grpo.learner.lora import adapter_sites
from moe_grpo.models.hf_config import read_hf_config, vllm_hf_overrides
from moe_grpo.models.hf_names import hf_names
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.process_ties import started_processes_die_with_this_thread
from moe_grpo.processes import SHM_DIR, STOPPED_STATES, process_alive, process_state, shm_entries_held, start_ticks
from moe_grpo.rollout import lora_serving
from moe_grpo.rollout.export import START_ADAPTER, weight_buckets
from moe_grpo.rollout.lora_merge import is_adapter_name
from moe_grpo.rollout.types import Completion, SamplingSettings
from moe_grpo.routing.trace import RoutingTrace
from moe_grpo.sync.transport import shm_bucket_sources, sources_of
from moe_grpo.sync.transports import open_bucket

EXTENSION = "moe_grpo.rollout.worker_extension.RoutingCaptureExtension"
_ENGINE_IDS = itertools.count()


class EngineError(RuntimeError):
    """The vLLM engine failed (start, generation, weight load, dead or hung); names the engine and the step."""


SHM_KINDS = ("psm_", "sem.mp-")
"""What a vLLM 0.32 engine leaves in /dev/shm when its processes are killed: the ring buffers of the message
queues between engine core and workers (multiprocessing SharedMemory, `psm_<8 hex>`: about 240 and 160 MiB on
CPU) and the lock the executor shares with its workers (a multiprocessing semaphore, `sem.mp-<8 chars>`). Their
names are random, so an engine's own are found by what its processes map (`_mapped_shm`)."""


def _descendants(roots: Sequence[int]) -> dict[int, int]:
    """pid -> start time (`processes.start_ticks`), for `roots` and every process below them that exists now."""
    out: dict[int, int] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            ticks = start_ticks(p.pid)
            if ticks is not None:
                out[p.pid] = ticks
    return out


def _mapped_shm(pids: Sequence[int]) -> dict[str, int]:
    """/dev/shm entries of vLLM's kinds (`SHM_KINDS`) that these processes map: name -> inode."""
    return shm_entries_held(pids, prefixes=SHM_KINDS)


def _unlink_shm(entries: dict[str, int]) -> list[str]:
    """Remove these /dev/shm entries (each only if it is still the same inode); returns the names removed.

    The engine's processes registered them with this process's multiprocessing resource tracker (they were
    spawned from here and share it); it is told they are gone, or it would warn of a leak at exit."""
    removed = []
    for name, inode in entries.items():
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path, follow_symlinks=False).st_ino != inode:
                continue
            os.unlink(path)
        except OSError:
            continue
        removed.append(name)
        if getattr(getattr(resource_tracker, "_resource_tracker", None), "_fd", None) is None:
            continue  # no tracker in this process: nothing registered there
        try:
            if name.startswith("psm_"):
                resource_tracker.unregister("/" + name, "shared_memory")
            elif name.startswith("sem."):
                resource_tracker.unregister("/" + name[len("sem."):], "semaphore")
        except Exception:  # noqa: BLE001 - bookkeeping only
            pass
    return removed


def _bounded(fn: Any, timeout_s: float, name: str) -> bool:
    """Run `fn` in a daemon thread for at most `timeout_s`; whether it returned in time (its errors are dropped)."""
    def run() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort teardown
            pass

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


def native_routing_to_trace(routed: Any, spec: MoEModelSpec, num_positions: int) -> RoutingTrace:
    """vLLM's native `CompletionOutput.routed_experts` -> a trace of MoE layers only.

    vLLM reports `[seq_len, num_layers, topk]`; with DeepSeek's leading dense
    layers the first `first_k_dense` columns carry no routing and are dropped.
    """
    ids = np.asarray(routed)
    if ids.ndim != 3:
        raise EngineError(f"native routed_experts has shape {ids.shape}, expected [seq_len, layers, topk]")
    if ids.shape[1] == spec.num_layers and spec.first_k_dense:
        ids = ids[:, spec.first_k_dense :]
    if ids.shape[1] != spec.num_moe_layers:
        raise EngineError(f"native routed_experts has {ids.shape[1]} layers, expected {spec.num_layers} "
                          f"(all) or {spec.num_moe_layers} (MoE only)")
    if ids.shape[0] < num_positions:
        raise EngineError(f"native routed_experts has {ids.shape[0]} rows, expected {num_positions}")
    return RoutingTrace.from_array(ids[:num_positions], spec.num_experts)


def check_cpu_head_size(spec: MoEModelSpec) -> None:
    """Refuse, before vLLM starts, an attention head size vLLM's CPU attention cannot run: otherwise the engine
    starts and dies at its first forward, and the pool restarts it into the same error until it gives up."""
    if spec.uses_mla:
        return  # MLA's sizes are handled by _cpu_env (absorbed kernel or unabsorbed attention)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    if spec.kv_channels not in supported:
        raise EngineError(f"model {spec.name!r}: attention head size {spec.kv_channels} (hidden_size / "
                          f"num_attention_heads, or head_dim) is not one vLLM's CPU attention runs, expected one of "
                          f"{supported}")


def cpu_omp_bind(tensor_parallel: int, current: str | None, cpus: Collection[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for an engine of `tensor_parallel` workers: one core list per worker, '|'-separated
    (vLLM refuses a value whose number of lists is not its local world size). `current` (what the environment holds)
    is kept when it has one list per worker; otherwise the cores this process may run on (`cpus`, default its
    affinity) are split into `tensor_parallel` contiguous groups, and one worker alone gets core 0's list as before
    ("0"). With fewer cores than workers, workers share cores round robin (oversubscribed, but it runs)."""
    if current and current not in ("auto", "nobind") and len(current.split("|")) == tensor_parallel:
        return current
    if tensor_parallel == 1:
        return "0"
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cores) < tensor_parallel:
        return "|".join(str(cores[i % len(cores)]) for i in range(tensor_parallel))
    per = len(cores) // tensor_parallel
    return "|".join(",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(tensor_parallel))


def _cpu_env(spec: MoEModelSpec, kv_cache_gib: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    if spec.uses_mla and (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim != 576:
        # vLLM's CPU MLA kernel only takes kv_lora_rank + qk_rope_head_dim == 576; compute MLA unabsorbed.
        os.environ["VLLM_MLA_DISABLE"] = "1"


def _hf_overrides(model_dir: str) -> dict[str, Any]:
    """What vLLM needs on top of a transformers-written config.json (models/hf_config.vllm_hf_overrides)."""
    try:
        cfg = read_hf_config(model_dir)
    except FileNotFoundError:
        return {}  # not a local directory: vLLM reports it
    return vllm_hf_overrides(cfg)


def versions_from_spans(spans: Any, num_tokens: int, fallback: int) -> np.ndarray:
    """vLLM's per-completion `weight_versions` spans -> one policy version per generated token."""
    out = np.full(num_tokens, fallback, np.int64)
    for span in spans or ():
        try:
            out[span.start : span.end] = int(span.version)
        except ValueError as e:
            raise EngineError(f"weight version {span.version!r} is not an integer policy version") from e
    return out


def join_segments(first: Completion, second: Completion) -> Completion:
    """One completion from a request aborted by a weight update and its resubmission (prompt + tokens so far).

    Positions the first segment ran through keep its routing rows; the rest
    come from the second segment's forward passes under the new weights.
    """
    n1 = len(first.token_ids)
    if len(second.prompt_ids) != len(first.prompt_ids) + n1:
        raise EngineError(f"resubmitted prompt has {len(second.prompt_ids)} tokens, expected "
                          f"{len(first.prompt_ids)} + {n1}")
    routing = second.routing
    if n1 and first.routing is not None and second.routing is not None:
        keep = first.num_positions
        rows = np.concatenate([first.routing.expert_ids[:keep], second.routing.expert_ids[keep:]])
        routing = RoutingTrace.from_array(rows, first.routing.num_experts)
    return Completion(first.prompt_ids, np.concatenate([first.token_ids, second.token_ids]),
                      np.concatenate([first.logprobs, second.logprobs]), routing,
                      np.concatenate([first.versions, second.versions]), second.finish_reason, second.error,
                      resubmits=first.resubmits + 1)


class VllmEngine:
    """A vLLM AsyncLLM engine with per-token routing capture and in-flight weight updates."""

    def __init__(self, model_dir: str | Path, spec: MoEModelSpec, *, max_model_len: int = 512, max_num_seqs: int = 16,
                 kv_cache_gib: int = 1, capture: bool = True, extension: bool = True, seed: int = 0,
                 max_num_batched_tokens: int | None = None, dtype: str = "float32", routing_source: str = "auto",
                 on_update: str = "keep", request_timeout_s: float = 600.0, name: str | None = None,
                 lora: Any = None, lora_apply: str = "merge", tensor_parallel: int = 1) -> None:
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
        worker has loaded it."""
        if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={tensor_parallel!r}, expected an integer >= 1")
        if routing_source not in ("auto", "extension", "native"):
            raise ValueError(f"routing_source={routing_source!r}, expected 'auto', 'extension' or 'native'")
        if on_update not in ("keep", "abort"):
            raise ValueError(f"on_update={on_update!r}, expected 'keep' (pause, load, resume) or 'abort' (resubmit)")
        if capture and not extension and routing_source != "native":
            raise ValueError("capture=True needs the worker extension (extension=True) or routing_source='native'")
        if lora is not None and lora.enabled and lora_apply not in ("merge", "serve"):
            raise ValueError(f"lora_apply={lora_apply!r}, expected 'merge' or 'serve'")
        if lora is not None and lora.enabled and not extension:
            raise ValueError("lora with extension=False: the worker extension merges adapters ('merge') and keeps "
                             "vLLM's CPU MoE kernel with LoRA on ('serve')")
        self.lora = lora if lora is not None and lora.enabled else None
        """The adapters' LoraConfig (None: full-weight versions only)."""
        self.lora_apply = lora_apply if self.lora is not None else None
        """'merge', 'serve' (how adapter versions are applied) or None without LoRA."""
        self._served: Any = None
        """The adapters vLLM serves ('serve' only; lora_serving.ServedAdapters)."""
        self.lora_base_bytes = 0
        """Host memory each worker holds for the exact copy of W0 of the adapted weights (merge)."""
        self.spec, self.model_dir, self.max_model_len = spec, str(model_dir), max_model_len
        self.tensor_parallel = tensor_parallel
        """vLLM workers (tensor-parallel ranks) of this engine."""
        self.dtype = dtype
        """The weights' dtype: the dtype the engine takes versions in (sync/plan.py `version_dtype`)."""
        self.native = capture and (routing_source == "native" or (routing_source == "auto" and torch.cuda.is_available()))
        self.capture, self.extension, self.on_update = capture, extension, on_update
        self.request_timeout_s = request_timeout_s
        self.policy_version = 0
        self.engine_id = name or f"vllm-{os.getpid()}-{next(_ENGINE_IDS)}"
        self.broken: str | None = None
        """Why the engine must not generate (a failed sync it could not roll back), or None."""
        self.weight_source: tuple[str, Any, Any] | str | None = "model_dir"
        """Where the served weights can be re-read for a rollback or restart: (slot, plan, bucket sources) of a sync,
        'model_dir', or None after `load_weights` from memory (nothing to re-read)."""
        self.stats = {"requests": 0, "resubmitted": 0, "capture_errors": 0, "restarts": 0}
        self._omp_bind: str | None = None
        """VLLM_CPU_OMP_THREADS_BIND for this engine's workers (CPU only)."""
        if not torch.cuda.is_available():
            check_cpu_head_size(spec)
            _cpu_env(spec, kv_cache_gib)
            self._omp_bind = cpu_omp_bind(tensor_parallel, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))
        self._engine_args: dict[str, Any] = dict(
            model=self.model_dir, skip_tokenizer_init=True, trust_remote_code=True, dtype=dtype, enforce_eager=True,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, enable_prefix_caching=False, seed=seed,
            disable_log_stats=True, tensor_parallel_size=tensor_parallel,
            # The log-probs of the distribution sampled from (after temperature), which the learner computes with
            # its logits divided by the same temperature; at temperature 1 (and top_p 1) they equal the raw ones.
            logprobs_mode="processed_logprobs")
        overrides = _hf_overrides(self.model_dir)
        if overrides:
            self._engine_args["hf_overrides"] = overrides
        if tensor_parallel > 1:
            self._engine_args["distributed_executor_backend"] = "mp"  # one process per worker, on CPU and GPU alike
        if extension:
            self._engine_args["worker_extension_cls"] = EXTENSION
        if max_num_batched_tokens is not None:
            self._engine_args.update(max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True)
        if self.lora_apply == "serve":
            lora_serving.check_servable(self.lora.targets, torch.cuda.is_available())
            self._engine_args.update(
                enable_lora=True, max_lora_rank=lora_serving.max_lora_rank(self.lora.rank),
                max_loras=lora_serving.MAX_SERVED_ADAPTERS, max_cpu_loras=2 * lora_serving.MAX_SERVED_ADAPTERS,
                lora_target_modules=lora_serving.target_modules(self._adapted_hf()))
            self._served = lora_serving.ServedAdapters.under("/dev/shm" if os.path.isdir("/dev/shm") else None,
                                                             self.engine_id)
        if self.native:
            # vLLM's own capture (it also needs prefix caching on, and Model Runner V2).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            self._engine_args.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        self._ids = itertools.count()
        self._inflight: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()  # every sampling / scoring task, failed with EngineError at shutdown
        self._closing: str | None = None
        """Why the engine serves no more requests (shut down, restarting), or None while it serves."""
        self._procs: dict[int, int] = {}  # pid -> start ticks of each vLLM process of this engine
        self._core_procs: list[Any] = []  # vLLM's engine-core Process objects (this process reaps them)
        self._shm: dict[str, int] = {}  # /dev/shm entries of this engine (name -> inode)
        self.last_shutdown: dict[str, Any] = {}
        """What the last shutdown did: processes killed, /dev/shm entries removed, processes left, seconds."""
        self._updating: asyncio.Event | None = None  # set while no update is in progress
        self._restarting = False
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
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                return future.result(0.1)
            except concurrent.futures.TimeoutError:
                pass
            except concurrent.futures.CancelledError:  # a shutdown or restart ended it
                raise EngineError(f"engine {self.engine_id}: {what} was stopped: "
                                  f"{self.closing or 'cancelled'}") from None
            pid = self._dead_pid()
            if pid is not None:
                future.cancel()
                raise EngineError(f"engine {self.engine_id}: process {pid} died during {what}")
            if deadline is not None and time.monotonic() > deadline:
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
            raise EngineError(f"engine {self.engine_id}: process {dead} is dead ({method} not sent)")
        return self._call(self._collective_rpc(method, args), method, timeout_s)

    def _start(self, timeout_s: float | None = None) -> None:
        t0 = time.perf_counter()
        self.worker_pid: int | None = None
        self._model_pids: list[int] = []
        """Every process holding part of the model: the workers, and with several the engine core between them."""
        self._capture_index = 0
        """Position of tensor-parallel rank 0 (the worker that captures routing) in collective_rpc's answers."""
        self._tp_ranks: list[int] = [0]
        """Each worker's tensor-parallel rank, in the order collective_rpc answers (`_check_workers`)."""
        self._closing = None
        try:
            info = self._call(self._astart(), "start", timeout_s=timeout_s or max(self.request_timeout_s, 300.0))
        except Exception as e:
            if self.llm is not None:  # half started: its processes and segments go now, not at exit
                self.shutdown(stop_loop=False, kill=True, reason="it failed to start")
            raise EngineError(f"engine {self.engine_id}: vLLM failed to start on {self.model_dir}: {e}") from e
        self.start_seconds = time.perf_counter() - t0
        if info is not None and self.capture and not self.native and len(info["moe_layers"]) != self.spec.num_moe_layers:
            raise EngineError(f"engine {self.engine_id}: routing capture found {len(info['moe_layers'])} MoE routers, "
                              f"expected {self.spec.num_moe_layers} for {self.spec.name}")
        if info is not None:
            self.worker_pid = int(info["pid"])  # tensor-parallel rank 0 (one worker: vLLM's engine core itself)
        if self.lora is not None:
            self._lora_start()

    # ------------------------------------------------------------------ LoRA
    def _adapted_hf(self) -> list[str]:
        """The HF weights the run's adapters change."""
        return [hf for m in adapter_sites(self.spec, self.lora).values() for hf in m.hf]

    def _lora_start(self) -> None:
        """Serve the start directory's adapter, if it has one (the version the engine starts on); merging first
        keeps W0 in the workers (from the start directory, the frozen base)."""
        try:
            if self._served is not None:
                self._served.reset()  # a (re)started vLLM holds no adapters
                directory = self._start_adapter_dir()
                if directory is not None:
                    adapter = self._served.prepare(self.policy_version, directory)
                    self._call(self._serve(adapter, self.policy_version, self.weight_source), "the start adapter")
                return
            self.lora_base_bytes = int(self._rpc("moe_grpo_lora_setup", (self._adapted_hf(), self.model_dir))[0])
            rpcs = self._dir_adapter_rpcs()
            if rpcs:
                self._call(self._load(rpcs, self.policy_version, self.weight_source), "the start adapter")
        except Exception as e:
            self.shutdown(stop_loop=False, kill=True, reason="its LoRA setup failed")
            raise EngineError(f"engine {self.engine_id}: LoRA setup from {self.model_dir} failed: {e}") from e

    def _start_adapter_dir(self) -> Path | None:
        """`model_dir/adapter` (a PEFT adapter) checked against `self.lora`, or None if the directory has none."""
        directory = Path(self.model_dir) / START_ADAPTER
        if not (directory / ADAPTER_WEIGHTS).exists():
            return None
        scale = adapter_scale(read_adapter_config(directory))
        if abs(scale - self.lora.scale) > 1e-12 * max(1.0, abs(scale)):
            raise EngineError(f"engine {self.engine_id}: {directory} has scale lora_alpha/r={scale}, expected "
                              f"lora.alpha/lora.rank={self.lora.scale}")
        return directory

    def _dir_adapter_rpcs(self) -> list[tuple[str, tuple]]:
        """Merge mode: the calls that apply `model_dir/adapter`; none without one."""
        directory = self._start_adapter_dir()
        if directory is None:
            return []
        return self._adapter_rpcs([{"kind": "safetensors", "path": str(directory / ADAPTER_WEIGHTS)}], self.lora.scale)

    async def _serve(self, adapter: Any, version: int, source: Any) -> None:
        """Serve mode: have vLLM load `adapter` (the one served so far stays until it has), then make it the
        one new requests use; with `on_update=abort` requests in flight are aborted and resubmitted on it."""
        llm, task = self.llm, asyncio.current_task()
        self._tasks.add(task)  # a shutdown or restart ends it
        try:
            try:
                if not await llm.add_lora(adapter.request):
                    raise EngineError(f"engine {self.engine_id}: vLLM did not take the adapter of version {version}")
            except BaseException:
                self._served.discard(adapter)
                raise
            abort = self.on_update == "abort"
            if abort:
                self._updating.clear()
                await llm.pause_generation(mode="abort", clear_cache=False)
            try:
                idle = self._served.switch(adapter)
                self.policy_version, self.weight_source = int(version), source
            finally:
                if abort:
                    if self._dead_pid() is None:
                        await llm.resume_generation()
                    self._updating.set()
            await self._retire(idle)
        finally:
            self._tasks.discard(task)

    async def _retire(self, idle: list[Any]) -> None:
        """Drop adapters no request uses any more from vLLM and from disk (best effort: one left over only
        holds memory until vLLM's cache evicts it)."""
        for adapter in idle:
            try:
                if self.llm is not None:
                    await self.llm.remove_lora(adapter.request.lora_int_id)
            except Exception:  # noqa: BLE001
                pass
            self._served.discard(adapter)

    def _published_adapter(self, plan: Any, sources: list[dict], version: int) -> Any:
        """Serve mode: the adapter of a published version, written as a PEFT directory from its buckets."""
        if getattr(plan, "lora", None) is None:
            raise EngineError(f"engine {self.engine_id} serves LoRA adapters (sync.lora_apply=serve); version "
                              f"{version} has full weights")
        base = sorted({e[0] for s in sources for e in s["entries"] if not is_adapter_name(e[0])})
        if base:
            raise EngineError(f"engine {self.engine_id} (sync.lora_apply=serve) takes its base weights from its start "
                              f"directory only; version {version} carries {len(base)} base weights (e.g. {base[0]}): "
                              "start the engine from that version's start directory")
        with contextlib.ExitStack() as stack:
            state: dict = {}
            for source in sources:
                state.update(stack.enter_context(open_bucket(source)))
            return self._served.prepare(version, state=state, spec=self.spec, lora=self.lora)

    def _apply_published(self, slot: str, plan: Any, sources: list[dict] | None, version: int,
                         only: Collection[str] | None = None) -> Awaitable[None]:
        """The coroutine that makes the engine serve a published version: the buckets the receiver describes in
        `sources` (`bucket_sources`), or with None the shared-memory files of `slot`; `only`: just those tensors."""
        source = (slot, plan, sources)  # what a rollback or restart re-reads: always the whole version
        if sources is None:
            sources = shm_bucket_sources(slot, plan)
        if self._served is not None:
            return self._serve(self._published_adapter(plan, sources, version), version, source)
        if only is not None:
            sources = sources_of(sources, only)
        return self._load(self._bucket_rpcs(plan, sources), version, source)

    def _adapter_rpcs(self, sources: list[dict], scale: float) -> list[tuple[str, tuple]]:
        """Merge mode: how a version's adapters reach the served weights ('serve' goes through `_serve` instead).
        `sources`: the adapter buckets (`bucket_sources`) or a PEFT safetensors file, whose
        tensors are PEFT names -> whole A / B; `scale`: alpha / r. 'merge': each worker computes W0 + scale B @ A
        from its copy of W0 and reloads those weights (`worker_extension.moe_grpo_apply_adapter`)."""
        return [("moe_grpo_merge_adapter", (sources, float(scale)))]

    async def _astart(self) -> dict[str, Any] | None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._updating = asyncio.Event()
        self._updating.set()
        # vLLM starts the engine core from this thread (the engine's loop thread, which lives as long as the
        # engine), and the engine core its workers: all of them die with this process, however it ends (a
        # SIGKILLed engine actor runs no cleanup; vLLM's own watch of its parent runs in threads a stopped
        # process never runs).
        if self._omp_bind is not None:  # read by the engine core when it spawns its workers (one list per worker)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self._omp_bind
        with started_processes_die_with_this_thread():
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_args))
        self._record_processes()
        await self.llm.update_weight_version(str(self.policy_version))
        if not self.extension:
            self.worker_pid = self._engine_core_pid()
            self._model_pids = [self.worker_pid]
            return None
        infos = await self._collective_rpc("moe_grpo_install", (self.capture and not self.native,))
        return self._check_workers(infos)

    def _check_workers(self, infos: list[dict[str, Any]]) -> dict[str, Any]:
        """From every worker's `moe_grpo_install` answer: note their processes (and the engine core's, a process of
        its own when there are several workers) and check that exactly one worker, tensor-parallel rank 0, captures
        routing. Returns rank 0's answer (its MoE layers: what the capture covers)."""
        if len(infos) != self.tensor_parallel:
            raise EngineError(f"engine {self.engine_id}: {len(infos)} vLLM workers answered, expected "
                              f"tensor_parallel={self.tensor_parallel}")
        ranks = [int(i["tp_rank"]) for i in infos]
        if sorted(ranks) != list(range(self.tensor_parallel)):
            raise EngineError(f"engine {self.engine_id}: workers report tensor-parallel ranks {ranks}, expected "
                              f"0..{self.tensor_parallel - 1} once each")
        self._tp_ranks, self._capture_index = ranks, ranks.index(0)
        capturing = [r for r, i in zip(ranks, infos) if i["capturing"]]
        if self.capture and not self.native and capturing != [0]:
            raise EngineError(f"engine {self.engine_id}: routing captured by tensor-parallel ranks {capturing}, "
                              "expected rank 0 alone")
        self._model_pids = [int(i["pid"]) for i in infos]
        if self.tensor_parallel > 1:
            self._model_pids.append(self._engine_core_pid())
        return infos[self._capture_index]

    def _dead_pid(self) -> int | None:
        """A process of the engine (a worker, or the engine core holding them) that is dead, or None."""
        for pid in getattr(self, "_model_pids", None) or [p for p in [getattr(self, "worker_pid", None)] if p]:
            if not process_alive(pid):
                return pid
        return None

    def _engine_core_pid(self) -> int:
        procs = getattr(getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None), "processes", None)
        if not procs:
            raise EngineError(f"engine {self.engine_id}: cannot find vLLM's engine-core process")
        return int(procs[0].pid)

    def _record_processes(self) -> None:
        """Note this engine's processes (vLLM's engine core and its workers) and the /dev/shm entries they map,
        once they are up: what `shutdown` kills and removes, even after the processes died."""
        manager = getattr(getattr(self.llm.engine_core, "resources", None), "engine_manager", None)
        self._core_procs = list(getattr(manager, "processes", None) or [])
        self._procs = _descendants([int(p.pid) for p in self._core_procs if p.pid])
        self._shm = _mapped_shm(list(self._procs))

    def processes(self) -> dict[int, int]:
        """pid -> start time of every process of this engine (engine core and workers) alive now."""
        roots = [int(p.pid) for p in self._core_procs if p.pid]
        procs = {**self._procs, **_descendants(roots)}
        return {pid: t for pid, t in procs.items() if process_alive(pid, t)}

    def shm_entries(self) -> list[str]:
        """The /dev/shm entries of this engine (recorded at start and from its live processes) that exist now."""
        return sorted(self.shm_inodes())

    def shm_inodes(self) -> dict[str, int]:
        """`shm_entries` with each one's inode (what identifies it, as its name may be reused once removed)."""
        known = {**self._shm, **_mapped_shm(list(self.processes()))}
        out = {}
        for name, inode in known.items():
            try:
                if os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False).st_ino == inode:
                    out[name] = inode
            except OSError:
                pass
        return out

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
                    self._call(self._apply_published(*self.weight_source, version), "restore", timeout_s)
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
        if len(prompt) == 0:
            return "empty prompt: expected at least one token id"
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu":
            return f"prompt token ids have dtype {ids.dtype}, expected integers"
        bad = ids[(ids < 0) | (ids >= self.spec.vocab_size)]
        if bad.size:
            return f"token id {int(bad[0])} outside the vocabulary, expected 0 <= id < {self.spec.vocab_size}"
        if len(prompt) >= self.max_model_len:
            return (f"prompt of {len(prompt)} tokens does not fit the context of {self.max_model_len} "
                    "(it needs room for at least one generated token)")
        return None

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
        return list(await asyncio.gather(*(self._sample(list(map(int, prompt)), sampling, k)
                                           for k in range(sampling.n))))

    def _check_serving(self) -> None:
        if self._closing or self._restarting or self.llm is None:
            raise EngineError(f"engine {self.engine_id} takes no requests: "
                              f"{self._closing or ('it is restarting' if self._restarting else 'it was shut down')}")

    async def _sample(self, prompt: list[int], sampling: SamplingSettings, k: int) -> Completion:
        done: Completion | None = None
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            while True:
                await self._updating.wait()  # no new request starts while weights change
                self._check_serving()
                room = min(sampling.max_tokens - (len(done.token_ids) if done else 0),
                           self.max_model_len - len(prompt) - (len(done.token_ids) if done else 0))
                ids = prompt + ([int(t) for t in done.token_ids] if done else [])
                part = await self._request(ids, sampling, room, k, len(done.token_ids) if done else 0)
                done = part if done is None else join_segments(done, part)
                if part.finish_reason != "abort" or self.on_update != "abort" or room - len(part.token_ids) <= 0:
                    break
                self.stats["resubmitted"] += 1
        except asyncio.CancelledError:
            if self._closing:  # shutdown or restart: the request is lost, and says so
                raise EngineError(f"engine {self.engine_id}: a request in flight was lost: {self._closing}") from None
            raise
        finally:
            self._tasks.discard(task)
        return done

    def _failure(self, e: BaseException, what: str) -> EngineError:
        """The EngineError for a vLLM call that raised `e`: the engine shut down, its process died, or vLLM failed."""
        dead = self._dead_pid()
        pid = dead or self.worker_pid
        if self._closing:
            return EngineError(f"engine {self.engine_id}: {what} was lost: {self._closing}")
        if type(e).__name__ == "EngineDeadError" or dead is not None:
            return EngineError(f"engine {self.engine_id}: vLLM process {pid} died during {what} "
                               f"({type(e).__name__})")
        return EngineError(f"engine {self.engine_id}: {what} failed: {e}")

    async def _request(self, prompt: list[int], sampling: SamplingSettings, max_tokens: int, k: int = 0,
                       offset: int = 0) -> Completion:
        from vllm import SamplingParams

        request_id = f"mg{next(self._ids)}"
        # The caller's stop_token_ids are the only stops (ignore_eos: the checkpoint's own eos is not added).
        # A resubmitted segment (abort on update) gets its own seed, offset by the tokens already sampled.
        seed = None if sampling.seed is None else (sampling.seed + k + 7919 * offset) % (2**63)
        params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max_tokens,
                                logprobs=0, stop_token_ids=list(sampling.stop_token_ids), ignore_eos=True, seed=seed)
        final, task = None, asyncio.current_task()
        self._inflight[request_id] = task
        self.stats["requests"] += 1
        adapter = self._served.acquire() if self._served is not None else None
        version = adapter.version if adapter is not None else self.policy_version
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id,
                                               lora_request=adapter.request if adapter is not None else None):
                final = out
        except asyncio.CancelledError:
            if self._closing:
                raise
            final = None
        except Exception as e:
            raise self._failure(e, f"generation of request {request_id}") from e
        finally:
            self._inflight.pop(request_id, None)
            if self._served is not None:
                await self._retire(self._served.release(adapter))
            routing = await self._pop_routing([f"{request_id}-"])  # freed however the request ended
        ids = np.asarray(prompt, np.int64)
        if final is None or not final.outputs:
            return Completion(ids, finish_reason="abort")
        c = final.outputs[0]
        tokens = np.asarray(c.token_ids, dtype=np.int64)
        lps = np.asarray([c.logprobs[j][int(t)].logprob for j, t in enumerate(tokens)], dtype=np.float32)
        if self._served is not None:  # every token of a served-adapter request is of the adapter it started on
            versions = np.full(len(tokens), version, dtype=np.int64)
        else:
            versions = versions_from_spans(getattr(c, "weight_versions", None), len(tokens), self.policy_version)
        finish = str(c.finish_reason or "")
        n_pos = len(ids) + len(tokens) - 1
        trace, error = None, None
        if self.capture and self.native and len(tokens):
            trace = native_routing_to_trace(c.routed_experts, self.spec, n_pos)
        elif self.capture and len(tokens):
            rows = routing.get("rows")
            if "error" in routing:
                error = f"routing capture failed in the worker: {routing['error']}"
                self.stats["capture_errors"] += 1
            elif rows is None or rows.shape[0] < n_pos or (rows[:n_pos] < 0).any():
                error = f"routing capture is missing rows for request {request_id} ({n_pos} positions expected)"
                self.stats["capture_errors"] += 1
            else:
                trace = RoutingTrace.from_array(rows[:n_pos], self.spec.num_experts)
        return Completion(ids, tokens, lps, trace, versions, "error" if error else finish, error)

    async def _pop_routing(self, prefixes: list[str]) -> dict[str, Any]:
        if not (self.capture and not self.native and self.extension):
            return {}
        if self._closing or self.llm is None or self._dead_pid() is not None:
            return {"error": f"engine {self.engine_id} is not serving; routing not fetched"}  # its buffers went with it
        try:
            packed = (await asyncio.wait_for(self._collective_rpc("moe_grpo_pop_routing", (prefixes,)),
                                             self.request_timeout_s))[self._capture_index]
        except Exception as e:  # noqa: BLE001 - a dead engine is reported by the caller's watchdog
            return {"error": f"could not fetch routing: {e}"}
        out: dict[str, Any] = {}
        for rid, value in packed.items():
            if value[0] == "error":
                out["error"] = value[1]
            else:
                dtype, shape, data = value
                out["rows"] = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
        return out

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

        async def one(seq: Sequence[int]) -> np.ndarray:
            request_id = f"mg{next(self._ids)}"
            final = None
            self._check_serving()
            task = asyncio.current_task()
            self._tasks.add(task)
            adapter = self._served.acquire() if self._served is not None else None
            try:
                async for out in self.llm.generate({"prompt_token_ids": [int(t) for t in seq]}, params,
                                                   request_id=request_id,
                                                   lora_request=adapter.request if adapter is not None else None):
                    final = out
            except asyncio.CancelledError:
                if self._closing:
                    raise self._failure(RuntimeError("cancelled"), f"scoring request {request_id}") from None
                raise
            finally:
                self._tasks.discard(task)
                if self._served is not None:
                    await self._retire(self._served.release(adapter))
                await self._pop_routing([f"{request_id}-"])  # scoring must not leave routing buffers behind
            lps = final.prompt_logprobs[1:]
            return np.asarray([lp[int(t)].logprob for lp, t in zip(lps, seq[1:])], dtype=np.float32)

        async def all_seqs() -> list[np.ndarray]:
            return list(await asyncio.gather(*(one(s) for s in sequences)))

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
        if self.tensor_parallel == 1:
            return dict(answers[0])
        return {f"tp{rank}/{name}": digest for rank, answer in zip(self._tp_ranks, answers)
                for name, digest in answer.items()}

    # ------------------------------------------------------------------ weights
    async def _load(self, rpcs: list[tuple[str, tuple]], version: int, source: Any) -> None:
        """Pause between forward passes, run the reload calls, stamp `version`, resume.

        "keep" freezes requests (with their KV cache) and resumes them on the new
        weights; "abort" aborts them, and `_sample` resubmits each one's tokens so far.
        """
        llm, task = self.llm, asyncio.current_task()
        self._tasks.add(task)  # a shutdown or restart ends it
        self._updating.clear()
        try:
            await llm.pause_generation(mode="keep" if self.on_update == "keep" else "abort", clear_cache=False)
            try:
                for method, args in rpcs:
                    self._every_worker_loaded(method, await self._collective_rpc(method, args), version)
                await llm.update_weight_version(str(int(version)))
                self.policy_version, self.weight_source = int(version), source
            finally:
                if self._dead_pid() is None:  # a dead engine never answers: vLLM leaves the call pending
                    await llm.resume_generation()
        finally:
            self._updating.set()
            self._tasks.discard(task)

    def _every_worker_loaded(self, method: str, answers: Any, version: int) -> None:
        """A reload call counts only when every worker answered it with the same number of tensors loaded (each
        loads the whole bucket through vLLM's weight loaders, which keep its own slices); otherwise the version is
        not served and `load_published` rolls every worker back."""
        answers = list(answers or [])
        if len(answers) != self.tensor_parallel or len({repr(a) for a in answers}) != 1:
            raise EngineError(f"engine {self.engine_id}: {method} of version {version} answered {answers} from "
                              f"{len(answers)} worker(s), expected the same count from each of {self.tensor_parallel}")

    def _bucket_rpcs(self, plan: Any, sources: list[dict]) -> list[tuple[str, tuple]]:
        """Merge mode and full weights: one reload call per bucket, each handing the workers what the receiver
        described (`bucket_sources`)."""
        if getattr(plan, "lora", None) is None:
            return [("moe_grpo_reload_bucket", (source,)) for source in sources]

        if self.lora is None:
            raise EngineError(f"engine {self.engine_id}: a LoRA version for an engine started without lora")
        adapters = [s for s in sources if s["entries"] and all(is_adapter_name(e[0]) for e in s["entries"])]
        base = [s for s in sources if s not in adapters]  # a base version: W0 first (the workers keep it)
        return [("moe_grpo_reload_bucket", (source,)) for source in base] + self._adapter_rpcs(adapters, plan.lora.scale)

    def load_weights(self, hf_tensors: dict[str, Any], version: int) -> None:
        """Load full HF-named tensors held in this process, one decoder layer per reload; serve `version`.

        Not all-or-nothing: a failure part-way leaves a mix (use `load_published` for syncs)."""
        from safetensors.torch import save_file

        if self._served is not None:
            raise EngineError(f"engine {self.engine_id} (sync.lora_apply=serve) takes adapter versions only; its base "
                              "weights come from its start directory")

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        paths = []
        try:
            for bucket in weight_buckets(self.spec, hf_tensors):
                with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=shm, delete=False) as f:
                    paths.append(f.name)
                save_file({k: v.contiguous() for k, v in bucket.items()}, paths[-1])
            self._call(self._load([("moe_grpo_reload_from_file", (p,)) for p in paths], version, None),
                       f"load of version {version}")
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(f"engine {self.engine_id}: loading weights failed: {e}") from e
        finally:
            for p in paths:
                os.unlink(p)

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
        if self.broken:
            self.broken = None  # a full version is about to replace whatever is loaded
        dead = self._dead_pid()
        if dead is not None:
            raise EngineError(f"engine {self.engine_id}: process {dead} is dead (version {version} not sent)")
        try:
            self._call(self._apply_published(slot, plan, sources, version, only), f"load of version {version}",
                       timeout_s)
        except Exception as e:
            if self._served is not None and not self.closing:  # nothing served changed: no rollback
                raise EngineError(f"engine {self.engine_id}: loading version {version} failed ({e}); still serving "
                                  f"version {self.policy_version}") from e
            if self.closing:  # a restart or shutdown stopped it; a restart brings back the version served
                raise EngineError(f"engine {self.engine_id}: loading version {version} was stopped: "
                                  f"{self.closing}") from e
            try:
                self._restore(timeout_s)
            except Exception as e2:
                self.broken = (f"engine holds part of version {version} and could not restore version "
                               f"{self.policy_version} ({e2}); sync a full version before generating")
                raise EngineError(f"engine {self.engine_id}: loading version {version} failed ({e}); "
                                  f"restoring failed too: {e2}") from e
            raise EngineError(f"engine {self.engine_id}: loading version {version} failed part-way ({e}); rolled "
                              f"back to version {self.policy_version}") from e

    def _restore(self, timeout_s: float | None) -> None:
        if self.weight_source is None:
            raise EngineError(f"no copy of version {self.policy_version} to roll back to (it was loaded from memory)")
        if isinstance(self.weight_source, tuple):
            self._call(self._apply_published(*self.weight_source, self.policy_version), "rollback", timeout_s)
            return

        files = SafetensorsDir(self.model_dir)
        self.load_weights({n: files.get(n) for n in hf_names(self.spec)}, self.policy_version)
        rpcs = self._dir_adapter_rpcs() if self.lora is not None else []
        if rpcs:  # the base is back; its adapter on top
            self._call(self._load(rpcs, self.policy_version, None), "rollback", timeout_s)
        self.weight_source = "model_dir"

    def shutdown(self, *, stop_loop: bool = True, kill: bool | None = None, timeout_s: float = 10.0,
                 reason: str = "it was shut down") -> dict[str, Any]:
        """Stop the engine: requests in flight fail with EngineError naming it (and `reason`), every process of it
        ends, and what they leave in /dev/shm is removed. Bounded in time whatever state the processes are in.

        `kill`: True SIGKILLs the engine core, its workers and everything below them at once; False asks vLLM
        to stop them (SIGTERM, SIGKILL after `timeout_s`); None (default) kills at once if any of them is dead,
        a zombie or stopped (a SIGSTOPped process never acts on SIGTERM: vLLM would wait out its timeouts and
        leave the dead engine core's segments behind), and asks otherwise. Either way whatever is left after
        vLLM's shutdown is SIGKILLed. Returns (and keeps in `last_shutdown`) what it did."""
        t0 = time.perf_counter()
        llm, self.llm = self.llm, None
        self._closing = reason
        alive = self.processes()
        procs = {**self._procs, **alive}
        shm = {**self._shm, **_mapped_shm(list(alive))}
        unresponsive = sorted(pid for pid, t in procs.items()
                              if not process_alive(pid, t) or process_state(pid, t) in STOPPED_STATES)
        hard = bool(unresponsive) if kill is None else kill
        if self._loop.is_running():
            async def quiesce() -> None:
                # Fail our requests (EngineError, see _sample) and stop vLLM's output handler before the engine
                # process goes, or the handler logs the dying engine as an error with a traceback.
                handler = getattr(llm, "output_handler", None) if llm is not None else None
                tasks = list(self._tasks) + [t for t in [handler] if t]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            try:
                asyncio.run_coroutine_threadsafe(quiesce(), self._loop).result(5)
            except Exception:  # noqa: BLE001 - bounded; the kill below ends whatever still waits
                pass

        def kill_all(targets: dict[int, int]) -> list[int]:
            done = []
            for pid, started in targets.items():
                if not process_alive(pid, started):
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)  # works on a stopped process too
                    done.append(pid)
                except (ProcessLookupError, PermissionError, psutil.Error):
                    pass
            return done

        def wait_gone(targets: dict[int, int], limit_s: float) -> None:
            deadline = time.monotonic() + limit_s
            while True:
                for p in self._core_procs:  # reap our children (vLLM leaves a SIGKILLed engine core a zombie)
                    try:
                        p.join(0)
                    except Exception:  # noqa: BLE001
                        pass
                if not any(process_alive(pid, t) for pid, t in targets.items()) or time.monotonic() > deadline:
                    return
                time.sleep(0.02)

        phases: dict[str, float] = {"quiesce": time.perf_counter() - t0}
        if hard and llm is not None:
            # vLLM 0.32's engine-core monitor (core_client.MPClient.start_engine_core_monitor) prints "engine core
            # exited unexpectedly" on the console when the processes it watches die, unless the client is already
            # marked dead; here they die because this shutdown ends them.
            resources = getattr(getattr(llm, "engine_core", None), "resources", None)
            if resources is not None and hasattr(resources, "engine_dead"):
                resources.engine_dead = True
        killed = kill_all(procs) if hard else []
        if hard:  # a SIGKILLed process takes a moment to go; vLLM's shutdown then finds nothing left to wait for
            wait_gone(procs, 5.0)
        phases["kill"] = time.perf_counter() - t0 - sum(phases.values())
        if llm is not None:  # vLLM's own teardown (sockets, threads); bounded, it can wait on a hung engine
            grace = 1.0 if hard else timeout_s
            _bounded(lambda: llm.shutdown(timeout=grace), grace + 10.0, f"moe_grpo-{self.engine_id}-shutdown")
        phases["vllm_shutdown"] = time.perf_counter() - t0 - sum(phases.values())
        roots = [int(p.pid) for p in self._core_procs if p.pid]
        procs = {**procs, **_descendants(roots)}
        killed += kill_all(procs)  # whatever vLLM's shutdown left (it kills the engine core, not always below it)
        wait_gone(procs, 5.0)
        ours = {int(p.pid) for p in self._core_procs if p.pid}  # multiprocessing reaps those (join above)
        for pid in set(procs) - ours:  # a worker re-parented to this process (a subreaper) is reaped here
            try:
                os.waitpid(pid, os.WNOHANG)
            except (ChildProcessError, OSError):
                pass
        phases["sweep"] = time.perf_counter() - t0 - sum(phases.values())
        removed = _unlink_shm(shm)
        left = sorted(pid for pid, t in procs.items() if process_alive(pid, t))
        self._procs, self._core_procs, self._shm = {}, [], {}
        self.last_shutdown = {"killed": sorted(set(killed)), "unresponsive": unresponsive, "hard": hard,
                              "shm_removed": sorted(removed), "processes_left": left,
                              "seconds": time.perf_counter() - t0, "phases": phases}
        if stop_loop and self._served is not None:
            self._served.close()
        if stop_loop and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        return self.last_shutdown
