"""The rollout engine on vLLM: token ids in, completions with log-probs and routing traces out.

Routing comes from one of two paths with one output format:
- vLLM's native `enable_return_routed_experts` (Model Runner V2; GPU only:
  V2 needs Triton, which has no CPU backend);
- otherwise the worker extension in `worker_extension.py`, which hooks every
  MoE router (what runs on CPU).
Either way each completion carries a `RoutingTrace` of `prompt + generated - 1`
rows over the MoE layers only.

Bad requests (empty prompt, ids outside the vocabulary, longer than the
context) are refused one by one, with the reason on their completions; the
rest of the batch is served.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moe_grpo.models.hf_names import hf_names
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.rollout.types import Completion, SamplingSettings
from moe_grpo.routing.trace import RoutingTrace

EXTENSION = "moe_grpo.rollout.worker_extension.RoutingCaptureExtension"


class EngineError(RuntimeError):
    """The vLLM engine failed (start, generation or weight load); names the step."""


def _process_alive(pid: int) -> bool:
    """False once the process has exited, including as a not yet reaped zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


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


def _cpu_env(spec: MoEModelSpec, kv_cache_gib: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    if spec.uses_mla and (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim != 576:
        # vLLM's CPU MLA kernel only takes kv_lora_rank + qk_rope_head_dim == 576; compute MLA unabsorbed.
        os.environ["VLLM_MLA_DISABLE"] = "1"


class VllmEngine:
    """A synchronous vLLM engine (`vllm.LLM`) with per-token routing capture."""

    def __init__(self, model_dir: str | Path, spec: MoEModelSpec, *, max_model_len: int = 512, max_num_seqs: int = 16,
                 kv_cache_gib: int = 1, capture: bool = True, seed: int = 0,
                 max_num_batched_tokens: int | None = None, dtype: str = "float32",
                 routing_source: str = "auto") -> None:
        """`routing_source`: 'extension' (router hooks, any platform), 'native' (vLLM's
        enable_return_routed_experts: Model Runner V2, GPU only) or 'auto' (native on GPU)."""
        import torch

        self.spec, self.model_dir, self.max_model_len = spec, str(model_dir), max_model_len
        if routing_source not in ("auto", "extension", "native"):
            raise ValueError(f"routing_source={routing_source!r}, expected 'auto', 'extension' or 'native'")
        self.native = capture and (routing_source == "native" or (routing_source == "auto" and torch.cuda.is_available()))
        self.policy_version = 0
        on_gpu = torch.cuda.is_available()
        if not on_gpu:
            _cpu_env(spec, kv_cache_gib)
        kwargs: dict[str, Any] = dict(
            model=self.model_dir, skip_tokenizer_init=True, trust_remote_code=True, dtype=dtype, enforce_eager=True,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, enable_prefix_caching=False, seed=seed,
            worker_extension_cls=EXTENSION)
        if max_num_batched_tokens is not None:
            kwargs.update(max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True)
        if self.native:
            # vLLM's own capture (it also needs prefix caching on, and Model Runner V2).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        self._llm_kwargs, self._capture_hooks = kwargs, capture and not self.native
        self.capture = capture
        self.engine_id = f"vllm-{os.getpid()}-{id(self):x}"
        self.broken: str | None = None
        """Why the engine must not generate (a failed sync it could not roll back), or None."""
        self.weight_source: tuple[str, Any] | str | None = "model_dir"
        """Where the served weights can be re-read for a rollback or restart: (slot, plan) of a sync,
        'model_dir', or None after `load_weights` from memory (nothing to re-read)."""
        self._start()

    def _start(self) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        try:
            self.llm = LLM(**self._llm_kwargs)
            info = self.llm.collective_rpc("moe_grpo_install", args=(self._capture_hooks,))[0]
        except Exception as e:
            raise EngineError(f"vLLM engine failed to start on {self.model_dir}: {e}") from e
        self.start_seconds = time.perf_counter() - t0
        if self._capture_hooks and len(info["moe_layers"]) != self.spec.num_moe_layers:
            raise EngineError(f"routing capture found {len(info['moe_layers'])} MoE routers, expected "
                              f"{self.spec.num_moe_layers} for {self.spec.name}")
        self.worker_pid = int(info["pid"])
        """The process that holds the model (vLLM's engine core)."""
        self.llm.llm_engine.set_weight_version(str(self.policy_version))

    def restart(self, *, timeout_s: float | None = 120.0) -> None:
        """Start a new engine process (after the old one died) serving the version the engine served before.

        That version's buffers stay pinned through a failed sync, so they are still there to re-read."""
        self.shutdown()
        self._start()
        if self.weight_source is None:
            self.broken = f"restarted on the model directory, not on version {self.policy_version} (loaded from memory)"
            raise EngineError(self.broken)
        if isinstance(self.weight_source, tuple):
            self._apply_buckets(*self.weight_source, timeout_s)
        self.broken = None

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
        self.llm.collective_rpc("moe_grpo_set_capture", args=(on,))
        self.capture = on

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        results, good = _refuse_bad(self, prompts, sampling)
        if not good:
            return results
        params = [_params(self, prompts[i], sampling) for i in good]
        try:
            outputs = self.llm.generate([{"prompt_token_ids": [int(t) for t in prompts[i]]} for i in good], params,
                                        use_tqdm=False)
        except Exception as e:
            raise EngineError(f"vLLM generation failed: {e}") from e
        routing = {}
        if self.capture and not self.native:
            routing = _decode_routing(self.llm.collective_rpc("moe_grpo_pop_routing",
                                                              args=(_prefixes(outputs, sampling.n),))[0])
        for i, out in zip(good, outputs):
            results[i] = _completions(self, prompts[i], out, routing, sampling.n)
        return results

    def score(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Log-prob of every token after the first under the engine's current weights (prompt_logprobs)."""
        from vllm import SamplingParams

        if self.broken:
            raise EngineError(f"engine refuses to score: {self.broken}")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        try:
            outputs = self.llm.generate([{"prompt_token_ids": [int(t) for t in s]} for s in sequences], params,
                                        use_tqdm=False)
        except Exception as e:
            raise EngineError(f"vLLM scoring failed: {e}") from e
        if self.capture:  # scoring requests must not leave routing buffers behind
            self.llm.collective_rpc("moe_grpo_pop_routing", args=(_prefixes(outputs, 1),))
        result = []
        for seq, out in zip(sequences, outputs):
            lps = out.prompt_logprobs[1:]
            result.append(np.asarray([lp[int(t)].logprob for lp, t in zip(lps, seq[1:])], dtype=np.float32))
        return result

    # ------------------------------------------------------------------ weights
    def _rpc(self, method: str, args: tuple = (), timeout_s: float | None = 120.0) -> Any:
        """`collective_rpc` that cannot hang on a dead engine.

        vLLM 0.32 leaves a call pending forever when the engine process dies
        while it runs; the call runs on a helper thread while this one watches
        the process and the clock.
        """
        if not _process_alive(self.worker_pid):
            raise EngineError(f"engine process {self.worker_pid} is dead ({method} not sent)")
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["result"] = self.llm.collective_rpc(method, args=args)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e

        helper = threading.Thread(target=call, name=f"moe_grpo-rpc-{method}", daemon=True)
        helper.start()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while helper.is_alive():
            helper.join(0.1)
            if helper.is_alive() and not _process_alive(self.worker_pid):
                raise EngineError(f"engine process {self.worker_pid} died during {method}")
            if helper.is_alive() and deadline is not None and time.monotonic() > deadline:
                raise EngineError(f"{method} did not finish within {timeout_s:.0f} s (engine process {self.worker_pid})")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _reload_file(self, path: str) -> None:
        self._rpc("moe_grpo_reload_from_file", (path,))

    def load_weights(self, hf_tensors: dict[str, Any], version: int) -> None:
        """Load full HF-named tensors held in this process, one decoder layer per reload; serve `version`.

        Not all-or-nothing: a failure part-way leaves a mix (use `load_published` for syncs)."""
        from safetensors.torch import save_file

        from moe_grpo.rollout.export import weight_buckets

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        for bucket in weight_buckets(self.spec, hf_tensors):
            with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=shm, delete=False) as f:
                path = f.name
            try:
                save_file({k: v.contiguous() for k, v in bucket.items()}, path)
                self._reload_file(path)
            except Exception as e:
                raise EngineError(f"loading weights into the engine failed: {e}") from e
            finally:
                os.unlink(path)
        self._set_version(version, source=None)

    def _set_version(self, version: int, source: tuple[str, Any] | str | None) -> None:
        self.policy_version = int(version)
        self.weight_source = source
        self.llm.llm_engine.set_weight_version(str(self.policy_version))

    def _apply_buckets(self, slot: str, plan: Any, timeout_s: float | None) -> None:
        from moe_grpo.sync.transport import bucket_path

        for b in plan.buckets:
            entries = [(e.name, list(e.shape), e.offset) for e in b.entries]
            self._rpc("moe_grpo_reload_from_shm",
                      (bucket_path(slot, b.index), entries, b.nbytes, plan.dtype), timeout_s)

    def load_published(self, slot: str, plan: Any, version: int, *, timeout_s: float | None = 120.0) -> None:
        """Apply a whole published version (the transport's bucket files, read without a copy) or none of it.

        Every bucket is reloaded in turn; if one fails, the engine re-applies the
        weights it served before (the previous version's buckets, which the sync
        keeps pinned, or its model directory) and raises EngineError. If even that
        fails, the engine refuses to generate until a sync succeeds.
        """
        if self.broken:
            self.broken = None  # a full version is about to replace whatever is loaded
        try:
            self._apply_buckets(slot, plan, timeout_s)
        except Exception as e:
            try:
                self._restore(timeout_s)
            except Exception as e2:
                self.broken = (f"engine holds part of version {version} and could not restore version "
                               f"{self.policy_version} ({e2}); sync a full version before generating")
                raise EngineError(f"loading version {version} failed ({e}); restoring failed too: {e2}") from e
            raise EngineError(f"loading version {version} failed part-way ({e}); rolled back to version "
                              f"{self.policy_version}") from e
        self._set_version(version, source=(slot, plan))

    def _restore(self, timeout_s: float | None) -> None:
        if self.weight_source is None:
            raise EngineError(f"no copy of version {self.policy_version} to roll back to (it was loaded from memory)")
        if isinstance(self.weight_source, tuple):
            self._apply_buckets(*self.weight_source, timeout_s)
            return
        from moe_grpo.checkpoint.hf_io import SafetensorsDir

        files = SafetensorsDir(self.model_dir)
        self.load_weights({n: files.get(n) for n in hf_names(self.spec)}, self.policy_version)
        self.weight_source = "model_dir"

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            self.llm = None


# ---------------------------------------------------------------------- shared by both engines


def _refuse_bad(engine: Any, prompts: Sequence[Sequence[int]], sampling: SamplingSettings
                ) -> tuple[list[list[Completion]], list[int]]:
    if getattr(engine, "broken", None):
        raise EngineError(f"engine refuses to generate: {engine.broken}")
    results: list[list[Completion]] = [[] for _ in prompts]
    good: list[int] = []
    for i, p in enumerate(prompts):
        why = engine.check_prompt(p, sampling)
        if why is None:
            good.append(i)
        else:
            ids = np.asarray(p, dtype=np.int64) if len(p) else np.zeros(0, np.int64)
            results[i] = [Completion(ids, finish_reason="error", error=why) for _ in range(sampling.n)]
    return results, good


def _params(engine: Any, prompt: Sequence[int], sampling: SamplingSettings) -> Any:
    from vllm import SamplingParams

    room = engine.max_model_len - len(prompt)
    return SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                          max_tokens=min(sampling.max_tokens, room), logprobs=0,
                          stop_token_ids=list(sampling.stop_token_ids))


def _prefixes(outputs: Any, n: int) -> list[str]:
    """Worker-side request ids are '<id>-<suffix>' ('<index>_<id>-<suffix>' for n > 1 children)."""
    return [f"{c.index}_{out.request_id}-" if n > 1 else f"{out.request_id}-" for out in outputs for c in out.outputs]


def _decode_routing(packed: dict[str, tuple[str, list[int], bytes]]) -> dict[str, np.ndarray]:
    return {rid: np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape) for rid, (dtype, shape, data) in packed.items()}


