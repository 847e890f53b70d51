"""LoRA adapters in PEFT's directory format, and merging one into a Hugging Face checkpoint.

A PEFT LoRA adapter directory holds `adapter_config.json` (peft_type LORA, `r`, `lora_alpha`, `target_modules`,
`target_parameters`, ...) and `adapter_model.safetensors`. The adapter's change to a weight is
`(lora_alpha / r) * B @ A` (`lora_alpha / sqrt(r)` with `use_rslora`). Two forms, both written and read here:

- **per_expert** (PEFT's module form): one `lora_A` `[r, in]` and one `lora_B` `[out, r]` per adapted HF module,
  named `base_model.model.<HF module>.lora_{A,B}.weight`, routed experts one module each
  (`base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight`); `target_modules` names them. This is
  the learner's own naming (`models/peft_names.peft_key`) and the HF checkpoint's on-disk names, and it is what PEFT
  applies to a
  model class that holds each expert as `nn.Linear` modules (transformers 4).
- **fused** (PEFT's `target_parameters` form): transformers 5.19 holds a Qwen3-MoE / DeepSeek-V2 / DeepSeek-V3
  layer's routed experts as two 3-D parameters, `mlp.experts.gate_up_proj` `[E, 2 ffn, hidden]` (gate rows first,
  then up: the forward does `linear(x, gate_up_proj[e]).chunk(2)` -> gate, up) and `mlp.experts.down_proj`
  `[E, hidden, ffn]`, so there is no `experts.N.gate_proj` module to put a module adapter on (measured: PEFT 0.21.2
  raises NoMatchingPeftModuleError on the per-expert form's `target_modules`). PEFT adapts such a parameter with its
  `ParamWrapper`: per layer one `lora_A` `[R*E, in]` (expert e's A is rows `e*R:(e+1)*R`) and one `lora_B`
  `[out, R*E]` (expert e's B is columns `e::E`), and a module's second targeted parameter wraps the first, so
  `gate_up_proj` (registered first) is `experts.base_layer.lora_*` and `down_proj` is `experts.lora_*`. The
  learner's gate and up adapters are two rank-r pairs; on the fused `[gate; up]` weight they are one rank-2r pair
  with A = [A_gate; A_up] and B block-diagonal, so `gate_up_proj` gets `rank_pattern` 2r and `alpha_pattern`
  2*alpha (the same scale alpha/r, bit for bit) -- the conversion PEFT itself applies to per-expert adapters of
  Mixtral-like models. The export is therefore exact, not a rank-r approximation.

Which form `write_peft_adapter` writes (`experts=`): "auto" (what `export_learner_adapter` uses) writes
"fused" when the installed transformers fuses this architecture's experts on load (its checkpoint conversion
mapping builds `mlp.experts.gate_up_proj` from `experts.*.gate_proj` / `up_proj`; true for Qwen3-MoE,
DeepSeek-V2 and V3 in transformers 5.19), and "per_expert" otherwise (transformers 4, DeepSeek-MoE's remote code,
no transformers installed), i.e. the form PEFT can apply to the model class the user will load. Either can be
asked for explicitly (`write_peft_adapter(dir, learner.adapter_state(), spec, lora, experts="per_expert")`;
`export_learner_adapter` uses "auto"). Readers (`read_peft_adapter` for `init.adapter=DIR`, `merge_adapter_checkpoint`)
take both, and also PEFT's own fused adapters (`get_peft_model(..., target_parameters=[...experts.gate_up_proj, ...])`),
whose gate_up adapter has rank r with A shared by gate and up (exact in the learner: A_gate = A_up = A).

In the fused form every MLP adapter (dense MLP and shared experts too, `nn.Linear` in transformers) is written as a
`target_parameters` entry naming its weight (`model.layers.0.mlp.gate_proj.weight`; PEFT's tensor names are the
same as for a module adapter), not in `target_modules`: PEFT 0.21.2, for model types transformers converts (qwen3_moe,
deepseek_v3, ...), rewrites any `gate_proj` / `up_proj` / `down_proj` in `target_modules` to the routed experts'
fused parameters (measured: a DeepSeek-V3 shared-expert target ends up on `mlp.experts.gate_up_proj`). The fused
form writes `lora_dropout` 0: PEFT's ParamWrapper refuses any other value, and dropout does not act at inference.
PEFT 0.21.2 warns on loading it that the `rank_pattern` / `alpha_pattern` key "did not match any targeted module
and were ignored": that check looks at module targets only; the patterns are applied to the parameter (the loaded
lora_A has 2r rows per expert, and the log-probs match the learner's, tests/learner/test_lora.py).

`target_modules` is written as one regular expression (PEFT full-matches a string against each module name)
that names exactly the adapted modules, so `lora.targets=[experts]` does not also put adapters on the dense MLP's
`gate_proj`, as a list of leaf names would.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal

import torch

from moe_grpo.checkpoint.hf_io import SafetensorsDir, ShardedSafetensorsWriter
from moe_grpo.learner.lora import merge_into_hf
from moe_grpo.models.peft_names import PEFT_PREFIX, adapter_sites, hf_module
from moe_grpo.learner.lora_config import LoraConfig
from moe_grpo.models.spec import MoEModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

ExpertsForm = Literal["auto", "fused", "per_expert"]
EXPERTS_FORMS: tuple[str, ...] = ExpertsForm.__args__  # type: ignore[attr-defined]

FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""transformers' fused expert parameters in their registration order, which is PEFT's nesting order (the first
targeted one is the innermost `ParamWrapper`, named `experts.base_layer.lora_*` when the second is targeted too)."""

