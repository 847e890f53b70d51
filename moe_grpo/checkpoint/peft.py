"""LoRA adapters in PEFT's directory format, and merging one into a Hugging Face checkpoint.

A PEFT LoRA adapter directory holds `adapter_config.json` (peft_type LORA, `r`, `lora_alpha`, `target_modules`,
...) and `adapter_model.safetensors` with one `lora_A` `[r, in]` and one `lora_B` `[out, r]` per adapted HF
module, named `base_model.model.<HF module>.lora_{A,B}.weight` (e.g.
`base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight`). The adapter's change to a weight is
`(lora_alpha / r) * B @ A` (`lora_alpha / sqrt(r)` with `use_rslora`).

`target_modules` is written as one regular expression (PEFT full-matches a string against each module name)
that names exactly the adapted modules, so `lora.targets=[experts]` does not also put adapters on the dense MLP's
`gate_proj`, as a list of leaf names would.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from moe_grpo.learner.lora_config import LoraConfig
from moe_grpo.models.spec import MoEModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def target_modules_regex(spec: MoEModelSpec, config: LoraConfig) -> str:
    """A regular expression that full-matches the HF name of every adapted module and nothing else."""
    import re

    from moe_grpo.learner.lora import adapter_sites, hf_module

    modules = [hf_module(hf) for m in adapter_sites(spec, config).values() for hf in m.hf]
    leaves = sorted({name.rsplit(".", 1)[1] for name in modules})
    parts = []
    for group_re in (r"model\.layers\.\d+\.self_attn", r"model\.layers\.\d+\.mlp\.experts\.\d+",
                     r"model\.layers\.\d+\.mlp\.shared_experts"):
        if any(re.fullmatch(f"{group_re}\\.\\w+", name) for name in modules):
            parts.append(f"{group_re}\\.({'|'.join(leaves)})")
    dense = sorted({int(name.split(".")[2]) for name in modules if re.fullmatch(r"model\.layers\.\d+\.mlp\.\w+", name)})
    if dense:
        parts.append(f"model\\.layers\\.({'|'.join(map(str, dense))})\\.mlp\\.({'|'.join(leaves)})")
    pattern = "|".join(f"(?:{p})" for p in parts)
    matched = {name for name in modules if re.fullmatch(pattern, name)}
    if matched != set(modules):
        raise AssertionError(f"target_modules regex misses {sorted(set(modules) - matched)[:3]}")
    return pattern


def write_peft_adapter(directory: str | Path, state: dict[str, torch.Tensor], spec: MoEModelSpec,
                       config: LoraConfig, *, base_model: str | None = None) -> Path:
    """Write `state` (PEFT naming, whole tensors) as a PEFT adapter directory; staged and renamed into place."""
    from safetensors.torch import save_file

    target = Path(directory)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
        "lora_dropout": config.dropout, "target_modules": target_modules_regex(spec, config), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "base_model_name_or_path": base_model, "inference_mode": True,
    }  # PEFT's keys only: PEFT warns about any other key as if the file came from a newer PEFT
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, str(tmp / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def read_adapter_config(directory: str | Path) -> dict[str, Any]:
    """`adapter_config.json` of a PEFT LoRA adapter, checked for what this project can apply."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type={cfg.get('peft_type')!r}, expected 'LORA'")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise ValueError(f"{path}: {key}={cfg[key]!r}: per-module ranks or alphas are not supported")
    if cfg.get("use_dora"):
        raise ValueError(f"{path}: use_dora=true (DoRA) is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={cfg['bias']!r}: adapters with bias terms are not supported")
    return cfg


def adapter_scale(cfg: dict[str, Any]) -> float:
    """What PEFT multiplies B @ A by: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def read_adapter_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors, with PEFT's adapter name (`.default`) dropped from the keys where a saver kept it."""
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_WEIGHTS}")
    return {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
            for k, v in load_file(str(path)).items()}


def read_peft_adapter(directory: str | Path, config: LoraConfig) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors for a learner with `config`: its r and scale must equal the learner's."""
    cfg = read_adapter_config(directory)
    if int(cfg["r"]) != config.rank:
        raise ValueError(f"{directory}: the adapter has r={cfg['r']}, lora.rank={config.rank}; set lora.rank={cfg['r']}")
    if not math.isclose(adapter_scale(cfg), config.scale, rel_tol=1e-6):
        raise ValueError(f"{directory}: the adapter scales B@A by {adapter_scale(cfg):g} (lora_alpha={cfg['lora_alpha']}"
                         f"{', rsLoRA' if cfg.get('use_rslora') else ''}), the learner by lora.alpha/lora.rank="
                         f"{config.scale:g}; set lora.alpha={cfg['lora_alpha']}")
    return read_adapter_weights(directory)


def merge_adapter_checkpoint(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write `base_dir` (an HF safetensors checkpoint) with the PEFT adapter at `adapter_dir` folded into its weights
    (`W + scale * B @ A`) to `out_dir` (must not exist), one safetensors file of the base at a time; config,
    tokenizer and other files are copied. Returns {"merged": modules changed, "tensors": tensors written}."""
    from moe_grpo.checkpoint.hf_io import SafetensorsDir, ShardedSafetensorsWriter
    from moe_grpo.learner.lora import PEFT_PREFIX, merge_into_hf

    target = Path(out_dir)
    if target.exists():
        raise FileExistsError(f"{target} exists; choose a new destination")
    scale = adapter_scale(read_adapter_config(adapter_dir))
    adapter = read_adapter_weights(adapter_dir)
    base = SafetensorsDir(base_dir)
    modules = {k.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight") for k in adapter if k.endswith(".lora_A.weight")}
    base.require(f"{m}.weight" for m in modules)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        writer = ShardedSafetensorsWriter(tmp)
        by_file: dict[Path, list[str]] = {}
        for name, info in base.tensors.items():
            by_file.setdefault(info.file, []).append(name)
        for _, names in sorted(by_file.items()):
            tensors = {name: base.get(name) for name in names}
            mine = {k: v for k, v in adapter.items()
                    if k.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] + ".weight" in tensors}
            writer.write_file(merge_into_hf(tensors, mine, scale))
        writer.finish()
        for p in Path(base_dir).iterdir():
            if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
                shutil.copy2(p, tmp / p.name)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"merged": len(modules), "tensors": len(base.tensors)}
