"""Megatron parameter names <-> Hugging Face tensor names, one map per family.

Megatron names are those of a GPTModel built at TP=EP=PP=1 with the local
spec (`decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight`),
i.e. full, unsharded tensors. Sharding (TP/EP/PP) is not this module's job:
Megatron's own checkpoint machinery reshards full tensors, and the weight
sync gathers shards back into full tensors before renaming.

Three conversions cover every family:
- `copy`: same tensor under another name;
- `gate_up`: Megatron `linear_fc1` = cat[gate_proj; up_proj] along rows;
- `qkv`: Megatron `linear_qkv` interleaves per query group
  [q (heads/groups heads), k, v]; HF keeps q_proj, k_proj, v_proj apart.
MLA projections map one to one (Megatron's MLA uses DeepSeek's rotary
interleave and head layout [nope, rope], so no reordering is needed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

from moe_grpo.models.spec import MoEModelSpec

if TYPE_CHECKING:  # the names and shapes need no torch (the placement plan sizes versions with them, torch-free)
    import torch

Kind = Literal["copy", "gate_up", "qkv"]


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind = "copy"
    layer: int | None = None
    """Decoder layer index, None for embeddings / final norm / output layer."""


def _mlp(prefix_m: str, prefix_h: str, layer: int) -> list[ParamMapping]:
    return [
        ParamMapping(f"{prefix_m}.linear_fc1.weight", (f"{prefix_h}.gate_proj.weight", f"{prefix_h}.up_proj.weight"),
                     "gate_up", layer),
        ParamMapping(f"{prefix_m}.linear_fc2.weight", (f"{prefix_h}.down_proj.weight",), "copy", layer),
    ]


def param_mappings(spec: MoEModelSpec) -> list[ParamMapping]:
    """Every parameter of the model, in Megatron module order (embedding, layers, final norm, output)."""
    out = [ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}", f"model.layers.{i}"
        out.append(ParamMapping(f"{m}.input_layernorm.weight", (f"{h}.input_layernorm.weight",), "copy", i))
        a, ha = f"{m}.self_attention", f"{h}.self_attn"
        if spec.uses_mla:
            if spec.q_lora_rank is None:
                out.append(ParamMapping(f"{a}.linear_q_proj.weight", (f"{ha}.q_proj.weight",), "copy", i))
            else:
                out += [
                    ParamMapping(f"{a}.linear_q_down_proj.weight", (f"{ha}.q_a_proj.weight",), "copy", i),
                    ParamMapping(f"{a}.q_layernorm.weight", (f"{ha}.q_a_layernorm.weight",), "copy", i),
                    ParamMapping(f"{a}.linear_q_up_proj.weight", (f"{ha}.q_b_proj.weight",), "copy", i),
                ]
            out += [
                ParamMapping(f"{a}.linear_kv_down_proj.weight", (f"{ha}.kv_a_proj_with_mqa.weight",), "copy", i),
                ParamMapping(f"{a}.kv_layernorm.weight", (f"{ha}.kv_a_layernorm.weight",), "copy", i),
                ParamMapping(f"{a}.linear_kv_up_proj.weight", (f"{ha}.kv_b_proj.weight",), "copy", i),
            ]
        else:
            out.append(ParamMapping(f"{a}.linear_qkv.weight",
                                    (f"{ha}.q_proj.weight", f"{ha}.k_proj.weight", f"{ha}.v_proj.weight"), "qkv", i))
            if spec.qk_layernorm:
                out += [ParamMapping(f"{a}.q_layernorm.weight", (f"{ha}.q_norm.weight",), "copy", i),
                        ParamMapping(f"{a}.k_layernorm.weight", (f"{ha}.k_norm.weight",), "copy", i)]
        out.append(ParamMapping(f"{a}.linear_proj.weight", (f"{ha}.o_proj.weight",), "copy", i))
        out.append(ParamMapping(f"{m}.pre_mlp_layernorm.weight", (f"{h}.post_attention_layernorm.weight",), "copy", i))
        if i < spec.first_k_dense:
            out += _mlp(f"{m}.mlp", f"{h}.mlp", i)
            continue
        out.append(ParamMapping(f"{m}.mlp.router.weight", (f"{h}.mlp.gate.weight",), "copy", i))
        if spec.expert_bias:
            out.append(ParamMapping(f"{m}.mlp.router.expert_bias", (f"{h}.mlp.gate.e_score_correction_bias",), "copy", i))
        for e in range(spec.num_experts):
            out += _mlp(f"{m}.mlp.experts.local_experts.{e}", f"{h}.mlp.experts.{e}", i)
        if spec.num_shared_experts:
            out += _mlp(f"{m}.mlp.shared_experts", f"{h}.mlp.shared_experts", i)
    out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not spec.tie_word_embeddings:
        out.append(ParamMapping("output_layer.weight", ("lm_head.weight",)))
    return out


def to_megatron(mapping: ParamMapping, hf_tensors: Sequence[torch.Tensor], spec: MoEModelSpec) -> torch.Tensor:
    """The Megatron tensor for `mapping` from its HF tensors (in `mapping.hf` order)."""
    import torch

    if len(hf_tensors) != len(mapping.hf):
        raise ValueError(f"{mapping.megatron}: got {len(hf_tensors)} HF tensors, expected {len(mapping.hf)}")
    if mapping.kind == "copy":
        return hf_tensors[0]
    if mapping.kind == "gate_up":
        gate, up = hf_tensors
        if gate.shape != up.shape:
            raise ValueError(f"{mapping.hf[0]} {tuple(gate.shape)} and {mapping.hf[1]} {tuple(up.shape)} differ in shape")
        return torch.cat([gate, up], dim=0)
    q, k, v = hf_tensors
    groups, d = spec.query_groups, spec.kv_channels
    per = spec.num_attention_heads // groups
    hidden = q.shape[-1]
    expected = {"q": (spec.num_attention_heads * d, hidden), "k": (groups * d, hidden), "v": (groups * d, hidden)}
    for label, t in zip("qkv", (q, k, v)):
        if tuple(t.shape) != expected[label]:
            raise ValueError(f"{mapping.hf['qkv'.index(label)]} has shape {tuple(t.shape)}, expected {expected[label]}")
    return torch.cat([q.reshape(groups, per * d, hidden), k.reshape(groups, d, hidden), v.reshape(groups, d, hidden)],
                     dim=1).reshape(-1, hidden)


def to_hf(mapping: ParamMapping, tensor: torch.Tensor, spec: MoEModelSpec) -> list[torch.Tensor]:
    """The HF tensors (in `mapping.hf` order) of one Megatron tensor; exact inverse of `to_megatron`."""
    import torch

    if mapping.kind == "copy":
        return [tensor]
    if mapping.kind == "gate_up":
        if tensor.shape[0] % 2:
            raise ValueError(f"{mapping.megatron} has {tensor.shape[0]} rows, expected an even number ([gate; up])")
        gate, up = tensor.chunk(2, dim=0)
        return [gate.contiguous(), up.contiguous()]
    groups, d = spec.query_groups, spec.kv_channels
    per = spec.num_attention_heads // groups
    hidden = tensor.shape[-1]
    grouped = tensor.reshape(groups, (per + 2) * d, hidden)
    q = grouped[:, : per * d].reshape(-1, hidden)
    k = grouped[:, per * d : (per + 1) * d].reshape(-1, hidden)
    v = grouped[:, (per + 1) * d :].reshape(-1, hidden)
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def layer_groups(mappings: list[ParamMapping]) -> list[list[ParamMapping]]:
    """Consecutive mappings of one decoder layer (embedding and head form their own groups).

    vLLM reloads whole modules only and conversion streams a layer at a time:
    both move weights in these groups.
    """
    groups: list[list[ParamMapping]] = []
    for m in mappings:
        if groups and groups[-1][-1].layer == m.layer:
            groups[-1].append(m)
        else:
            groups.append([m])
    return groups


def hf_names(spec: MoEModelSpec) -> set[str]:
    """Every HF tensor name the model has."""
    return {name for m in param_mappings(spec) for name in m.hf}


def hf_shapes(spec: MoEModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor, from the spec alone (no model is built: learner ranks each hold a part)."""
    h, heads = spec.hidden_size, spec.num_attention_heads

    def mlp(prefix: str, ffn: int) -> dict[str, tuple[int, ...]]:
        return {f"{prefix}.gate_proj.weight": (ffn, h), f"{prefix}.up_proj.weight": (ffn, h),
                f"{prefix}.down_proj.weight": (h, ffn)}

    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        if spec.uses_mla:
            qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
            if spec.q_lora_rank is None:
                out[f"{a}.q_proj.weight"] = (heads * qk, h)
            else:
                out.update({f"{a}.q_a_proj.weight": (spec.q_lora_rank, h), f"{a}.q_a_layernorm.weight": (spec.q_lora_rank,),
                            f"{a}.q_b_proj.weight": (heads * qk, spec.q_lora_rank)})
            kv = int(spec.kv_lora_rank or 0)
            out.update({f"{a}.kv_a_proj_with_mqa.weight": (kv + spec.qk_rope_head_dim, h),
                        f"{a}.kv_a_layernorm.weight": (kv,),
                        f"{a}.kv_b_proj.weight": (heads * (spec.qk_nope_head_dim + spec.v_head_dim), kv),
                        f"{a}.o_proj.weight": (h, heads * spec.v_head_dim)})
        else:
            d, groups = spec.kv_channels, spec.query_groups
            out.update({f"{a}.q_proj.weight": (heads * d, h), f"{a}.k_proj.weight": (groups * d, h),
                        f"{a}.v_proj.weight": (groups * d, h), f"{a}.o_proj.weight": (h, heads * d)})
            if spec.qk_layernorm:
                out.update({f"{a}.q_norm.weight": (d,), f"{a}.k_norm.weight": (d,)})
        if i < spec.first_k_dense:
            out.update(mlp(f"{p}.mlp", spec.ffn_hidden_size))
            continue
        out[f"{p}.mlp.gate.weight"] = (spec.num_experts, h)
        if spec.expert_bias:
            out[f"{p}.mlp.gate.e_score_correction_bias"] = (spec.num_experts,)
        for e in range(spec.num_experts):
            out.update(mlp(f"{p}.mlp.experts.{e}", spec.moe_ffn_hidden_size))
        if spec.num_shared_experts:
            out.update(mlp(f"{p}.mlp.shared_experts", int(spec.shared_expert_hidden_size or 0)))
    return out
