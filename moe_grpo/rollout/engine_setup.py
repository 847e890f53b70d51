"""What a vLLM engine (rollout/vllm_engine.py) is started with: its options checked, the CPU environment vLLM reads,
AsyncLLM's engine arguments, and the workers' start-up answers checked."""

from __future__ import annotations

import glob
import logging
import os
from typing import TYPE_CHECKING, Any, Collection

from moe_grpo.models.hf_config import read_hf_config, vllm_hf_overrides
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.rollout import lora_serving
from moe_grpo.rollout.engine_adapters import adapted_hf
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.ray_executor import RAY_BACKEND, check_ray_executor
from moe_grpo.rollout.vllm_cpu_limits import CPU_EXPERT_PARALLEL_SEGFAULT

log = logging.getLogger("moe_grpo")

if TYPE_CHECKING:
    from moe_grpo.learner.lora_config import LoraConfig

EXTENSION = "moe_grpo.rollout.worker_extension.RoutingCaptureExtension"


def check_options(*, tensor_parallel: Any, routing_source: str, on_update: str, capture: bool, extension: bool,
                  lora: LoraConfig | None, lora_apply: str, pipeline_parallel: Any = 1, num_layers: int | None = None,
                  expert_parallel: Any = False, on_gpu: bool | None = None) -> None:
    """Refuse a combination of `VllmEngine` options that cannot run, naming the bad value (ValueError).
    `num_layers`: the model's decoder layers (each pipeline stage needs at least one); `on_gpu`: whether the engine
    runs on a GPU (None: not known, not checked)."""
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel={tensor_parallel!r}, expected an integer >= 1")
    if not isinstance(expert_parallel, bool):
        raise ValueError(f"expert_parallel={expert_parallel!r}, expected True or False")
    if expert_parallel and tensor_parallel == 1:
        raise ValueError("expert_parallel=True with tensor_parallel=1: vLLM shards the experts over the engine's "
                         "tensor-parallel workers, one worker leaves nothing to shard across")
    if not isinstance(pipeline_parallel, int) or pipeline_parallel < 1:
        raise ValueError(f"pipeline_parallel={pipeline_parallel!r}, expected an integer >= 1")
    if num_layers is not None and pipeline_parallel > num_layers:
        raise ValueError(f"pipeline_parallel={pipeline_parallel} stages for a model of {num_layers} decoder layers, "
                         "expected at most one stage per layer")
    if pipeline_parallel > 1 and lora is not None and lora.enabled and lora_apply == "serve":
        raise ValueError(f"lora_apply='serve' with pipeline_parallel={pipeline_parallel}: adapters served by vLLM are "
                         "built for engines of one pipeline stage; merge them (lora_apply='merge', each stage merges "
                         "its own layers)")
    if routing_source not in ("auto", "extension", "native"):
        raise ValueError(f"routing_source={routing_source!r}, expected 'auto', 'extension' or 'native'")
    if routing_source == "native" and on_gpu is False:
        raise ValueError("routing_source='native' on CPU: vLLM's own routing capture (enable_return_routed_experts) "
                         "runs in its Model Runner V2, on GPUs only; expected 'extension' or 'auto' here")
    if on_update not in ("keep", "abort"):
        raise ValueError(f"on_update={on_update!r}, expected 'keep' (pause, load, resume) or 'abort' (resubmit)")
    if capture and not extension and routing_source != "native":
        raise ValueError("capture=True needs the worker extension (extension=True) or routing_source='native'")
    if lora is not None and lora.enabled and lora_apply not in ("merge", "serve"):
        raise ValueError(f"lora_apply={lora_apply!r}, expected 'merge' or 'serve'")
    if lora is not None and lora.enabled and not extension:
        raise ValueError("lora with extension=False: the worker extension merges adapters ('merge') and keeps "
                         "vLLM's CPU MoE kernel with LoRA on ('serve')")


def check_expert_parallel(expert_parallel: bool, on_gpu: bool, tensor_parallel: int) -> None:
    """Refuse expert parallelism (vLLM `enable_expert_parallel`) on vLLM's CPU backend, before vLLM starts: its
    workers would segfault at the first forward and the pool would restart the engine into the same crash."""
    if expert_parallel and not on_gpu:
        raise EngineError(f"expert_parallel=True with tensor_parallel={tensor_parallel} on vLLM's CPU backend: "
                          f"{CPU_EXPERT_PARALLEL_SEGFAULT}; run expert parallelism inside an engine on GPUs, or set "
                          "cluster.engine_expert_parallel=false (the experts are then tensor-sliced over the same "
                          "workers)")


