"""One description of a DeepSeek-family or Qwen3-MoE model.

`MoEModelSpec` is the single place where a model's shape lives. The Megatron
side (`models/megatron.py`) and, later, the Hugging Face config export read it;
neither holds shape defaults of its own.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, Mapping

Architecture = Literal[
    "DeepseekForCausalLM",  # DeepSeek-MoE: multi-head attention, softmax routing
    "DeepseekV2ForCausalLM",  # MLA, softmax routing (V2, V2-Lite)
    "DeepseekV3ForCausalLM",  # MLA, sigmoid routing with expert bias, group-limited top-k
    "Qwen3MoeForCausalLM",  # grouped-query attention with QK norm, no shared experts
]
ARCHITECTURES: tuple[str, ...] = Architecture.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MoEModelSpec:
    """Shape and routing of a MoE decoder-only language model."""

    name: str
    """Human-readable name, used in logs and file names."""
    architecture: Architecture
    """Hugging Face architecture this model exports to (and vLLM serves it as)."""
    vocab_size: int
    """Number of token ids."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Decoder layers, dense and MoE together."""
    num_attention_heads: int
    """Query heads."""
    ffn_hidden_size: int
    """Intermediate size of the dense MLP in the leading dense layers."""
    num_experts: int
    """Routed experts per MoE layer."""
    moe_ffn_hidden_size: int
    """Intermediate size of one routed expert."""
    top_k: int
    """Routed experts chosen per token."""
    first_k_dense: int = 0
    """Leading layers with a dense MLP instead of MoE (DeepSeek's first_k_dense_replace)."""
    num_shared_experts: int = 0
    """Always-on experts; their combined intermediate size is num_shared_experts * moe_ffn_hidden_size."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means multi-head (= num_attention_heads)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads."""
    qk_layernorm: bool = False
    """RMSNorm on queries and keys per head (Qwen3)."""
    # Multi-head latent attention (DeepSeek-V2/V3). kv_lora_rank set => MLA.
    q_lora_rank: int | None = None
    """Rank of the query down-projection; None projects queries directly (V2-Lite)."""
    kv_lora_rank: int | None = None
    """Rank of the compressed key/value latent; None disables MLA."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key width without rotary embedding."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query/key width with rotary embedding."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    # Routing
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score function: softmax (DeepSeek-MoE/V2, Qwen3) or sigmoid (DeepSeek-V3)."""
    expert_bias: bool = False
    """Per-expert bias added to scores for top-k selection only (DeepSeek-V3's e_score_correction_bias)."""
    num_expert_groups: int | None = None
    """Expert groups for group-limited top-k (DeepSeek-V3 n_group); None disables grouping."""
    group_top_k: int | None = None
    """Groups kept per token before the expert top-k (DeepSeek-V3 topk_group)."""
    normalize_top_k: bool = False
    """Renormalise the chosen experts' probabilities to sum to 1 (norm_topk_prob)."""
    routed_scaling_factor: float = 1.0
    """Multiplier on the routed experts' combined output (DeepSeek-V3: 2.5)."""
    # Misc
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is configured for."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    extra_hf_config: Mapping[str, Any] = field(default_factory=dict)
    """Extra keys copied verbatim into an exported Hugging Face config.json. `rope_scaling` here is the
    model's RoPE scaling (HF keys); the learner applies it (YaRN, MLA models only, see `yarn_rope`)."""

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"model {self.name!r}: {msg}")

        need(self.architecture in ARCHITECTURES, f"architecture={self.architecture!r}, expected one of {ARCHITECTURES}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "ffn_hidden_size",
                  "num_experts", "moe_ffn_hidden_size", "top_k"):
            need(getattr(self, f) > 0, f"{f}={getattr(self, f)}, expected a positive integer")
        need(self.top_k <= self.num_experts, f"top_k={self.top_k}, expected <= num_experts={self.num_experts}")
        need(0 <= self.first_k_dense < self.num_layers,
             f"first_k_dense={self.first_k_dense}, expected 0 <= first_k_dense < num_layers={self.num_layers}")
        need(self.score_function in ("softmax", "sigmoid"),
             f"score_function={self.score_function!r}, expected 'softmax' or 'sigmoid'")
        groups = self.query_groups
        need(self.num_attention_heads % groups == 0,
             f"num_query_groups={groups}, expected a divisor of num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None:
            need(self.hidden_size % self.num_attention_heads == 0,
                 f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}; set head_dim")
        # vLLM's DeepseekForCausalLM attention sizes its heads hidden_size / num_attention_heads whatever head_dim
        # says, so another head_dim would make the engine and the learner different models.
        if self.architecture == "DeepseekForCausalLM" and not self.uses_mla and self.head_dim is not None:
            need(self.head_dim * self.num_attention_heads == self.hidden_size,
                 f"head_dim={self.head_dim} with num_attention_heads={self.num_attention_heads} and hidden_size="
                 f"{self.hidden_size}: DeepseekForCausalLM's heads are hidden_size / num_attention_heads wide in "
                 f"vLLM; expected head_dim={self.hidden_size // self.num_attention_heads} or a hidden_size of "
                 f"{self.head_dim * self.num_attention_heads}")
        if (self.num_expert_groups is None) != (self.group_top_k is None):
            raise ValueError(f"model {self.name!r}: num_expert_groups={self.num_expert_groups} and "
                             f"group_top_k={self.group_top_k}, expected both set or both None")
        if self.num_expert_groups is not None:
            need(self.num_experts % self.num_expert_groups == 0,
                 f"num_expert_groups={self.num_expert_groups}, expected a divisor of num_experts={self.num_experts}")
            need(0 < self.group_top_k <= self.num_expert_groups,  # type: ignore[operator]
                 f"group_top_k={self.group_top_k}, expected 1..num_expert_groups={self.num_expert_groups}")
        need(self.score_function != "sigmoid" or self.normalize_top_k or self.top_k == 1,
             "score_function='sigmoid' renormalises the chosen experts in Megatron; set normalize_top_k=True")
        need(not (self.expert_bias and self.score_function != "sigmoid"),
             "expert_bias=True needs score_function='sigmoid' (DeepSeek-V3 routing)")
        need(self.architecture != "DeepseekV3ForCausalLM" or self.uses_mla,
             "DeepseekV3ForCausalLM needs multi-head latent attention (set kv_lora_rank)")
        self.yarn_rope  # refuses scalings the learner would not apply as transformers and vLLM do

    # ---- derived shape ------------------------------------------------------------
    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def yarn_rope(self) -> dict[str, float] | None:
        """YaRN parameters (Megatron's names) from `extra_hf_config['rope_scaling']`, None for plain RoPE.

        Read as transformers reads DeepSeek's config: the cos/sin concentration is
        mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
        mscale(factor); the softmax scale gains mscale(factor, mscale_all_dim)^2. Megatron's
        MLA computes exactly that from (mscale, mscale_all_dim), so other spellings (an explicit
        `attention_factor`, only one of the two set, `truncate: false`) are refused rather
        than applied differently from the engine.
        """
        rope = dict(self.extra_hf_config.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind in (None, "default"):
            return None

        def refuse(why: str) -> ValueError:
            return ValueError(f"model {self.name!r}: rope_scaling {rope}: {why}")

        if kind not in ("yarn", "deepseek_yarn"):
            raise refuse(f"rope type {kind!r} is not applied by the Megatron learner; expected 'yarn' or none")
        if not self.uses_mla:
            raise refuse("YaRN is applied by the learner for MLA models (DeepSeek-V2/V3) only")
        if rope.get("attention_factor") is not None:
            raise refuse("an explicit attention_factor is not supported; give mscale and mscale_all_dim")
        if rope.get("truncate") is False:
            raise refuse("truncate=false is not supported (Megatron and vLLM round the correction range)")
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if bool(mscale) != bool(mscale_all_dim) and mscale_all_dim:
            raise refuse("mscale_all_dim without mscale: transformers and Megatron disagree on the concentration")
        if not (mscale and mscale_all_dim):
            mscale, mscale_all_dim = 1.0, 0.0  # transformers: mscale(factor); no softmax correction
        orig = rope.get("original_max_position_embeddings")
        factor = rope.get("factor")
        if orig is None:
            raise refuse("YaRN needs original_max_position_embeddings")
        if factor is None:  # transformers' rule for DeepSeek-V3 configs without a factor
            factor = self.max_position_embeddings / float(orig)
        if float(factor) < 1.0:
            raise refuse(f"factor={factor}, expected >= 1")
        return {"rotary_scaling_factor": float(factor), "original_max_position_embeddings": int(orig),
                "beta_fast": float(rope.get("beta_fast") or 32.0), "beta_slow": float(rope.get("beta_slow") or 1.0),
                "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim)}

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def moe_layer_pattern(self) -> list[int]:
        """Per layer: 1 for MoE, 0 for dense (Megatron's moe_layer_freq list)."""
        return [0] * self.first_k_dense + [1] * self.num_moe_layers

    @property
    def shared_expert_hidden_size(self) -> int | None:
        return self.num_shared_experts * self.moe_ffn_hidden_size if self.num_shared_experts else None

    def replace(self, **changes: Any) -> "MoEModelSpec":
        return replace(self, **changes)


def spec_from_mapping(values: Mapping[str, Any]) -> MoEModelSpec:
    """Build a spec from a plain mapping (a Hydra `model:` node); unknown keys are an error."""
    known = {f.name for f in fields(MoEModelSpec)}
    unknown = sorted(set(values) - known - {"hf_path"})
    if unknown:
        raise ValueError(f"unknown model field(s) {unknown}; expected a subset of {sorted(known)}")
    kwargs = {k: v for k, v in values.items() if k in known}
    if "extra_hf_config" in kwargs:
        kwargs["extra_hf_config"] = dict(kwargs["extra_hf_config"] or {})
    return MoEModelSpec(**kwargs)


SPEC_FILE = "moe_grpo_model.json"
"""The model's description beside a Megatron checkpoint (the learner's, a conversion's): the way back needs no
config, and a learner refuses a checkpoint of another model."""


def spec_json(spec: MoEModelSpec) -> str:
    """`spec` as the text of `SPEC_FILE` (sorted keys, one field a line)."""
    d = dataclasses.asdict(spec)
    d["extra_hf_config"] = dict(spec.extra_hf_config)
    return json.dumps(d, indent=2, sort_keys=True) + "\n"


def write_spec(spec: MoEModelSpec, megatron_dir: str | Path) -> None:
    """Write `spec` into `megatron_dir/SPEC_FILE`."""
    (Path(megatron_dir) / SPEC_FILE).write_text(spec_json(spec))


def read_spec(megatron_dir: str | Path) -> MoEModelSpec:
    """The model described in `megatron_dir/SPEC_FILE`; FileNotFoundError naming the directory when it has none."""
    path = Path(megatron_dir) / SPEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{megatron_dir} has no {SPEC_FILE}: expected a Megatron checkpoint written by moe_grpo "
                                "(a conversion, a learner checkpoint, or a run checkpoint's learner/dist)")
    return spec_from_mapping(json.loads(path.read_text()))