def _completions(engine: Any, prompt: Sequence[int], out: Any, routing: dict[str, np.ndarray], n: int) -> list[Completion]:
    prompt_ids = np.asarray(prompt, dtype=np.int64)
    result = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        tokens = np.asarray(c.token_ids, dtype=np.int64)
        lps = np.asarray([c.logprobs[j][int(t)].logprob for j, t in enumerate(tokens)], dtype=np.float32)
        trace = None
        if engine.capture and getattr(engine, "native", False):
            trace = native_routing_to_trace(c.routed_experts, engine.spec, len(prompt_ids) + len(tokens) - 1)
        elif engine.capture:
            prefix = f"{c.index}_{out.request_id}-" if n > 1 else f"{out.request_id}-"
            rows = next((a for rid, a in routing.items() if rid.startswith(prefix)), None)
            n_pos = len(prompt_ids) + len(tokens) - 1
            if rows is None or rows.shape[0] < n_pos or (rows[:n_pos] < 0).any():
                raise EngineError(f"routing capture is missing rows for request {out.request_id} "
                                  f"completion {c.index} ({n_pos} positions expected)")
            trace = RoutingTrace.from_array(rows[:n_pos], engine.spec.num_experts)
        result.append(Completion(prompt_ids, tokens, lps, trace, np.full(len(tokens), engine.policy_version, np.int64),
                                 str(c.finish_reason or "")))
    return result


