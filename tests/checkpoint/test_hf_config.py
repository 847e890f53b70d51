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


def test_deepseek_v3_yarn_goes_to_the_learner_and_odd_scalings_are_refused():
    spec = load_model_spec("deepseek_v3")
    assert spec.yarn_rope == {"rotary_scaling_factor": 40.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = hf_config_from_spec(spec)
    assert cfg["rope_scaling"]["factor"] == 40
    for bad, needle in [(dict(type="linear", factor=2.0), "rope type 'linear' is not applied"),
                        (dict(type="yarn", factor=4.0, original_max_position_embeddings=128, attention_factor=1.0),
                         "explicit attention_factor"),
                        (dict(type="yarn", factor=4.0, original_max_position_embeddings=128, mscale_all_dim=1.0),
                         "mscale_all_dim without mscale")]:
        with pytest.raises(ValueError, match=needle):
            spec.replace(extra_hf_config={"rope_scaling": bad})
    with pytest.raises(ValueError, match="MLA models"):
        load_model_spec("qwen3_moe_30b_a3b").replace(extra_hf_config={"rope_scaling": dict(type="yarn", factor=4.0)})


def test_configs_written_by_transformers_get_what_vllm_needs():
    from moe_grpo.models.hf_config import vllm_hf_overrides

    v3 = hf_config_from_spec(load_model_spec("deepseek_v3"))
    for key in ("topk_method", "scoring_func"):
        del v3[key]  # transformers' save_pretrained leaves both out
    assert vllm_hf_overrides(v3) == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    v2 = hf_config_from_spec(load_model_spec("deepseek_v2_lite"))
    v2.update(n_group=None, topk_group=None)  # what transformers' DeepseekV2Config writes without grouping
    assert vllm_hf_overrides(v2) == {"n_group": 1, "topk_group": 1}
    assert vllm_hf_overrides(hf_config_from_spec(load_model_spec("qwen3_moe_30b_a3b"))) == {}
