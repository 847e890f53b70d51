"""Hydra YAML -> frozen dataclasses, converted once at the entry point.

Defaults live in the dataclasses (`LearnerConfig`, `ParallelLayout`,
`MegatronOptions`, `RunConfig`), next to the code that uses them;
`defaults_tree()` turns them into the base
Hydra node, so `conf/config.yaml` only picks the model and nothing is
written twice. `from_hydra()` rejects unknown keys and bad values by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from moe_grpo.algo.config import AlgoConfig
from moe_grpo.checkpoint.hf_init import InitConfig
from moe_grpo.data.config import DataConfig
from moe_grpo.data.tasks import DATASET_TASKS, TaskConfig
from moe_grpo.learner.config import LearnerConfig
from moe_grpo.learner.parallel import ParallelLayout
from moe_grpo.models.options import MegatronOptions
from moe_grpo.models.spec import MoEModelSpec, spec_from_mapping
from moe_grpo.orchestrator.config import CheckpointConfig, ClusterConfig, RolloutConfig
from moe_grpo.reward.config import RewardConfig
from moe_grpo.routing.config import RoutingConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass(frozen=True)
class RunConfig:
    """Everything `python -m moe_grpo.train` runs with."""

    model: MoEModelSpec
    """The model description (conf/model/<name>.yaml; with `init.hf` set, the checkpoint's config.json)."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """Learner process layout."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Optimisation, batching and the seed (learner/megatron_learner.py)."""
    megatron: MegatronOptions = field(default_factory=MegatronOptions)
    """How the Megatron model is built (models/megatron.py)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL algorithm: group size, batch, clipping, corrections, staleness (algo/config.py)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How the engines sample (orchestrator/config.py)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray, engines, learner ranks and their resources (orchestrator/config.py)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The built-in task and its held-out set (data/tasks.py)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Local dataset files instead of the task's generated prompts (data/config.py)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions by dotted path, weights, timeout (reward/config.py)."""
    init: InitConfig = field(default_factory=InitConfig)
    """Start from a Hugging Face checkpoint (checkpoint/hf_init.py)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """Routing replay mode (r3 / r2 / off) and the jump warning (routing/config.py)."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Run checkpoints: how often, how many kept (orchestrator/config.py)."""
    steps: int = 300
    """Optimizer steps the run takes."""
    mode: str = "async"
    """'async': engines generate while the learner trains; 'sync': generate, train, sync in turn (the baseline)."""
    warm_start_steps: int = 50
    """Supervised steps on task examples before RL, mostly to teach the answer format; part of the run."""
    eval_every: int = 25
    """Score the held-out set greedily every this many steps (and at step 0 and the last step); 0 = never."""
    resume: bool = False
    """Continue from the newest complete checkpoint in the run directory (`hydra.run.dir=<the run's directory>`);
    the run's config must match the checkpoint's except for `steps`, timeouts and the learner layout."""

    def __post_init__(self) -> None:
        if self.routing.replay != "off" and not self.megatron.routing_replay:
            raise ValueError(f"routing.replay={self.routing.replay} needs megatron.routing_replay=True (no RouterReplay "
                             "hooks would be built); use routing.replay=off to train without replay")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}, expected >= 1")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode={self.mode!r}, expected 'async' or 'sync'")
        if self.mode == "async" and self.algo.max_staleness < self.algo.sync_every:
            raise ValueError(
                f"mode=async with algo.max_staleness={self.algo.max_staleness} < algo.sync_every={self.algo.sync_every}: "
                "a batch is sampled before the weights it trains are published, so async needs max_staleness >= "
                "sync_every (or use mode=sync)")
        if self.mode == "sync" and self.algo.max_staleness < self.algo.sync_every - 1:
            raise ValueError(f"mode=sync with algo.sync_every={self.algo.sync_every} samples up to "
                             f"{self.algo.sync_every - 1} versions behind; algo.max_staleness={self.algo.max_staleness} "
                             "would drop them all")
        if self.task.name in DATASET_TASKS and not self.data.train_path:
            raise ValueError(f"task.name={self.task.name!r} reads its prompts from a dataset; set data.train_path "
                             "(a .jsonl or .parquet file in its format)")
        if self.data.eval_path is not None and self.data.train_path is None:  # `evaluate` takes eval_path alone
            raise ValueError(f"data.eval_path={self.data.eval_path!r} without data.train_path: held-out rows need "
                             "training rows of the same format")
        if self.warm_start_steps < 0 or self.eval_every < 0:
            raise ValueError(f"warm_start_steps={self.warm_start_steps}, eval_every={self.eval_every}: expected >= 0")

    def learner_world_size(self) -> int:
        return self.cluster.learner_ranks or self.parallel.world_size()

    @property
    def seed(self) -> int:
        return self.learner.seed

    def learner_config(self) -> Any:
        return self.learner

    def megatron_options(self) -> Any:
        return self.megatron


_SECTIONS = {"parallel": ParallelLayout, "learner": LearnerConfig, "megatron": MegatronOptions, "algo": AlgoConfig,
             "rollout": RolloutConfig, "cluster": ClusterConfig, "task": TaskConfig, "data": DataConfig,
             "reward": RewardConfig, "init": InitConfig, "routing": RoutingConfig,
             "checkpoint": CheckpointConfig}

_RENAMED = {
    "replay": "replay= was replaced by routing.replay=r3|r2|off (replay=true is r3, replay=false is off)",
    "algo.tis_clip": "algo.tis_clip was replaced by algo.correction=tis algo.correction_high=<cap> "
                     "(tis_clip=0 is algo.correction=none)",
}
"""Keys of older configs -> what to write instead."""


def _field_defaults(cls: type) -> dict[str, Any]:
    """A section's declared defaults (not the values its __post_init__ fills in: `algo` fields left None take the
    chosen loss's preset, which the command line may change)."""
    out: dict[str, Any] = {}
    for f in fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def defaults_tree() -> dict[str, Any]:
    """The dataclass defaults as a plain tree: Hydra's base config."""
    tree: dict[str, Any] = {name: _plain(_field_defaults(cls)) for name, cls in _SECTIONS.items()}
    for f in fields(RunConfig):
        if f.name not in _SECTIONS and f.name != "model":
            tree[f.name] = f.default
    return tree


def _plain(tree: dict[str, Any]) -> dict[str, Any]:
    """Tuples as lists: OmegaConf stores lists (`reward.fn=[a:f,b:g]` on the command line)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in tree.items()}


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
    for key, hint in _RENAMED.items():
        section, _, name = key.rpartition(".")
        if name in (tree.get(section) or {} if section else tree):
            raise ValueError(hint)
    top = {f.name for f in fields(RunConfig)}
    unknown = sorted(set(tree) - top - {"hydra"})
    if unknown:
        raise ValueError(f"unknown top-level key(s) {unknown}; expected a subset of {sorted(top)}")
    model = dict(tree.get("model") or {})
    init = dict(tree.get("init") or {})
    if model.get("hf_path") and not init.get("hf"):  # the older spelling of init.hf
        init["hf"] = model["hf_path"]
    tree["init"] = init
    kwargs: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        kwargs[name] = _section(cls, name, tree.get(name))
    if kwargs["init"].hf:  # the checkpoint describes its model
        kwargs["model"] = kwargs["init"].model_spec()
    elif not model:
        raise ValueError("no model chosen; pass model=<name> (one of conf/model/*.yaml) or init.hf=DIR")
    else:
        kwargs["model"] = spec_from_mapping(model)
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
