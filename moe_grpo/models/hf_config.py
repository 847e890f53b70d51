"""Hugging Face `config.json` <-> MoEModelSpec, for every supported family.

Reading accepts the keys public checkpoints use (DeepSeek's remote-code
configs and transformers' own); writing emits what vLLM needs to load the
model, including keys transformers' `save_pretrained` leaves out for
DeepSeek-V3 (`topk_method: "noaux_tc"`, `scoring_func: "sigmoid"`), without
which vLLM builds no `e_score_correction_bias` and fails to load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from moe_grpo.models.spec import ARCHITECTURES, MoEModelSpec

_MODEL_TYPE = {
    "DeepseekForCausalLM": "deepseek",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_ARCH_OF_MODEL_TYPE = {v: k for k, v in _MODEL_TYPE.items()}


class HFConfigError(ValueError):
    """A config.json this project cannot map onto a model description."""


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    mt = cfg.get("model_type")
    if mt in _ARCH_OF_MODEL_TYPE:
        return _ARCH_OF_MODEL_TYPE[mt]
    raise HFConfigError(f"architectures={archs} model_type={mt!r}; expected one of {list(ARCHITECTURES)}")


def _need(cfg: Mapping[str, Any], key: str, arch: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise HFConfigError(f"config.json for {arch} has no {key!r}")
    return cfg[key]


def _rope_theta(cfg: Mapping[str, Any]) -> float:
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def spec_from_hf_config(cfg: Mapping[str, Any], name: str | None = None) -> MoEModelSpec:
    """The model description of an HF config (a dict as read from config.json)."""
    arch = _architecture(cfg)
    g = lambda k: _need(cfg, k, arch)  # noqa: E731
    extra: dict[str, Any] = {}
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope and rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        # Kept for export and applied by the learner (YaRN on MLA models; MoEModelSpec.yarn_rope refuses the rest).
        extra["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    common = dict(
        name=name or cfg.get("_name_or_path") or arch,
        architecture=arch,
        vocab_size=int(g("vocab_size")),
        hidden_size=int(g("hidden_size")),
        num_layers=int(g("num_hidden_layers")),
        num_attention_heads=int(g("num_attention_heads")),
        ffn_hidden_size=int(g("intermediate_size")),
        moe_ffn_hidden_size=int(g("moe_intermediate_size")),
        top_k=int(g("num_experts_per_tok")),
        rope_theta=_rope_theta(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        normalize_top_k=bool(cfg.get("norm_topk_prob", False)),
        extra_hf_config=extra,
    )
    if arch == "Qwen3MoeForCausalLM":
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise HFConfigError("Qwen3-MoE with mlp_only_layers or decoder_sparse_step != 1 is not supported; "
                                "expected every layer to be MoE")
        return MoEModelSpec(
            **common,
            num_experts=int(cfg.get("num_experts") or g("num_local_experts")),  # transformers 5 writes the latter
            num_query_groups=int(cfg.get("num_key_value_heads") or g("num_attention_heads")),
            head_dim=int(cfg.get("head_dim") or int(g("hidden_size")) // int(g("num_attention_heads"))),
            qk_layernorm=True,
        )
    # DeepSeek family
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:
        raise HFConfigError(f"moe_layer_freq={cfg['moe_layer_freq']}; expected 1 (every layer after the dense ones is MoE)")
    sigmoid = cfg.get("scoring_func", "sigmoid" if arch == "DeepseekV3ForCausalLM" else "softmax") == "sigmoid"
    n_group = cfg.get("n_group")
    topk_group = cfg.get("topk_group")
    group_limited = cfg.get("topk_method") in ("group_limited_greedy", "noaux_tc") or (
        arch == "DeepseekV3ForCausalLM" and n_group)
    kw: dict[str, Any] = dict(
        num_experts=int(g("n_routed_experts")),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
        score_function="sigmoid" if sigmoid else "softmax",
        expert_bias=sigmoid and arch == "DeepseekV3ForCausalLM",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
        num_expert_groups=int(n_group) if group_limited and n_group and int(n_group) > 1 else None,
        group_top_k=int(topk_group) if group_limited and n_group and int(n_group) > 1 else None,
    )
    if arch == "DeepseekForCausalLM":
        kv_heads = int(cfg.get("num_key_value_heads") or g("num_attention_heads"))
        kw.update(num_query_groups=None if kv_heads == int(g("num_attention_heads")) else kv_heads,
                  head_dim=int(cfg["head_dim"]) if cfg.get("head_dim") else None)
    else:
        kw.update(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=int(g("kv_lora_rank")),
                  qk_nope_head_dim=int(g("qk_nope_head_dim")), qk_rope_head_dim=int(g("qk_rope_head_dim")),
                  v_head_dim=int(g("v_head_dim")))
    return MoEModelSpec(**common, **kw)


def hf_config_from_spec(spec: MoEModelSpec, *, torch_dtype: str = "float32") -> dict[str, Any]:
    """An HF config.json dict that transformers and vLLM load as `spec.architecture`."""
    cfg: dict[str, Any] = dict(
        architectures=[spec.architecture],
        model_type=_MODEL_TYPE[spec.architecture],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.query_groups if not spec.uses_mla else spec.num_attention_heads,
        intermediate_size=spec.ffn_hidden_size,
        moe_intermediate_size=spec.moe_ffn_hidden_size,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=spec.normalize_top_k,
        rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=None,
        torch_dtype=torch_dtype,
    )
    if spec.architecture == "Qwen3MoeForCausalLM":
        cfg.update(num_experts=spec.num_experts, num_local_experts=spec.num_experts, head_dim=spec.kv_channels, decoder_sparse_step=1,
                   mlp_only_layers=[], output_router_logits=False, router_aux_loss_coef=0.0)
    else:
        cfg.update(
            n_routed_experts=spec.num_experts,
            n_shared_experts=spec.num_shared_experts or None,
            first_k_dense_replace=spec.first_k_dense,
            moe_layer_freq=1,
            scoring_func=spec.score_function,
            routed_scaling_factor=spec.routed_scaling_factor,
            aux_loss_alpha=0.0,
            seq_aux=True,
        )
        if spec.architecture == "DeepseekV3ForCausalLM":
            cfg.update(topk_method="noaux_tc", n_group=spec.num_expert_groups or 1, topk_group=spec.group_top_k or 1,
                       rope_interleave=True)
        elif spec.num_expert_groups:
            cfg.update(topk_method="group_limited_greedy", n_group=spec.num_expert_groups, topk_group=spec.group_top_k)
        else:
            # vLLM reads n_group / topk_group unconditionally: 1 means "no grouping", None breaks it.
            cfg.update(topk_method="greedy", n_group=1, topk_group=1)
        if spec.architecture == "DeepseekForCausalLM":
            cfg.update(head_dim=spec.kv_channels)
        else:
            cfg.update(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                       qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                       v_head_dim=spec.v_head_dim, qk_head_dim=spec.qk_nope_head_dim + spec.qk_rope_head_dim,
                       head_dim=spec.qk_rope_head_dim)
    cfg.update(dict(spec.extra_hf_config))
    return cfg


def vllm_hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Keys vLLM 0.32 needs that a config.json written by transformers may lack, with transformers' meaning.

    transformers' DeepseekV3 always routes with sigmoid scores and the expert bias, but its
    `save_pretrained` writes neither `topk_method` nor `scoring_func`; vLLM then builds no
    `e_score_correction_bias` and fails to load. transformers' DeepseekV2 leaves `n_group` /
    `topk_group` null when it does not group, and vLLM's CPU router asserts on null.
    """
    arch = _architecture(cfg)
    out: dict[str, Any] = {}
    if arch == "Qwen3MoeForCausalLM":
        return out
    if arch == "DeepseekV3ForCausalLM":
        if not cfg.get("topk_method"):
            out["topk_method"] = "noaux_tc"
        if not cfg.get("scoring_func"):
            out["scoring_func"] = "sigmoid"
    elif not cfg.get("scoring_func"):
        out["scoring_func"] = "softmax"
    if cfg.get("n_group") is None or cfg.get("topk_group") is None:
        out.update(n_group=1, topk_group=1)  # vLLM's "no grouping"
    return out


def read_hf_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path} is not valid JSON: {e}") from e


def write_hf_config(spec: MoEModelSpec, directory: str | Path) -> Path:
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(hf_config_from_spec(spec), indent=2, sort_keys=True) + "\n")
    return path