GATE_UP_RANK_KEY = r"mlp\.experts\.gate_up_proj"
"""The `rank_pattern` / `alpha_pattern` key of the fused gate_up adapter (PEFT matches `(.*\.)?(KEY)$`)."""

_EXPERT_MODULE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_FUSED_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)lora_([AB])\.weight$")


def target_modules_regex(spec: MoEModelSpec, config: LoraConfig, modules: list[str] | None = None) -> str:
    """A regular expression that full-matches the HF name of every adapted module (or of `modules`) and nothing else."""
    if modules is None:
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


def transformers_fuses_experts(architecture: str) -> bool:
    """Whether the installed transformers loads `architecture`'s routed experts into fused `mlp.experts.gate_up_proj`
    / `down_proj` parameters (its checkpoint conversion mapping concatenates `experts.*.gate_proj` and `up_proj`,
    in that order). False when transformers is not installed or does not know the architecture."""
    try:
        import transformers
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    cls = getattr(transformers, architecture, None)
    model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    if model_type is None:
        return False
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        if list(getattr(conv, "target_patterns", [])) == ["mlp.experts.gate_up_proj"]:
            sources = list(conv.source_patterns)
            if sources != ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"]:
                raise ValueError(f"transformers fuses {architecture}'s experts from {sources}; expected gate_proj "
                                 "then up_proj (the layout the fused export writes)")
            return True
    return False


def resolve_experts_form(experts: str, spec: MoEModelSpec) -> str:
    """'fused' or 'per_expert' for `experts` ('auto' follows the installed transformers, see the module docstring)."""
    if experts not in EXPERTS_FORMS:
        raise ValueError(f"experts={experts!r}, expected one of {EXPERTS_FORMS}")
    if experts != "auto":
        return experts
    return "fused" if transformers_fuses_experts(spec.architecture) else "per_expert"


# --------------------------------------------------------------------------- per-expert <-> fused (exact)