class AsyncVllmEngine:
    """The same engine on vLLM's AsyncLLM, for an orchestrator that keeps many requests in flight.

    Create it inside a running event loop with `await AsyncVllmEngine.create(...)`.
    """

    def __init__(self) -> None:
        raise TypeError("use `await AsyncVllmEngine.create(model_dir, spec, ...)`")

    @classmethod
    async def create(cls, model_dir: str | Path, spec: MoEModelSpec, *, max_model_len: int = 512,
                     max_num_seqs: int = 16, kv_cache_gib: int = 1, capture: bool = True, seed: int = 0,
                     dtype: str = "float32") -> "AsyncVllmEngine":
        import torch

        self = object.__new__(cls)
        self.spec, self.model_dir, self.max_model_len = spec, str(model_dir), max_model_len
        self.policy_version, self.capture, self._next_id = 0, capture, 0
        if not torch.cuda.is_available():
            _cpu_env(spec, kv_cache_gib)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.perf_counter()
        try:
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
                model=self.model_dir, skip_tokenizer_init=True, trust_remote_code=True, dtype=dtype,
                enforce_eager=True, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                enable_prefix_caching=False, seed=seed, worker_extension_cls=EXTENSION))
            info = (await self.llm.collective_rpc("moe_grpo_install", args=(capture,)))[0]
        except Exception as e:
            raise EngineError(f"vLLM AsyncLLM failed to start on {self.model_dir}: {e}") from e
        self.start_seconds = time.perf_counter() - t0
        if capture and len(info["moe_layers"]) != spec.num_moe_layers:
            raise EngineError(f"routing capture found {len(info['moe_layers'])} MoE routers, expected {spec.num_moe_layers}")
        return self

    check_prompt = VllmEngine.check_prompt

    async def generate_one(self, prompt: Sequence[int], sampling: SamplingSettings) -> list[Completion]:
        """The `n` completions of one prompt; many calls may run concurrently."""
        results, good = _refuse_bad(self, [prompt], sampling)
        if not good:
            return results[0]
        self._next_id += 1
        request_id = f"mg{self._next_id}"
        final = None
        try:
            async for out in self.llm.generate({"prompt_token_ids": [int(t) for t in prompt]},
                                               _params(self, prompt, sampling), request_id=request_id):
                final = out
        except Exception as e:
            raise EngineError(f"vLLM generation of request {request_id} failed: {e}") from e
        routing = {}
        if self.capture:
            packed = (await self.llm.collective_rpc("moe_grpo_pop_routing", args=(_prefixes([final], sampling.n),)))[0]
            routing = _decode_routing(packed)
        return _completions(self, prompt, final, routing, sampling.n)

    async def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        import asyncio

        return list(await asyncio.gather(*(self.generate_one(p, sampling) for p in prompts)))

    def shutdown(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
            self.llm = None
