import pytest

from moe_grpo.config import load_model_spec
from moe_grpo.models.hf_config import HFConfigError, hf_config_from_spec, spec_from_hf_config


@pytest.mark.parametrize("name", ["deepseek_moe", "deepseek_v2_lite", "deepseek_v3", "qwen3_moe_30b_a3b"])
def test_spec_survives_a_trip_through_config_json(name):
    spec = load_model_spec(name)
    back = spec_from_hf_config(hf_config_from_spec(spec), name=spec.name)
    assert back == spec


def test_deepseek_v3_export_carries_the_keys_vllm_needs():
    cfg = hf_config_from_spec(load_model_spec("deepseek_v3"))
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["n_group"] == 8 and cfg["topk_group"] == 4 and cfg["routed_scaling_factor"] == 2.5


def test_unknown_architecture_and_missing_keys_are_named():
    with pytest.raises(HFConfigError, match="LlamaForCausalLM"):
        spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    cfg = hf_config_from_spec(load_model_spec("qwen3_moe_30b_a3b"))
    del cfg["moe_intermediate_size"]
    with pytest.raises(HFConfigError, match="has no 'moe_intermediate_size'"):
        spec_from_hf_config(cfg)
