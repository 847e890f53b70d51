"""How a vLLM engine (rollout/vllm_engine.py) takes LoRA versions: merged into its weights by its workers
(`lora_apply='merge'`, rollout/lora_merge.py) or served by vLLM (`'serve'`, rollout/lora_serving.py)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_grpo.checkpoint.peft import ADAPTER_WEIGHTS, adapter_scale, read_adapter_config
from moe_grpo.models.peft_names import adapter_sites
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.export import START_ADAPTER
from moe_grpo.rollout.lora_merge import is_adapter_name
from moe_grpo.sync.transports import open_bucket

if TYPE_CHECKING:  # the engine these coroutines run on imports this module
    from moe_grpo.learner.lora_config import LoraConfig
    from moe_grpo.rollout.vllm_engine import VllmEngine


def adapted_hf(spec: MoEModelSpec, lora: LoraConfig) -> list[str]:
    """The HF weights the run's adapters (`lora`, a LoraConfig) change."""
    return [hf for m in adapter_sites(spec, lora).values() for hf in m.hf]


def start_adapter_dir(model_dir: str, lora: LoraConfig, engine_id: str) -> Path | None:
    """`model_dir/adapter` (a PEFT adapter) checked against `lora`, or None if the directory has none."""
    directory = Path(model_dir) / START_ADAPTER
    if not (directory / ADAPTER_WEIGHTS).exists():
        return None
    scale = adapter_scale(read_adapter_config(directory))
    if abs(scale - lora.scale) > 1e-12 * max(1.0, abs(scale)):
        raise EngineError(f"engine {engine_id}: {directory} has scale lora_alpha/r={scale}, expected "
                          f"lora.alpha/lora.rank={lora.scale}")
    return directory


def merge_rpcs(sources: list[dict], scale: float) -> list[tuple[str, tuple]]:
    """Merge mode: how a version's adapters reach the served weights ('serve' goes through `serve` instead).
    `sources`: the adapter buckets (`bucket_sources`) or a PEFT safetensors file, whose
    tensors are PEFT names -> whole A / B; `scale`: alpha / r. 'merge': each worker computes W0 + scale B @ A
    from its copy of W0 and reloads those weights (`worker_extension.moe_grpo_apply_adapter`)."""
    return [("moe_grpo_merge_adapter", (sources, float(scale)))]


def dir_adapter_rpcs(model_dir: str, lora: LoraConfig, engine_id: str) -> list[tuple[str, tuple]]:
    """Merge mode: the calls that apply `model_dir/adapter`; none without one."""
    directory = start_adapter_dir(model_dir, lora, engine_id)
    if directory is None:
        return []
    return merge_rpcs([{"kind": "safetensors", "path": str(directory / ADAPTER_WEIGHTS)}], lora.scale)


def published_adapter(engine: VllmEngine, plan: Any, sources: list[dict], version: int) -> Any:
    """Serve mode: the adapter of a published version, written as a PEFT directory from its buckets."""
    if getattr(plan, "lora", None) is None:
        raise EngineError(f"engine {engine.engine_id} serves LoRA adapters (sync.lora_apply=serve); version "
                          f"{version} has full weights")
    base = sorted({e[0] for s in sources for e in s["entries"] if not is_adapter_name(e[0])})
    if base:
        raise EngineError(f"engine {engine.engine_id} (sync.lora_apply=serve) takes its base weights from its start "
                          f"directory only; version {version} carries {len(base)} base weights (e.g. {base[0]}): "
                          "start the engine from that version's start directory")
    with contextlib.ExitStack() as stack:
        state: dict = {}
        for source in sources:
            state.update(stack.enter_context(open_bucket(source)))
        return engine._served.prepare(version, state=state, spec=engine.spec, lora=engine.lora)


async def serve(engine: VllmEngine, adapter: Any, version: int, source: Any) -> None:
    """Serve mode: have vLLM load `adapter` (the one served so far stays until it has), then make it the
    one new requests use; with `on_update=abort` requests in flight are aborted and resubmitted on it."""
    llm, task = engine.llm, asyncio.current_task()
    engine._tasks.add(task)  # a shutdown or restart ends it
    try:
        try:
            if not await llm.add_lora(adapter.request):
                raise EngineError(f"engine {engine.engine_id}: vLLM did not take the adapter of version {version}")
        except BaseException:
            engine._served.discard(adapter)
            raise
        abort = engine.on_update == "abort"
        if abort:
            engine._updating.clear()
            await llm.pause_generation(mode="abort", clear_cache=False)
        try:
            idle = engine._served.switch(adapter)
            engine.policy_version, engine.weight_source = int(version), source
        finally:
            if abort:
                if engine._dead_pid() is None:
                    await llm.resume_generation()
                engine._updating.set()
        await retire(engine, idle)
    finally:
        engine._tasks.discard(task)


async def retire(engine: VllmEngine, idle: list[Any]) -> None:
    """Drop adapters no request uses any more from vLLM and from disk (best effort: one left over only
    holds memory until vLLM's cache evicts it)."""
    for adapter in idle:
        try:
            if engine.llm is not None:
                await engine.llm.remove_lora(adapter.request.lora_int_id)
        except Exception:  # noqa: BLE001
            pass
        engine._served.discard(adapter)
