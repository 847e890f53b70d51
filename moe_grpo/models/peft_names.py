"""PEFT's names and shapes of a model's LoRA adapter tensors, from its HF names (`hf_names.py`), without torch.

Shared by the learner's adapters (learner/lora.py), the weight sync's plans, the engine's loaders and the placement
plan, which sizes adapter-only versions in a dry run that imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_grpo.models.hf_names import ParamMapping, hf_shapes, param_mappings
from moe_grpo.models.spec import MoEModelSpec

if TYPE_CHECKING:  # the lora section is the learner's config: a layer above (pyproject.toml)
    from moe_grpo.learner.lora_config import LoraConfig

PEFT_PREFIX = "base_model.model."
"""PEFT's prefix of every adapter tensor name (`PeftModelForCausalLM.base_model.model` is the HF model)."""


def target_group(megatron_weight: str) -> str | None:
    """Which `lora.targets` group a Megatron (TP=EP=PP=1) weight name belongs to; None when it is no linear layer
    LoRA may adapt (norms, router, embeddings, output layer)."""
    leaf = megatron_weight.rsplit(".", 2)[-2] if megatron_weight.count(".") >= 2 else ""
    if not (megatron_weight.startswith("decoder.layers.") and leaf.startswith("linear_")
            and megatron_weight.endswith(".weight")):
        return None
    if ".self_attention." in megatron_weight:
        return "attention"
    if ".mlp.experts.local_experts." in megatron_weight:
        return "experts"
    if ".mlp.shared_experts." in megatron_weight:
        return "shared_experts"
    if ".mlp.linear_fc" in megatron_weight:
        return "dense_mlp"
    return None


def adapter_sites(spec: MoEModelSpec, config: LoraConfig) -> dict[str, ParamMapping]:
    """Global (TP=EP=PP=1) Megatron module name of every adapted linear layer -> its HF name map, in model order."""
    out: dict[str, ParamMapping] = {}
    for m in param_mappings(spec):
        group = target_group(m.megatron)
        if group is not None and group in config.targets:
            out[m.megatron.removesuffix(".weight")] = m
    return out


def hf_module(hf_weight: str) -> str:
    """`model.layers.0.self_attn.q_proj.weight` -> `model.layers.0.self_attn.q_proj`."""
    return hf_weight.removesuffix(".weight")


def peft_key(hf_weight: str, factor: str) -> str:
    """PEFT's name of an adapter tensor: `base_model.model.<HF module>.lora_A.weight` (`factor` 'A' or 'B')."""
    return f"{PEFT_PREFIX}{hf_module(hf_weight)}.lora_{factor}.weight"


def peft_shapes(spec: MoEModelSpec, config: LoraConfig) -> dict[str, tuple[int, int]]:
    """Every adapter tensor of the model in PEFT's naming, with its full shape (A `[r, in]`, B `[out, r]`)."""
    shapes = hf_shapes(spec)
    out: dict[str, tuple[int, int]] = {}
    for mapping in adapter_sites(spec, config).values():
        for hf in mapping.hf:
            rows, cols = shapes[hf]
            out[peft_key(hf, "A")] = (config.rank, cols)
            out[peft_key(hf, "B")] = (rows, config.rank)
    return out
