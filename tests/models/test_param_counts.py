"""Real-size configs built as Megatron models on the meta device vs the published sizes."""

import pytest

from moe_grpo.config import load_model_spec

# (total, active) in billions, as published by each model's authors. DeepSeek counts
# activated parameters without the input-embedding lookup (a table gather, not compute);
# Qwen counts every parameter a token touches, embedding included.
PUBLISHED = {
    "deepseek_v3": (671.0, 37.0, "deepseek"),
    "deepseek_v2_lite": (15.7, 2.4, "deepseek"),
    "qwen3_moe_30b_a3b": (30.5, 3.3, "qwen"),
    "qwen3_moe_235b_a22b": (235.0, 22.0, "qwen"),
}


def megatron_param_counts(name):
    """Build the whole model on meta through the project's own Megatron path; count."""
    import torch

    from moe_grpo.learner.parallel import ParallelLayout, init_distributed
    from moe_grpo.models.megatron import MegatronOptions, build_gpt_model, transformer_config

    init_distributed(ParallelLayout())
    spec = load_model_spec(name)
    with torch.device("meta"):
        config = transformer_config(spec, MegatronOptions(perform_initialization=False))
        model = build_gpt_model(spec, config)
    total = routed = embedding = 0
    for pname, p in model.named_parameters():
        total += p.numel()
        if ".experts." in pname and "shared_experts" not in pname:
            routed += p.numel()
        if pname.startswith("embedding."):
            embedding += p.numel()
    assert next(model.parameters()).device.type == "meta"
    active = total - routed * (spec.num_experts - spec.top_k) / spec.num_experts
    return total / 1e9, active / 1e9, embedding / 1e9


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_parameters_match_published(name):
    total, active, embedding = megatron_param_counts(name)
    pub_total, pub_active, convention = PUBLISHED[name]
    if convention == "deepseek":
        active -= embedding
    assert abs(total - pub_total) / pub_total < 0.02, f"{name}: total {total:.2f}B vs published {pub_total}B"
    # DeepSeek-V2-Lite: we count 2.45B; the paper prints "2.4B" (2.1% below). Every other figure
    # is within 2%; the 2.5% bound for this one pair is the published rounding, written down here.
    tolerance = 0.025 if name == "deepseek_v2_lite" else 0.02
    assert abs(active - pub_active) / pub_active < tolerance, f"{name}: active {active:.3f}B vs published {pub_active}B"


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_moe_30b_a3b", "deepseek_v2_lite", "deepseek_moe",
                                  "qwen3_moe_1b_64e", "deepseek_v3_tiny", "qwen3_moe_235b_a22b"])
def test_the_analytic_count_the_plan_uses_is_every_hf_tensor_element(name):
    """models/param_count.py counts without torch (the placement plan runs before anything is imported); it must
    agree with the tensors a weight sync carries, element for element."""
    import math

    from moe_grpo.models.hf_names import hf_shapes
    from moe_grpo.models.param_count import param_counts

    spec = load_model_spec(name)
    counts = param_counts(spec)
    shapes = hf_shapes(spec)
    assert counts.total == sum(math.prod(s) for s in shapes.values())
    assert counts.routed == sum(math.prod(s) for n, s in shapes.items() if ".mlp.experts." in n)
    if name in PUBLISHED:
        assert abs(counts.total / 1e9 - PUBLISHED[name][0]) / PUBLISHED[name][0] < 0.02
