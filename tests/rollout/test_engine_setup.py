"""`VllmEngine`'s options checked before vLLM starts (rollout/engine_setup.py `check_options`), without an engine."""

import os

import pytest

from moe_grpo.rollout.engine_setup import check_options


def _options(**kw):
    base = dict(tensor_parallel=1, routing_source="extension", on_update="keep", capture=True, extension=True,
                lora=None, lora_apply="merge")
    check_options(**{**base, **kw})


def test_vllms_native_routing_capture_is_refused_on_cpu_before_vllm_starts():
    """`rollout.routing_source=native` on CPU: refused naming why (vLLM's Model Runner V2, GPU only), not an engine
    start that fails inside vLLM."""
    with pytest.raises(ValueError, match=r"routing_source='native' on CPU: .*GPUs only"):
        _options(routing_source="native", on_gpu=False)
    _options(routing_source="native", on_gpu=True)
    _options(routing_source="auto", on_gpu=False)


def test_the_kv_cache_size_on_cpu_is_rollout_kv_cache_gib_whatever_the_environment_held(monkeypatch, caplog):
    """vLLM's CPU backend reads its KV cache size from VLLM_CPU_KVCACHE_SPACE, which was set only when absent: a value
    already in the environment (exported, or left by an engine of another size started in the same process) won over
    `rollout.kv_cache_gib`, silently."""
    from moe_grpo.config import load_model_spec
    from moe_grpo.rollout.engine_setup import cpu_env

    spec = load_model_spec("deepseek_moe")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")
    with caplog.at_level("WARNING", logger="moe_grpo"):
        cpu_env(spec, 4)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert "VLLM_CPU_KVCACHE_SPACE=40 in the environment is replaced by rollout.kv_cache_gib=4" in caplog.text
    caplog.clear()
    cpu_env(spec, 4)
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "4" and not caplog.text, "the same size: nothing to say"


def test_lora_at_engine_pipeline_stages_is_merged_not_served():
    """Merged adapters run at engine PP > 1 (each stage merges its own layers: test_lora_tensor_parallel.py); vLLM's
    served adapters there are refused naming the setting to use. Before 2026-11-28 both were refused."""
    from moe_grpo.learner.lora_config import LoraConfig

    lora = LoraConfig(rank=4, alpha=8)
    _options(lora=lora, lora_apply="merge", pipeline_parallel=2, num_layers=4)
    with pytest.raises(ValueError, match=r"lora_apply='serve' with pipeline_parallel=2: .* merge them "
                                         r"\(lora_apply='merge'"):
        _options(lora=lora, lora_apply="serve", pipeline_parallel=2, num_layers=4)


def test_the_stages_of_an_engine_merging_lora_must_cover_every_adapted_weight_once():
    """Each worker answers an adapter version with the version's count whatever it merged, so a stage that took the
    wrong range of layers would leave weights unmerged without a word: the setup's answers are checked instead."""
    from moe_grpo.rollout.engine_error import EngineError
    from moe_grpo.rollout.engine_weights import check_stages_cover

    check_stages_cover([{"weights": 6}, {"weights": 6}, {"weights": 4}, {"weights": 4}], [0, 0, 1, 1], 10, "e")
    check_stages_cover([{"weights": 10}, {"weights": 10}], [0, 0], 10, "e")  # TP=2: each worker merges all
    with pytest.raises(EngineError, match=r"engine e: the workers' pipeline stages merge \{0: \{6\}, 1: \{3\}\} "
                                          r"adapted weights .* expected the stages to add up to 10"):
        check_stages_cover([{"weights": 6}, {"weights": 3}], [0, 1], 10, "e")
    with pytest.raises(EngineError, match="each stage's workers the same"):
        check_stages_cover([{"weights": 6}, {"weights": 5}, {"weights": 4}, {"weights": 4}], [0, 0, 1, 1], 10, "e")

