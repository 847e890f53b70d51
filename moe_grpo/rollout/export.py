"""A model directory vLLM loads: config.json, safetensors weights (HF names), the project tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from moe_grpo.checkpoint.hf_init import copy_tokenizer
from moe_grpo.checkpoint.hf_io import SafetensorsDir
from moe_grpo.checkpoint.peft import write_peft_adapter
from moe_grpo.data.tokenizer import write_tokenizer
from moe_grpo.learner.lora import merge_into_hf
from moe_grpo.models.hf_config import hf_config_from_spec, read_hf_config
from moe_grpo.models.hf_names import hf_names, layer_groups, param_mappings, to_hf
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.rollout.lora_merge import is_adapter_name

if TYPE_CHECKING:
    from moe_grpo.learner.lora_config import LoraConfig

START_ADAPTER = "adapter"
"""A LoRA run's start directory: the frozen base in the directory, this subdirectory the PEFT adapter of the version
the engine starts on (`VllmEngine(lora=...)` applies it at start)."""

# transformers ships no config class for DeepSeek-MoE (v1); public checkpoints carry one as
# remote code. We write our own minimal one so vLLM (trust_remote_code) can read config.json.
_DEEPSEEK_V1_CONFIG = '''"""DeepSeek-MoE (v1) configuration, written by moe_grpo's export."""
from transformers import PretrainedConfig


class DeepseekConfig(PretrainedConfig):
    model_type = "deepseek"

    def __init__(self, vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                 num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=None,
                 n_routed_experts=None, num_experts_per_tok=None, moe_layer_freq=1, first_k_dense_replace=0,
                 norm_topk_prob=False, scoring_func="softmax", hidden_act="silu", max_position_embeddings=2048,
                 initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, rope_theta=10000.0, rope_scaling=None,
                 attention_bias=False, attention_dropout=0.0, head_dim=None, tie_word_embeddings=False, **kwargs):
        for key, value in dict(locals()).items():
            if key not in ("self", "kwargs", "__class__", "tie_word_embeddings"):
                setattr(self, key, value)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''


def hf_state_from_megatron(spec: MoEModelSpec, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full Megatron tensors (TP=EP=PP=1 names) -> HF tensors, through the family's name map."""
    out: dict[str, torch.Tensor] = {}
    for m in param_mappings(spec):
        if m.megatron not in state:
            raise KeyError(f"Megatron state has no {m.megatron!r}")
        out.update(zip(m.hf, (t.detach().to("cpu").contiguous() for t in to_hf(m, state[m.megatron], spec))))
    return out


def export_model_dir(spec: MoEModelSpec, hf_state: dict[str, torch.Tensor], directory: str | Path,
                     source_dir: str | Path | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer; staged and renamed into place.

    `source_dir`: the HF checkpoint the run started from (`init.hf`); its tokenizer files are copied and the keys
    of its config.json that the model description does not hold (token ids, rope scaling, ...) are kept.
    Without it the project's byte tokenizer is written."""
    from safetensors.torch import save_file

    target = Path(directory)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = hf_config_from_spec(spec, torch_dtype=str(next(iter(hf_state.values())).dtype).removeprefix("torch."))
    if source_dir is None:
        cfg.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    else:
        original = read_hf_config(source_dir)
        tokens = {k: original[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in original}
        cfg = {**original, **cfg, **tokens}
    if spec.architecture == "DeepseekForCausalLM":
        cfg["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekConfig"}
        (tmp / "configuration_deepseek.py").write_text(_DEEPSEEK_V1_CONFIG)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(hf_state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if source_dir is None:
        write_tokenizer(tmp, spec.vocab_size)
    else:
        if not copy_tokenizer(source_dir, tmp):
            raise FileNotFoundError(f"{source_dir} has no tokenizer files to export with the policy")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def export_lora_version(spec: MoEModelSpec, lora: LoraConfig, tensors: dict[str, torch.Tensor],
                        directory: str | Path, *,
                        base_dir: str | Path | None = None, source_dir: str | Path | None = None) -> tuple[Path, bool]:
    """A published LoRA version (`read_version`: HF base tensors and / or PEFT adapter tensors) as a directory.

    A base version becomes an engine start directory: the frozen base, and the version's adapter in
    `<directory>/adapter` (PEFT format; `VllmEngine(lora=...)` applies it at start). An adapter-only version
    becomes the merged model (base read from `base_dir`, the start directory) with its adapter in
    `<directory>/peft_adapter`. Returns (the directory, whether the version was a base version)."""
    adapter = {k: v for k, v in tensors.items() if is_adapter_name(k)}
    base = {k: v for k, v in tensors.items() if not is_adapter_name(k)}
    if base:
        path = export_model_dir(spec, base, directory, source_dir=source_dir)
        # The engine reads this adapter's tensors by our per-expert names (lora_merge.py), not through PEFT.
        write_peft_adapter(path / START_ADAPTER, adapter, spec, lora, experts="per_expert")
        return path, True
    if base_dir is None:
        raise ValueError(f"an adapter-only version and no base directory (base_dir=None) to merge it into")
    files = SafetensorsDir(base_dir)
    merged = merge_into_hf({n: files.get(n) for n in hf_names(spec)}, adapter, lora.scale)
    path = export_model_dir(spec, merged, directory, source_dir=source_dir)
    write_peft_adapter(path / "peft_adapter", adapter, spec, lora)
    return path, False


def export_learner(learner: Any, directory: str | Path) -> Path:
    """A single-process learner's current weights as a vLLM model directory."""
    if learner.layout.world_size() != 1:
        raise ValueError("export_learner needs a TP=EP=PP=1 learner; sharded learners go through the weight sync")
    state = dict(learner.module.state_dict())
    return export_model_dir(learner.spec, hf_state_from_megatron(learner.spec, state), directory)


def weight_buckets(spec: MoEModelSpec, hf_state: dict[str, torch.Tensor]) -> Iterable[dict[str, torch.Tensor]]:
    """HF tensors grouped one decoder layer per bucket: vLLM reloads whole modules only."""
    for group in layer_groups(param_mappings(spec)):
        yield {name: hf_state[name] for m in group for name in m.hf}
