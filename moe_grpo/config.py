"""Hydra YAML -> frozen dataclasses, converted once at the entry point.

Defaults live in the dataclasses (`LearnerConfig`, `ParallelLayout`,
`MegatronOptions`, `RunConfig`); `defaults_tree()` turns them into the base
Hydra node, so `conf/config.yaml` only picks the model and nothing is
written twice. `from_hydra()` rejects unknown keys and bad values by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from moe_grpo.learner.parallel import ParallelLayout
from moe_grpo.models.spec import MoEModelSpec, spec_from_mapping

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass(frozen=True)
class LearnerSettings:
    """Optimisation and batching (mirrors learner.megatron_learner.LearnerConfig)."""

    lr: float = 1e-5
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = 4
    """Sequences per microbatch."""
    packed: bool = False
    """Pack sequences into rows behind a block-diagonal mask instead of padding."""
    clip_eps: float = 0.2
    """PPO/GRPO ratio clip."""


@dataclass(frozen=True)
class MegatronSettings:
    """How the Megatron model is built (not its shape)."""

    params_dtype: str = "float32"
    """'float32' (CPU) or 'bfloat16' (GPU clusters)."""
    recompute: bool = False
    """Full activation recompute; replay then also covers the recomputed forward."""
    token_dispatcher: str = "alltoall"
    """'alltoall' or 'allgather' (gloo needs allgather for TP x EP)."""
    aux_loss_coeff: float = 0.0
    """Sequence-level load-balancing loss coefficient; 0 disables it."""

    def __post_init__(self) -> None:
        if self.params_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"megatron.params_dtype={self.params_dtype!r}, expected 'float32' or 'bfloat16'")
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"megatron.token_dispatcher={self.token_dispatcher!r}, expected 'alltoall' or 'allgather'")
        if self.aux_loss_coeff < 0:
            raise ValueError(f"megatron.aux_loss_coeff={self.aux_loss_coeff}, expected >= 0")


@dataclass(frozen=True)
class RunConfig:
    """Everything `python -m moe_grpo.train` runs with."""

    model: MoEModelSpec
    """The model description (conf/model/<name>.yaml)."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """Learner process layout."""
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    """Optimisation and batching."""
    megatron: MegatronSettings = field(default_factory=MegatronSettings)
    """Megatron build switches."""
    replay: bool = True
    """Replay rollout routing in the learner (R3)."""
    seed: int = 1234
    """Seed for weight init and sampling."""

    def learner_config(self) -> Any:
        from moe_grpo.learner.megatron_learner import LearnerConfig

        return LearnerConfig(seed=self.seed, **dataclasses.asdict(self.learner))

    def megatron_options(self) -> Any:
        import torch

        from moe_grpo.models.megatron import MegatronOptions

        m = self.megatron
        return MegatronOptions(params_dtype=getattr(torch, m.params_dtype), routing_replay=True,
                               recompute=m.recompute, token_dispatcher=m.token_dispatcher,
                               aux_loss_coeff=m.aux_loss_coeff)


_SECTIONS = {"parallel": ParallelLayout, "learner": LearnerSettings, "megatron": MegatronSettings}


def defaults_tree() -> dict[str, Any]:
    """The dataclass defaults as a plain tree: Hydra's base config."""
    tree: dict[str, Any] = {name: dataclasses.asdict(cls()) for name, cls in _SECTIONS.items()}
    for f in fields(RunConfig):
        if f.name not in _SECTIONS and f.name != "model":
            tree[f.name] = f.default
    return tree


def _section(cls: type, name: str, values: Mapping[str, Any] | None) -> Any:
    values = dict(values or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {name}; expected a subset of {sorted(known)}")
    return cls(**values)


def from_hydra(cfg: Any) -> RunConfig:
    """Convert a composed Hydra/OmegaConf config (or a plain dict) into a RunConfig."""
    try:
        from omegaconf import OmegaConf

        tree = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else cfg
    except ImportError:  # pragma: no cover
        tree = dict(cfg)
    tree = dict(tree)
    top = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(tree) - top - {"hydra"})
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}; expected a subset of {sorted(top)}")
    if "model" not in tree:
        raise ValueError("no model chosen; pass model=<name> (one of conf/model/*.yaml)")
    kwargs: dict[str, Any] = {"model": spec_from_mapping(tree["model"])}
    for name, cls in _SECTIONS.items():
        kwargs[name] = _section(cls, name, tree.get(name))
    for f in fields(RunConfig):
        if f.name not in kwargs and f.name in tree:
            kwargs[f.name] = tree[f.name]
    return RunConfig(**kwargs)


def load_model_spec(name: str) -> MoEModelSpec:
    """The model description `conf/model/<name>.yaml`, without going through Hydra."""
    import yaml

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise FileNotFoundError(f"no model config {name!r} at {path}; expected one of {known}")
    with open(path) as f:
        return spec_from_mapping(yaml.safe_load(f))
