"""The engines' side of a weight sync: apply a published version to each engine, skipping the slow and the dead.

`apply_version` brings one engine to a version: wait until every learner
rank has written it, check it against the model the engine serves (name,
dtype, shape, element count; with LoRA the adapters' rank, alpha, targets and
shapes - before anything is applied), pin its buffers, and
let the engine load all of it or roll back. Of a delta version an engine that
serves a published version reloads only the tensors changed since
(`changed_tensors`). The engine's workers get what
the transport describes for each bucket (`bucket_sources`: a mapped file, a
CUDA IPC handle), never a path they would have to interpret. Each engine actor runs it
(`orchestrator/engine_actor.py`); the driver's engine pool offers every
version to all engines at once, none holding up another, and offers the
newest again to an engine that missed one (`orchestrator/engine_pool.py`).
Nothing here is called by the learner, which only publishes
(`weight_sync.py`) and so is never held up by an engine.
"""

from __future__ import annotations

import re
import time
from typing import Any, Iterable

from moe_grpo.sync.plan import BucketPlan, check_plan
from moe_grpo.sync.transport import SyncError, WeightReceiver


def apply_version(engine: Any, transport: WeightReceiver, version: int, *, timeout_s: float = 120.0) -> float:
    """Make `engine` serve `version` (all of it, or it keeps serving what it served). Returns seconds taken."""
    t0 = time.perf_counter()
    who = f"engine {engine.engine_id}"
    if version <= engine.policy_version:
        raise SyncError(f"{who} already serves version {engine.policy_version}; refused version {version}")
    slot, plan = transport.wait_complete(version, timeout_s)
    try:
        check_plan(plan, engine.spec, getattr(engine, "lora", None), engine_dtype=engine.dtype)
    except ValueError as e:
        raise SyncError(f"{who} refused version {version}: {e}") from e
    serving = {engine.weight_source[0]: engine.policy_version} if isinstance(engine.weight_source, tuple) else {}
    transport.pin(engine.engine_id, {**serving, slot: version})
    try:
        engine.load_published(slot, plan, version, sources=transport.bucket_sources(slot, plan),
                              only=changed_tensors(engine, transport, version, plan), timeout_s=timeout_s)
    except Exception as e:
        if serving:
            transport.pin(engine.engine_id, serving)
        else:
            transport.unpin(engine.engine_id)
        raise SyncError(f"{who} failed to load version {version}: {e}") from e
    transport.pin(engine.engine_id, {slot: version})  # its rollback source from now on
    return time.perf_counter() - t0


def changed_tensors(engine: Any, transport: WeightReceiver, version: int, plan: BucketPlan) -> set[str] | None:
    """The tensors an engine must reload to go from the version it serves to `version` (delta versions,
    `sync/delta.py`), or None: all of them. Only an engine that holds a published version whole (its weights came
    from a transport's slot, nothing broken) may skip tensors; one started or restored from a model directory, or
    one whose chain of changes the host no longer knows, reloads everything."""
    changed_since = getattr(transport, "changed_since", None)
    from_slot = isinstance(getattr(engine, "weight_source", None), tuple)
    if changed_since is None or not from_slot or getattr(engine, "broken", None):
        return None
    changed = changed_since(engine.policy_version, version)
    if changed is None:
        return None
    return reload_groups(changed, plan.shapes())


_LAYER_PART = re.compile(r"^(.*\.layers\.\d+\.)(mlp\.(?:experts|shared_experts|gate)\.|[^.]+\.)")
"""The part of a decoder layer an HF tensor belongs to: attention, routed experts, shared experts, router, the
rest of the MLP, or a norm."""


def reload_groups(changed: set[str], names: Iterable[str]) -> set[str]:
    """`changed` grown to whole parts of decoder layers (`_LAYER_PART`): what an engine must reload together.

    vLLM 0.32 reloads weights layer by layer (`model_loader/reload/layerwise.py`): a module that receives only
    some of its weights is rebuilt from fresh storage, so its other weights would be garbage. One module's HF
    tensors always lie in one part (q/k/v and MLA's fused projections in attention, gate/up in their MLP, every
    routed expert of a layer in its FusedMoE, the router's bias with its weight); tensors outside decoder layers
    (embeddings, the final norm, the LM head) are modules of their own."""
    parts = {m.group(0) for n in changed if (m := _LAYER_PART.match(n))}
    return set(changed) | {n for n in names if (m := _LAYER_PART.match(n)) and m.group(0) in parts}
