"""Parameter counts of a model, by part, from its spec alone (no torch, no model built): what the placement plan
sizes memory and weight syncs with.

The parts follow how Megatron shards them: attention and dense MLPs (and shared experts) split over tensor
parallelism, routed experts over expert parallelism (and the expert tensor-parallel size), norms, routers and
MLA's down-projections repeated on every tensor-parallel rank (Transformer Engine builds MLA's q/kv
down-projections `duplicated`). The total equals the element count of the Hugging Face tensors
(`models/hf_names.hf_shapes`), which tests check, and the published sizes (DeepSeek-V3 671B, Qwen3-30B-A3B 30.5B).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_grpo.models.spec import MoEModelSpec


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters, by how Megatron shards them."""

    tp_split: int
    """Split over tensor-parallel ranks: attention projections, a dense MLP, shared experts."""
    replicated: int
    """Whole on every rank of its stage: norms, the router (and its expert bias), MLA's down-projections."""
    routed: int
    """Routed experts, all of them (split over expert-parallel x expert tensor-parallel ranks)."""


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters, by part."""

    layers: tuple[LayerParams, ...]
    embedding: int
    """The input embedding (vocab x hidden), split over tensor-parallel ranks on the first stage."""
    output: int
    """The output layer (0 when tied to the embedding), split over tensor-parallel ranks on the last stage."""
    final_norm: int

    @property
    def routed(self) -> int:
        return sum(layer.routed for layer in self.layers)

    @property
    def total(self) -> int:
        return (self.embedding + self.output + self.final_norm
                + sum(layer.tp_split + layer.replicated + layer.routed for layer in self.layers))


def _swiglu(hidden: int, ffn: int) -> int:
    return 3 * hidden * ffn  # gate, up, down


def param_counts(spec: MoEModelSpec) -> ParamCounts:
    """Every parameter of `spec`, by layer and by how it is sharded (see the module docstring)."""
    h, heads = spec.hidden_size, spec.num_attention_heads
    layers = []
    for i in range(spec.num_layers):
        replicated = 2 * h  # input and post-attention norms
        if spec.uses_mla:
            qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
            kv = int(spec.kv_lora_rank or 0)
            if spec.q_lora_rank is None:
                tp_split = heads * qk * h
            else:
                replicated += spec.q_lora_rank * h + spec.q_lora_rank  # q down-projection and its norm
                tp_split = heads * qk * spec.q_lora_rank
            replicated += (kv + spec.qk_rope_head_dim) * h + kv  # kv down-projection and its norm
            tp_split += heads * (spec.qk_nope_head_dim + spec.v_head_dim) * kv + h * heads * spec.v_head_dim
        else:
            d, groups = spec.kv_channels, spec.query_groups
            tp_split = heads * d * h + 2 * groups * d * h + h * heads * d
            if spec.qk_layernorm:
                replicated += 2 * d
        routed = 0
        if i < spec.first_k_dense:
            tp_split += _swiglu(h, spec.ffn_hidden_size)
        else:
            replicated += spec.num_experts * h + (spec.num_experts if spec.expert_bias else 0)
            routed = spec.num_experts * _swiglu(h, spec.moe_ffn_hidden_size)
            if spec.num_shared_experts:
                tp_split += _swiglu(h, int(spec.shared_expert_hidden_size or 0))
        layers.append(LayerParams(tp_split, replicated, routed))
    embedding = spec.vocab_size * h
    return ParamCounts(tuple(layers), embedding, 0 if spec.tie_word_embeddings else embedding, h)
