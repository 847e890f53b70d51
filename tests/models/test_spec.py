import pytest

from moe_grpo.config import load_model_spec
from moe_grpo.models.spec import MoEModelSpec


def test_embedded_default_is_deepseek_moe_shaped():
    spec = load_model_spec("deepseek_moe")
    assert spec.architecture == "DeepseekForCausalLM"
    assert spec.first_k_dense >= 1 and spec.num_shared_experts >= 1
    assert spec.moe_layer_pattern[: spec.first_k_dense] == [0] * spec.first_k_dense
    assert spec.kv_channels in (32, 64)  # vLLM's CPU attention refuses 16


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="deepseek_moe"):
        load_model_spec("no_such_model")


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(top_k=9), "top_k=9, expected <= num_experts=8"),
        (dict(first_k_dense=3), "first_k_dense=3"),
        (dict(score_function="relu"), "score_function='relu'"),
        (dict(num_expert_groups=3, group_top_k=1), "num_expert_groups=3, expected a divisor of num_experts=8"),
        (dict(num_expert_groups=2), "expected both set or both None"),
        (dict(expert_bias=True), "expert_bias=True needs score_function='sigmoid'"),
        (dict(num_query_groups=3), "num_query_groups=3"),
        (dict(num_attention_heads=8), "DeepseekForCausalLM's heads are hidden_size / num_attention_heads wide"),
    ],
)
def test_bad_model_values_are_named(change, needle):
    spec = load_model_spec("deepseek_moe")
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        spec.replace(**change)


def test_unknown_model_key_is_refused():
    from moe_grpo.models.spec import spec_from_mapping

    with pytest.raises(ValueError, match=r"unknown model field\(s\) \['n_experts'\]"):
        spec_from_mapping({"name": "x", "n_experts": 4})
