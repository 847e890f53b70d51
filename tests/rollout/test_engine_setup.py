"""`VllmEngine`'s options checked before vLLM starts (rollout/engine_setup.py `check_options`), without an engine."""

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
