"""MoEModelSpec -> Megatron `TransformerConfig`, layer spec and `GPTModel`.

No parallelism is decided here: the caller passes the parallel sizes it chose
(`learner/parallel.py`) as `parallel_kwargs`, and this module only translates
the model's shape and routing into Megatron's vocabulary.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from moe_grpo.models.options import MegatronOptions
from moe_grpo.models.spec import MoEModelSpec

__all__ = ["MegatronOptions", "build_gpt_model", "layer_spec", "transformer_config"]


def transformer_config(
    spec: MoEModelSpec,
    options: MegatronOptions = MegatronOptions(),
    parallel_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """The Megatron TransformerConfig (MLATransformerConfig for MLA models) for `spec`."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        kv_channels=spec.kv_channels,
        num_query_groups=spec.query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        qk_layernorm=spec.qk_layernorm or spec.uses_mla,  # MLA: RMSNorm on the q/kv latents
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=options.init_method_std,
        params_dtype=options.dtype,
        bf16=options.dtype == torch.bfloat16,
        fp16=options.dtype == torch.float16,
        perform_initialization=options.perform_initialization,
        use_cpu_initialization=not torch.cuda.is_available(),
        # MoE
        num_moe_experts=spec.num_experts,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.top_k,
        moe_layer_freq=spec.moe_layer_pattern,
        moe_shared_expert_intermediate_size=spec.shared_expert_hidden_size,
        moe_router_score_function=spec.score_function,
        moe_router_enable_expert_bias=spec.expert_bias,
        moe_router_num_groups=spec.num_expert_groups,
        moe_router_group_topk=spec.group_top_k,
        # softmax: pre_softmax=True is softmax over all experts then top-k (not renormalised)
        moe_router_pre_softmax=spec.score_function == "softmax" and not spec.normalize_top_k,
        moe_router_topk_scaling_factor=spec.routed_scaling_factor if spec.routed_scaling_factor != 1.0 else None,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="seq_aux_loss" if options.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=options.aux_loss_coeff,
        moe_token_dispatcher_type=options.token_dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,  # the fused router returns before replay and ignores it
        moe_enable_routing_replay=options.routing_replay,
    )
    if options.recompute:
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    kw.update(parallel_kwargs or {})
    if spec.uses_mla:
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_head_dim=spec.qk_nope_head_dim,
            qk_pos_emb_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            rotary_base=spec.rope_theta,
        )
        yarn = spec.yarn_rope
        if yarn is None:
            kw.update(rope_type="rope", rotary_scaling_factor=1.0)  # plain RoPE: no yarn mscale on the softmax scale
        else:
            kw.update(rope_type="yarn", **yarn)  # MLA scales the softmax by mscale(factor, mscale_all_dim)^2
        return MLATransformerConfig(**kw)
    return TransformerConfig(**kw)


def _local_mla_core_attention() -> type:
    """Megatron's local DotProductAttention for MLA.

    MLASelfAttention builds its core attention with `k_channels` / `v_channels`
    (query/key and value head widths differ in MLA); only the TE module accepts
    them in megatron-core 0.16.1. The local module's maths already works for
    any head width; only its output width must follow the value heads.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLADotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                heads = self.num_attention_heads_per_partition
                self.hidden_size_per_partition = v_channels * heads

    return LocalMLADotProductAttention


def layer_spec(spec: MoEModelSpec, config: Any, *, te: bool = False, pp_rank: int | None = None) -> Any:
    """Megatron decoder block spec: dense layers first, MoE after, Megatron's local modules.

    Not chosen by whether Transformer Engine imports (NGC containers ship it): TE's modules fuse each input norm into
    the QKV / fc1 linear (`...linear_qkv.layer_norm_weight`), names the HF map (`models/hf_names.py`) does not know,
    so the weight sync and checkpoint conversion would refuse the model; the TE spec is unchecked (docs/guides/gpu.md)
    and `te=True` is for trying it."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm", pp_rank=pp_rank)
    if spec.uses_mla and not te:
        core = _local_mla_core_attention()
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core
    return block


def build_gpt_model(
    spec: MoEModelSpec,
    config: Any,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    pp_rank: int | None = None,
) -> Any:
    """A Megatron GPTModel for `spec` (this pipeline stage's layers only)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, config, pp_rank=pp_rank),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="none" if spec.uses_mla else "rope",  # MLA applies its own rotary
        rotary_base=spec.rope_theta,
    )
    # RouterReplay keeps a process-global list of every instance ever built; we
    # address routers through the model instead (routing/replay.py), so drop the
    # global references to keep models from leaking across rebuilds.
    RouterReplay.clear_global_router_replay_instances()
    return model
