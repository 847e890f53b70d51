"""How a version's weights reach a vLLM engine's workers (rollout/vllm_engine.py), all of it or none.

Weights change between forward passes, with requests in flight:
- `on_update="keep"` (default): pause the scheduler keeping requests and their KV cache, reload, stamp the new
  version, resume. vLLM labels each engine step's tokens with the version it ran under, so a completion that spans
  an update reports both versions, and its trace stays complete.
- `on_update="abort"` (AReaL's way): abort the requests in flight and resubmit prompt + tokens so far under the new
  weights; the completion joins both segments' tokens, log-probs, versions and routing (rows for positions the
  first segment computed come from it, the rest from the second: `engine_outputs.join_segments`).

With several workers (tensor parallelism) every worker loads every bucket of a version through vLLM's weight
loaders, which keep its slices, and a version is served only when each worker answered each reload.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from typing import TYPE_CHECKING, Any, Awaitable, Collection

from moe_grpo.checkpoint.hf_io import SafetensorsDir
from moe_grpo.models.hf_names import hf_names
from moe_grpo.rollout import engine_adapters, engine_requests
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.export import weight_buckets
from moe_grpo.rollout.lora_merge import is_adapter_name
from moe_grpo.sync.transport import shm_bucket_sources, sources_of

if TYPE_CHECKING:  # the engine these functions load into imports this module
    from moe_grpo.rollout.vllm_engine import VllmEngine


async def load(engine: VllmEngine, rpcs: list[tuple[str, tuple]], version: int, source: Any) -> None:
    """Pause between forward passes, run the reload calls, stamp `version`, resume.

    "keep" freezes requests (with their KV cache) and resumes them on the new
    weights; "abort" aborts them, and the engine's sampling resubmits each one's tokens so far.
    """
    llm, task = engine.llm, asyncio.current_task()
    engine._tasks.add(task)  # a shutdown or restart ends it
    engine._updating.clear()
    try:
        await llm.pause_generation(mode="keep" if engine.on_update == "keep" else "abort", clear_cache=False)
        try:
            for method, args in rpcs:
                every_worker_loaded(engine, method, await engine._collective_rpc(method, args), version)
            await llm.update_weight_version(str(int(version)))
            engine.policy_version, engine.weight_source = int(version), source
        finally:
            if engine._dead_pid() is None:  # a dead engine never answers: vLLM leaves the call pending
                await llm.resume_generation()
    finally:
        engine._updating.set()
        engine._tasks.discard(task)


def every_worker_loaded(engine: VllmEngine, method: str, answers: Any, version: int) -> None:
    """A reload call counts only when every worker answered it with the same number of tensors loaded (each
    loads the whole bucket through vLLM's weight loaders, which keep its own slices); otherwise the version is
    not served and `load_published` rolls every worker back."""
    answers = list(answers or [])
    workers = getattr(engine, "num_workers", engine.tensor_parallel)  # every stage's workers are handed every bucket
    if len(answers) != workers or len({repr(a) for a in answers}) != 1:
        raise EngineError(f"engine {engine.engine_id}: {method} of version {version} answered {answers} from "
                          f"{len(answers)} worker(s), expected the same count from each of {workers}")


def bucket_rpcs(engine: VllmEngine, plan: Any, sources: list[dict]) -> list[tuple[str, tuple]]:
    """Merge mode and full weights: one reload call per bucket, each handing the workers what the receiver
    described (`bucket_sources`)."""
    if getattr(plan, "lora", None) is None:
        return [("moe_grpo_reload_bucket", (source,)) for source in sources]

    if engine.lora is None:
        raise EngineError(f"engine {engine.engine_id}: a LoRA version for an engine started without lora")
    adapters = [s for s in sources if s["entries"] and all(is_adapter_name(e[0]) for e in s["entries"])]
    base = [s for s in sources if s not in adapters]  # a base version: W0 first (the workers keep it)
    return ([("moe_grpo_reload_bucket", (source,)) for source in base]
            + engine_adapters.merge_rpcs(adapters, plan.lora.scale))


def apply_published(engine: VllmEngine, slot: str, plan: Any, sources: list[dict] | None, version: int,
                    only: Collection[str] | None = None) -> Awaitable[None]:
    """The coroutine that makes the engine serve a published version: the buckets the receiver describes in
    `sources` (`bucket_sources`), or with None the shared-memory files of `slot`; `only`: just those tensors."""
    source = (slot, plan, sources)  # what a rollback or restart re-reads: always the whole version
    if sources is None:
        sources = shm_bucket_sources(slot, plan)
    if engine._served is not None:
        return engine_adapters.serve(engine, engine_adapters.published_adapter(engine, plan, sources, version),
                                     version, source)
    if only is not None:
        sources = sources_of(sources, only)
    return load(engine, bucket_rpcs(engine, plan, sources), version, source)


def apply_start_adapter(engine: VllmEngine) -> None:
    """LoRA: serve the start directory's adapter, if it has one (the version the engine starts on); merging first
    keeps W0 in the workers (from the start directory, the frozen base)."""
    try:
        if engine._served is not None:
            engine._served.reset()  # a (re)started vLLM holds no adapters
            directory = engine_adapters.start_adapter_dir(engine.model_dir, engine.lora, engine.engine_id)
            if directory is not None:
                adapter = engine._served.prepare(engine.policy_version, directory)
                engine._call(engine_adapters.serve(engine, adapter, engine.policy_version, engine.weight_source),
                             "the start adapter")
            return
        adapted = engine_adapters.adapted_hf(engine.spec, engine.lora)
        answers = engine._rpc("moe_grpo_lora_setup", (adapted, engine.model_dir))
        engine.lora_base_bytes = max(int(a["bytes"]) for a in answers)
        check_stages_cover(answers, engine._pp_ranks, len(adapted), engine.engine_id)
        rpcs = engine_adapters.dir_adapter_rpcs(engine.model_dir, engine.lora, engine.engine_id)
        if rpcs:
            engine._call(load(engine, rpcs, engine.policy_version, engine.weight_source), "the start adapter")
    except Exception as e:
        engine.shutdown(stop_loop=False, kill=True, reason="its LoRA setup failed")
        raise EngineError(f"engine {engine.engine_id}: LoRA setup from {engine.model_dir} failed: {e}") from e


def check_stages_cover(answers: list[dict], pp_ranks: list[int], adapted: int, engine_id: str) -> None:
    """Merge mode: the workers of a pipeline stage merge the same weights, and the stages together every adapted
    weight once (a stage that took a wrong range of layers would leave some unmerged, silently: each worker answers
    a version with its count of the version's weights)."""
    per_stage: dict[int, set[int]] = {}
    for stage, answer in zip(pp_ranks, answers, strict=True):  # one answer per worker, as the install listed them
        per_stage.setdefault(stage, set()).add(int(answer["weights"]))
    if any(len(counts) != 1 for counts in per_stage.values()) or sum(min(c) for c in per_stage.values()) != adapted:
        raise EngineError(f"engine {engine_id}: the workers' pipeline stages merge {per_stage} adapted weights "
                          f"(stage: counts of its workers), expected the stages to add up to {adapted}, each stage's "
                          "workers the same")


def load_weights(engine: VllmEngine, hf_tensors: dict[str, Any], version: int) -> None:
    """`VllmEngine.load_weights`: HF-named tensors held in this process, one decoder layer per reload."""
    from safetensors.torch import save_file

    if engine._served is not None:
        raise EngineError(f"engine {engine.engine_id} (sync.lora_apply=serve) takes adapter versions only; its base "
                          "weights come from its start directory")

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    paths = []
    try:
        for bucket in weight_buckets(engine.spec, hf_tensors):
            with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=shm, delete=False) as f:
                paths.append(f.name)
            save_file({k: v.contiguous() for k, v in bucket.items()}, paths[-1])
        engine._call(load(engine, [("moe_grpo_reload_from_file", (p,)) for p in paths], version, None),
                     f"load of version {version}")
    except EngineError:
        raise
    except Exception as e:
        raise EngineError(f"engine {engine.engine_id}: loading weights failed: {e}") from e
    finally:
        for p in paths:
            os.unlink(p)


def load_published(engine: VllmEngine, slot: str, plan: Any, version: int, *, sources: list[dict] | None,
                   only: Collection[str] | None, timeout_s: float | None) -> None:
    """`VllmEngine.load_published`: the whole version or none of it, rolled back (`restore`) if it fails."""
    if engine.broken:
        engine.broken = None  # a full version is about to replace whatever is loaded
    dead = engine._dead_pid()
    if dead is not None:
        raise EngineError(f"engine {engine.engine_id}: vLLM process {dead} died (version {version} not sent)")
    try:
        engine._call(apply_published(engine, slot, plan, sources, version, only), f"load of version {version}",
                     timeout_s)
    except Exception as e:
        dead = None if engine.closing else engine._dead_pid()
        if dead is not None:  # nothing to roll back on: a restart brings back the version served
            engine.broken = f"vLLM process {dead} died while it loaded version {version}; restart the engine"
            if isinstance(e, EngineError):  # `_call` named the process
                raise
            raise engine_requests.failure(engine, e, f"load of version {version}") from e
        if engine._served is not None and not engine.closing:  # nothing served changed: no rollback
            raise EngineError(f"engine {engine.engine_id}: loading version {version} failed ({e}); still serving "
                              f"version {engine.policy_version}") from e
        if engine.closing:  # a restart or shutdown stopped it; a restart brings back the version served
            raise EngineError(f"engine {engine.engine_id}: loading version {version} was stopped: "
                              f"{engine.closing}") from e
        try:
            restore(engine, timeout_s)
        except Exception as e2:
            engine.broken = (f"engine holds part of version {version} and could not restore version "
                             f"{engine.policy_version} ({e2}); sync a full version before generating")
            raise EngineError(f"engine {engine.engine_id}: loading version {version} failed ({e}); "
                              f"restoring failed too: {e2}") from e
        raise EngineError(f"engine {engine.engine_id}: loading version {version} failed part-way ({e}); rolled "
                          f"back to version {engine.policy_version}") from e


def restore(engine: VllmEngine, timeout_s: float | None) -> None:
    """Re-apply the version served before: its published buckets (which the sync keeps pinned) or the model
    directory (then its adapter on top)."""
    if engine.weight_source is None:
        raise EngineError(f"no copy of version {engine.policy_version} to roll back to (it was loaded from memory)")
    if isinstance(engine.weight_source, tuple):
        engine._call(apply_published(engine, *engine.weight_source, engine.policy_version), "rollback", timeout_s)
        return

    files = SafetensorsDir(engine.model_dir)
    engine.load_weights({n: files.get(n) for n in hf_names(engine.spec)}, engine.policy_version)
    rpcs = (engine_adapters.dir_adapter_rpcs(engine.model_dir, engine.lora, engine.engine_id)
            if engine.lora is not None else [])
    if rpcs:  # the base is back; its adapter on top
        engine._call(load(engine, rpcs, engine.policy_version, None), "rollback", timeout_s)
    engine.weight_source = "model_dir"