def fuse_expert_adapters(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert adapters (learner / PEFT module naming) -> PEFT's fused `target_parameters` tensors; every other
    tensor unchanged. gate_up becomes a rank-2r pair: A = [A_gate; A_up], B = [[B_gate, 0], [0, B_up]] per expert."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for key, value in state.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise ValueError(f"{key}: not a LoRA A/B tensor name")
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = state[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        m = _EXPERT_MODULE.match(module)
        if m is None:
            out[key], out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = value, b
        else:
            experts.setdefault(int(m.group(1)), {}).setdefault(int(m.group(2)), {})[m.group(3)] = (value, b)
    for layer, by_expert in sorted(experts.items()):
        num = len(by_expert)
        if sorted(by_expert) != list(range(num)):
            raise ValueError(f"layer {layer}: adapters for experts {sorted(by_expert)}, expected 0..{num - 1} (all)")
        projs = set(by_expert[0])
        if projs != {"gate_proj", "up_proj", "down_proj"} or any(set(p) != projs for p in by_expert.values()):
            raise ValueError(f"layer {layer}: expert adapters on {sorted(projs)}; the fused form needs gate_proj, "
                             "up_proj and down_proj of every expert")
        prefix = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts."
        a_gu, b_gu, a_d, b_d = [], [], [], []
        for e in range(num):
            (ag, bg), (au, bu), (ad, bd) = (by_expert[e][p] for p in ("gate_proj", "up_proj", "down_proj"))
            a_gu.append(torch.cat([ag, au], dim=0))
            b_gu.append(torch.block_diag(bg, bu))
            a_d.append(ad)
            b_d.append(bd)
        out[f"{prefix}base_layer.lora_A.weight"] = torch.cat(a_gu, dim=0)
        out[f"{prefix}base_layer.lora_B.weight"] = torch.stack(b_gu, dim=2).reshape(b_gu[0].shape[0], -1)
        out[f"{prefix}lora_A.weight"] = torch.cat(a_d, dim=0)
        out[f"{prefix}lora_B.weight"] = torch.stack(b_d, dim=2).reshape(b_d[0].shape[0], -1)
    return out


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup (`peft.utils.other.get_pattern_key`): the first key K with
    `(.*\\.)?(K)$` matching `name`."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _fused_targets(cfg: dict[str, Any]) -> list[str]:
    """Which of FUSED_EXPERT_PARAMS `target_parameters` names, in nesting order (innermost first)."""
    names = list(cfg.get("target_parameters") or [])
    return [p for p in FUSED_EXPERT_PARAMS
            if any(t == p or t.endswith(f".{p}") for t in names if "experts" in t or t == p)]


def unfuse_expert_adapters(weights: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """PEFT's fused expert tensors (`experts.[base_layer.]lora_{A,B}.weight`) -> one rank-r adapter per expert and
    projection (module naming); other tensors unchanged. Exact for our export (gate_up rank 2r, block-diagonal B)
    and for PEFT's own rank-r gate_up (A shared by gate and up). B's are rescaled where the fused parameter's
    scale (rank_pattern / alpha_pattern) differs from the adapter's (`adapter_scale(cfg)`) -- by 1.0 for both."""
    r = int(cfg["r"])
    targeted = _fused_targets(cfg)
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in weights.items():
        m = _FUSED_KEY.match(key)
        if m is None:
            out[key] = value
        else:
            depth = m.group(2).count("base_layer.")
            layers.setdefault(int(m.group(1)), {}).setdefault(depth, {})[m.group(3)] = value
    if layers and not targeted:
        raise ValueError(f"fused expert adapters (e.g. layer {min(layers)}) but target_parameters="
                         f"{cfg.get('target_parameters')!r} names neither of {FUSED_EXPERT_PARAMS}")
    base_scale = adapter_scale(cfg)
    for layer, by_depth in sorted(layers.items()):
        if sorted(by_depth) != list(range(len(targeted))):
            raise ValueError(f"layer {layer}: fused expert adapters at wrapper depths {sorted(by_depth)}, expected "
                             f"one per targeted parameter {targeted}")
        for depth, factors in by_depth.items():
            param = targeted[len(targeted) - 1 - depth]  # the outermost wrapper (depth 0) is the last targeted
            if set(factors) != {"A", "B"}:
                raise ValueError(f"layer {layer} experts.{param}: lora_{sorted(factors)} only, expected A and B")
            name = f"model.layers.{layer}.mlp.experts.{param}"
            rank = int(_pattern_value(cfg.get("rank_pattern"), name, r))
            alpha = float(_pattern_value(cfg.get("alpha_pattern"), name, cfg["lora_alpha"]))
            scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
            a, b = factors["A"], factors["B"]
            if a.shape[0] % rank or b.shape[1] != a.shape[0]:
                raise ValueError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not hold rank {rank} "
                                 "per expert")
            num = a.shape[0] // rank
            prefix = f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts."
            for e in range(num):
                a_e = a[e * rank:(e + 1) * rank]
                b_e = b[:, e::num] if scale == base_scale else b[:, e::num] * (scale / base_scale)
                if param == "down_proj":
                    if rank != r:
                        raise ValueError(f"{name}: rank {rank}, the adapter's r is {r}")
                    pieces = {"down_proj": (a_e, b_e)}
                else:
                    ffn = b_e.shape[0] // 2
                    if rank == r:  # PEFT's own form: one A for gate and up
                        pieces = {"gate_proj": (a_e, b_e[:ffn]), "up_proj": (a_e, b_e[ffn:])}
                    elif rank == 2 * r:  # ours (and PEFT's conversion of per-expert adapters): block-diagonal B
                        off = max(float(b_e[:ffn, r:].abs().max()), float(b_e[ffn:, :r].abs().max()))
                        if off != 0.0:
                            raise ValueError(f"{name}: a rank-{rank} gate_up adapter whose B is not block-diagonal "
                                             f"(off-diagonal up to {off:g}) is not two rank-{r} adapters; the learner "
                                             f"holds rank {r} per projection")
                        pieces = {"gate_proj": (a_e[:r], b_e[:ffn, :r]), "up_proj": (a_e[r:], b_e[ffn:, r:])}
                    else:
                        raise ValueError(f"{name}: rank {rank} per expert, expected r={r} or 2r={2 * r}")
                for proj, (pa, pb) in pieces.items():
                    out[f"{prefix}{e}.{proj}.lora_A.weight"] = pa.contiguous()
                    out[f"{prefix}{e}.{proj}.lora_B.weight"] = pb.contiguous()
    return out


# --------------------------------------------------------------------------- directories


def write_peft_adapter(directory: str | Path, state: dict[str, torch.Tensor], spec: MoEModelSpec,
                       config: LoraConfig, *, base_model: str | None = None, experts: str = "auto") -> Path:
    """Write `state` (the learner's PEFT module naming, whole tensors) as a PEFT adapter directory, routed experts
    in the form `experts` names ("auto", "fused", "per_expert"; see the module docstring); staged and renamed into
    place."""
    from safetensors.torch import save_file

    form = resolve_experts_form(experts, spec)
    modules = [hf_module(hf) for m in adapter_sites(spec, config).values() for hf in m.hf]
    target_parameters: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    if form == "fused":
        mlp = [m for m in modules if ".mlp." in m]
        if any(_EXPERT_MODULE.match(m) for m in mlp):
            target_parameters += [f"mlp.experts.{p}" for p in FUSED_EXPERT_PARAMS]
            rank_pattern[GATE_UP_RANK_KEY] = 2 * config.rank
            alpha_pattern[GATE_UP_RANK_KEY] = 2 * config.alpha
        target_parameters += [f"{m}.weight" for m in mlp if not _EXPERT_MODULE.match(m)]
        modules = [m for m in modules if ".mlp." not in m]
        state = fuse_expert_adapters(state)
    target = Path(directory)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank, "lora_alpha": config.alpha,
        "lora_dropout": config.dropout if form == "per_expert" else 0.0,
        "target_modules": target_modules_regex(spec, config, modules) if modules else [],
        "target_parameters": target_parameters or None, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern, "base_model_name_or_path": base_model, "inference_mode": True,
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
    fused = [f"model.layers.0.mlp.experts.{p}" for p in FUSED_EXPERT_PARAMS]
    for key in ("rank_pattern", "alpha_pattern"):
        # only the fused experts' parameters may have their own rank / alpha (unfuse_expert_adapters reads them)
        other = [k for k in (cfg.get(key) or {}) if not any(re.match(rf"(.*\.)?({k})$", n) for n in fused)]
        if other:
            raise ValueError(f"{path}: {key} for {other!r}: per-module ranks or alphas are not supported (only for "
                             f"the fused experts' {FUSED_EXPERT_PARAMS})")
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
    """The adapter tensors as stored, with PEFT's adapter name (`.default`) dropped from the keys where a saver
    kept it."""
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_WEIGHTS}")
    return {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
            for k, v in load_file(str(path)).items()}


def read_adapter_modules(directory: str | Path) -> tuple[dict[str, torch.Tensor], float]:
    """An adapter in either form as (one rank-r adapter per HF module in PEFT's module naming -- the learner's --,
    the scale of every B @ A)."""
    cfg = read_adapter_config(directory)
    return unfuse_expert_adapters(read_adapter_weights(directory), cfg), adapter_scale(cfg)


def read_peft_adapter(directory: str | Path, config: LoraConfig) -> dict[str, torch.Tensor]:
    """A PEFT adapter's tensors (either form) for a learner with `config`: its r and scale must equal the learner's."""
    cfg = read_adapter_config(directory)
    if int(cfg["r"]) != config.rank:
        raise ValueError(f"{directory}: the adapter has r={cfg['r']}, lora.rank={config.rank}; set lora.rank={cfg['r']}")
    if not math.isclose(adapter_scale(cfg), config.scale, rel_tol=1e-6):
        raise ValueError(f"{directory}: the adapter scales B@A by {adapter_scale(cfg):g} (lora_alpha={cfg['lora_alpha']}"
                         f"{', rsLoRA' if cfg.get('use_rslora') else ''}), the learner by lora.alpha/lora.rank="
                         f"{config.scale:g}; set lora.alpha={cfg['lora_alpha']}")
    return unfuse_expert_adapters(read_adapter_weights(directory), cfg)


def export_learner_adapter(learner: Any, directory: str | Path, *, base_model: str | None = None) -> None:
    """Collective over the learner's ranks: write `learner`'s (a `MegatronLearner`) adapters as a PEFT adapter
    directory (`adapter_config.json` + `adapter_model.safetensors`, HF module names, the "auto" form); rank 0
    writes, every rank returns once it is written."""
    state = learner.adapter_state()
    if torch.distributed.get_rank() == 0:
        write_peft_adapter(directory, state, learner.spec, learner.lora, base_model=base_model)
    torch.distributed.barrier()


def load_learner_adapter(learner: Any, directory: str | Path) -> None:
    """Set `learner`'s (a `MegatronLearner`) adapters from a PEFT adapter directory (either form; its rank and
    scale must equal the learner's `lora`); every rank reads it and takes its shard."""
    if not learner.lora.enabled:
        raise ValueError(f"init.adapter={str(directory)!r} needs lora.rank > 0 (this learner has no adapters)")
    learner.set_adapter_state(read_peft_adapter(directory, learner.lora))


def merge_adapter_checkpoint(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write `base_dir` (an HF safetensors checkpoint) with the PEFT adapter at `adapter_dir` folded into its weights
    (`W + scale * B @ A`) to `out_dir` (must not exist), one safetensors file of the base at a time; config,
    tokenizer and other files are copied. Returns {"merged": modules changed, "tensors": tensors written}."""
    target = Path(out_dir)
    if target.exists():
        raise FileExistsError(f"{target} exists; choose a new destination")
    adapter, scale = read_adapter_modules(adapter_dir)  # either form; fused experts as per-expert modules
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