def check_cpu_head_size(spec: MoEModelSpec) -> None:
    """Refuse, before vLLM starts, an attention head size vLLM's CPU attention cannot run: otherwise the engine
    starts and dies at its first forward, and the pool restarts it into the same error until it gives up."""
    if spec.uses_mla:
        return  # MLA's sizes are handled by cpu_env (absorbed kernel or unabsorbed attention)
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


def cpu_env(spec: MoEModelSpec, kv_cache_gib: int) -> None:
    """What vLLM's CPU backend reads from the environment: its KV cache size (`rollout.kv_cache_gib` is the one
    setting: a different VLLM_CPU_KVCACHE_SPACE already there, exported by the user or left by an engine of another
    size started in this process, is replaced, with a warning), and MLA computed unabsorbed where its kernel cannot
    run it."""
    kv = str(int(kv_cache_gib))
    before = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if before is not None and before != kv:
        log.warning("VLLM_CPU_KVCACHE_SPACE=%s in the environment is replaced by rollout.kv_cache_gib=%s (the "
                    "engine's KV cache size on CPU is set there)", before, kv)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = kv
    if spec.uses_mla and (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim != 576:
        # vLLM's CPU MLA kernel only takes kv_lora_rank + qk_rope_head_dim == 576; compute MLA unabsorbed.
        os.environ["VLLM_MLA_DISABLE"] = "1"


def prepare_cpu(spec: MoEModelSpec, kv_cache_gib: int, tensor_parallel: int) -> str:
    """Before a CPU engine starts: refuse a head size vLLM's CPU attention cannot run, set the environment its CPU
    backend reads (`cpu_env`); returns `VLLM_CPU_OMP_THREADS_BIND` for its workers (`cpu_omp_bind`)."""
    check_cpu_head_size(spec)
    cpu_env(spec, kv_cache_gib)
    return cpu_omp_bind(tensor_parallel, os.environ.get("VLLM_CPU_OMP_THREADS_BIND"))


def hf_overrides(model_dir: str) -> dict[str, Any]:
    """What vLLM needs on top of a transformers-written config.json (models/hf_config.vllm_hf_overrides)."""
    try:
        cfg = read_hf_config(model_dir)
    except FileNotFoundError:
        return {}  # not a local directory: vLLM reports it
    return vllm_hf_overrides(cfg)


def engine_args(model_dir: str, spec: MoEModelSpec, *, dtype: str, max_model_len: int, max_num_seqs: int, seed: int,
                tensor_parallel: int, extension: bool, max_num_batched_tokens: int | None, native: bool,
                served_lora: LoraConfig | None, on_gpu: bool, pipeline_parallel: int = 1,
                expert_parallel: bool = False, spans_nodes: bool = False) -> dict[str, Any]:
    """vLLM's `AsyncEngineArgs` for an engine (see `VllmEngine`). `served_lora`: the LoraConfig whose adapters vLLM
    serves (`lora_apply='serve'`), else None. `native` (vLLM's own routing capture) also sets the environment
    variable that selects Model Runner V2. `expert_parallel`: vLLM's `enable_expert_parallel` (the routed experts
    sharded whole over the same tensor-parallel workers), refused on CPU (`check_expert_parallel`). `spans_nodes`:
    the workers go to a placement group over several nodes through vLLM's Ray executor (rollout/ray_executor.py),
    refused on CPU."""
    check_expert_parallel(expert_parallel, on_gpu, tensor_parallel)
    if spans_nodes:
        check_ray_executor(on_gpu, tensor_parallel, pipeline_parallel)
    args: dict[str, Any] = dict(
        model=model_dir, skip_tokenizer_init=True, trust_remote_code=True, dtype=dtype, enforce_eager=True,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, enable_prefix_caching=False, seed=seed,
        disable_log_stats=True, tensor_parallel_size=tensor_parallel, pipeline_parallel_size=pipeline_parallel,
        # The log-probs of the distribution sampled from (after temperature), which the learner computes with
        # its logits divided by the same temperature; at temperature 1 (and top_p 1) they equal the raw ones.
        logprobs_mode="processed_logprobs",
        # vLLM's bar per checkpoint file: progress on a real checkpoint's minutes-long load; for one file (the
        # embedded model, a small checkpoint) three lines of console noise in every run and restart.
        use_tqdm_on_load=len(glob.glob(os.path.join(model_dir, "*.safetensors"))) > 1)
    overrides = hf_overrides(model_dir)
    if overrides:
        args["hf_overrides"] = overrides
    if spans_nodes:
        args["distributed_executor_backend"] = RAY_BACKEND  # Ray actors in the engine's placement group
    elif tensor_parallel * pipeline_parallel > 1 or not on_gpu:
        # One process per worker (vLLM's CPU platform always runs its workers so), all on this host, forked from
        # the engine core (worker_start.py).
        from moe_grpo.rollout.worker_start import ForkedWorkersExecutor

        args["distributed_executor_backend"] = ForkedWorkersExecutor
    if expert_parallel:
        args["enable_expert_parallel"] = True
    if extension:
        args["worker_extension_cls"] = EXTENSION
    if max_num_batched_tokens is not None:
        args.update(max_num_batched_tokens=max_num_batched_tokens, enable_chunked_prefill=True)
    if served_lora is not None:
        lora_serving.check_servable(served_lora.targets, on_gpu)
        args.update(enable_lora=True, max_lora_rank=lora_serving.max_lora_rank(served_lora.rank),
                    max_loras=lora_serving.MAX_SERVED_ADAPTERS, max_cpu_loras=2 * lora_serving.MAX_SERVED_ADAPTERS,
                    lora_target_modules=lora_serving.target_modules(adapted_hf(spec, served_lora)))
    if native:
        # vLLM's own capture (it also needs prefix caching on, and Model Runner V2).
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        args.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    return args


def check_workers(infos: list[dict[str, Any]], tensor_parallel: int, capture_routing: bool,
                  engine_id: str, pipeline_parallel: int = 1) -> list[int]:
    """From every worker's `moe_grpo_install` answer, check that tensor_parallel x pipeline_parallel workers
    answered, each (pipeline stage, tensor-parallel rank) once, and (`capture_routing`: the worker extension
    captures routing) that in each stage exactly one worker, tensor-parallel rank 0, captures it. Returns each
    worker's tensor-parallel rank, in the order they answered."""
    expected = tensor_parallel * pipeline_parallel
    if len(infos) != expected:
        raise EngineError(f"engine {engine_id}: {len(infos)} vLLM workers answered, expected "
                          f"tensor_parallel={tensor_parallel} x pipeline_parallel={pipeline_parallel} = {expected}")
    ranks = [int(i["tp_rank"]) for i in infos]
    coords = sorted((int(i.get("pp_rank", 0)), r) for r, i in zip(ranks, infos))
    want = [(pp, tp) for pp in range(pipeline_parallel) for tp in range(tensor_parallel)]
    if coords != want:
        raise EngineError(f"engine {engine_id}: workers report (pipeline stage, tensor-parallel rank) {coords}, "
                          f"expected {want} once each")
    capturing = sorted((int(i.get("pp_rank", 0)), r) for r, i in zip(ranks, infos) if i["capturing"])
    if capture_routing and capturing != [(pp, 0) for pp in range(pipeline_parallel)]:
        raise EngineError(f"engine {engine_id}: routing captured by (pipeline stage, tensor-parallel rank) "
                          f"{capturing}, expected tensor-parallel rank 0 of each stage alone")
    return ranks


def capture_order(infos: list[dict[str, Any]]) -> list[int]:
    """Positions, in collective_rpc's answers, of the workers that capture routing, in pipeline-stage order: their
    traces, put side by side in this order, cover the MoE layers in layer order (each stage holds a contiguous run
    of layers). A stage holding no MoE layer (only leading dense layers) records nothing and is left out: asked for
    rows, it would fail every request."""
    capturing = [(int(i.get("pp_rank", 0)), n) for n, i in enumerate(infos)
                 if i["capturing"] and i.get("moe_layers", [None])]
    return [n for _, n in sorted(capturing)]
