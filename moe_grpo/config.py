"""Hydra YAML -> frozen dataclasses, converted once at the entry point.

Defaults live in the dataclasses (`LearnerConfig`, `ParallelLayout`,
`MegatronOptions`, `RunConfig`), next to the code that uses them;
`defaults_tree()` turns them into the base
Hydra node, so `conf/config.yaml` only picks the model and nothing is
written twice. `from_hydra()` rejects unknown keys and bad values by name.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import yaml

from moe_grpo import validate
from moe_grpo.algo.config import AlgoConfig
from moe_grpo.checkpoint.hf_init import InitConfig
from moe_grpo.data.config import DataConfig
from moe_grpo.data.tasks import DATASET_TASKS, TaskConfig
from moe_grpo.learner.config import LearnerConfig
from moe_grpo.learner.lora_config import LoraConfig
from moe_grpo.learner.parallel import ParallelLayout
from moe_grpo.models.options import MegatronOptions
from moe_grpo.models.spec import MoEModelSpec, spec_from_mapping
from moe_grpo.orchestrator.config import CheckpointConfig, ClusterConfig, LoggerConfig, RolloutConfig
from moe_grpo.reward.config import RewardConfig
from moe_grpo.rollout.lora_serving import max_lora_rank
from moe_grpo.routing.config import RoutingConfig
from moe_grpo.sync.config import SyncConfig
from moe_grpo.validate import at_least

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
WARM_START_FROM_RANDOM = 100
"""The warm start of a built-in task's randomly initialised model when `warm_start_steps` is unset: 100 take about
10 s on 2 cores for the default model; with 50 the default run's start, and its end, varied more by seed."""


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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (learner/lora.py); `lora.rank: 0` (default) is off."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """The RL algorithm: group size, batch, clipping, corrections, staleness (algo/config.py)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """How the engines sample (orchestrator/config.py)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Ray, engines, learner ranks and their resources (orchestrator/config.py)."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """How published weight versions reach the engines: the transport, the buffers' root (sync/config.py)."""
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
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Experiment trackers besides TensorBoard: W&B, MLflow (orchestrator/config.py)."""
    steps: int = 300
    """Optimizer steps the run takes."""
    mode: str = "async"
    """'async': engines generate while the learner trains; 'sync': generate, train, sync in turn (the baseline)."""
    warm_start_steps: int | None = None
    """Supervised steps on the task's answers before RL, to teach a randomly initialised model the answer format
    (part of the run; needs each row's answer, `data.answer_key`). Unset: `WARM_START_FROM_RANDOM` on a built-in
    task's model with random weights, 0 where the prompts come from a dataset or the model from a checkpoint
    (`init.hf`): a pretrained model is not fine-tuned on a dataset's reference answers unless asked (`warm_start` is
    the number the run takes)."""
    eval_every: int = 25
    """Score the held-out set greedily every this many steps (and at step 0 and the last step); 0 = never."""
    resume: bool = False
    """Continue from the newest complete checkpoint in the run directory (`hydra.run.dir=<the run's directory>`);
    the run's config must match the checkpoint's except for `steps` (with a decaying learning rate, another `steps`
    needs `learner.lr_decay_steps`), timeouts and the learner layout. Where the directory records steps but no
    checkpoint verifies, the run stops."""

    def __post_init__(self) -> None:
        if self.routing.replay != "off" and not self.megatron.routing_replay:
            raise ValueError(f"routing.replay={self.routing.replay} needs megatron.routing_replay=True (no RouterReplay "
                             "hooks would be built); use routing.replay=off to train without replay")
        at_least("steps", self.steps, 1)
        if self.init.adapter is not None and not self.lora.enabled:
            raise ValueError(f"init.adapter={self.init.adapter!r} needs lora.rank > 0 (the adapter's r) and lora.alpha "
                             "(its lora_alpha)")
        if self.lora.enabled and self.sync.transport == "cuda_ipc":
            raise ValueError(f"lora.rank={self.lora.rank} with sync.transport=cuda_ipc: adapter-only versions go "
                             "through shared memory or the relay (sync.transport=auto, shm or relay); the CUDA IPC "
                             "buffers hold one plan for every version")
        if self.lora.enabled and self.sync.delta:
            raise ValueError(f"sync.delta=true with lora.rank={self.lora.rank}: a LoRA run's versions after the first "
                             "are its adapters only already; set sync.delta=false")
        if (self.lora.enabled and "attention" in self.lora.targets and self.model.uses_mla
                and self.parallel.tensor_parallel > 1):  # refused here rather than when the learner builds
            raise ValueError(f"lora.targets with 'attention' on an MLA model ({self.model.name}) needs "
                             f"parallel.tensor_parallel=1, got {self.parallel.tensor_parallel} (its replicated down "
                             "projections are not handled): drop 'attention' from lora.targets or use TP=1")
        if self.lora.enabled and self.sync.lora_apply == "serve":
            max_lora_rank(self.lora.rank)  # vLLM's limit, refused here rather than when the engines start
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
        if self.warm_start_steps is not None:
            at_least("warm_start_steps", self.warm_start_steps, 0)
        at_least("eval_every", self.eval_every, 0, "(0 = never)")

    @property
    def warm_start(self) -> int:
        """The supervised steps this run takes before RL (`warm_start_steps`, or its default where unset)."""
        if self.warm_start_steps is not None:
            return self.warm_start_steps
        from_random = not (self.data.train_path or self.init.hf)  # (init.megatron comes with init.hf)
        return WARM_START_FROM_RANDOM if from_random else 0

    def learner_world_size(self) -> int:
        return self.cluster.learner_ranks or self.parallel.world_size()

    @property
    def seed(self) -> int:
        return self.learner.seed

    def learner_config(self) -> Any:
        return self.learner

    def megatron_options(self) -> Any:
        return self.megatron


_SECTIONS = {"parallel": ParallelLayout, "learner": LearnerConfig, "megatron": MegatronOptions, "lora": LoraConfig,
             "algo": AlgoConfig,
             "rollout": RolloutConfig, "cluster": ClusterConfig, "sync": SyncConfig, "task": TaskConfig, "data": DataConfig,
             "reward": RewardConfig, "init": InitConfig, "routing": RoutingConfig,
             "checkpoint": CheckpointConfig, "logger": LoggerConfig}

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
    return cls(**checked_types(cls, values, f"{name}."))


_EXPECTED = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


def checked_types(cls: type, values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`values` for the dataclass `cls`, each checked against its field's type hint: an int field takes integers
    (2.0 becomes 2; 2.5, true and 'abc' are refused), a float field finite numbers, a bool field true/false, a str
    field strings, `X | None` also null, a tuple each element. Raises ValueError naming `<prefix><key>`, the value
    and what was expected, before the dataclass (whose range checks assume the types) sees it."""
    hints = typing.get_type_hints(cls)
    return {key: _checked(f"{prefix}{key}", value, hints[key]) if key in hints else value
            for key, value in values.items()}


def _checked(key: str, value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _checked(key, value, option)
            except ValueError as e:
                errors.append(str(e).split(": expected ", 1)[-1])
        raise ValueError(f"{key}={value!r}: expected {' or '.join(errors)}"
                         + (" or null" if type(None) in args else ""))
    if origin is tuple:
        items = value if isinstance(value, (list, tuple)) else [value]  # one value is a list of one
        element = args[0] if args else Any
        return tuple(_checked(f"{key}[{i}]", v, element) for i, v in enumerate(items)) if isinstance(
            value, (list, tuple)) else _checked(key, value, element)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and isinstance(value, Mapping):
        return checked_types(hint, value, f"{key}.")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        return value  # Any, or a type the section checks itself
    raise ValueError(f"{key}={value!r}: expected {_EXPECTED[hint]}")


def command_line_keys() -> dict[str, Any]:
    """What a training command line may set: each section's fields (the model's too; a section's own sections,
    `logger.wandb`), and the plain fields."""
    keys: dict[str, Any] = {name: validate.dataclass_keys(cls) for name, cls in _SECTIONS.items()}
    keys["model"] = {f.name for f in fields(MoEModelSpec)} | {"hf_path"}
    keys.update({f.name: None for f in fields(RunConfig) if f.name not in keys})
    return keys


def unknown_key(key: str) -> str | None:
    """Why the training command line's `key` names nothing a run reads, or None (validate.unknown_key over
    `command_line_keys`; keys of older configs get their replacement). Hydra refuses such a key too, after this
    check, in a several-line message with exit status 1."""
    return validate.unknown_key(key, command_line_keys(), _RENAMED)


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
        kwargs["model"] = spec_from_mapping(checked_types(MoEModelSpec, model, "model."))
    top_level = {f.name: tree[f.name] for f in fields(RunConfig) if f.name not in kwargs and f.name in tree}
    kwargs.update(checked_types(RunConfig, top_level))
    return RunConfig(**kwargs)


def load_model_spec(name: str) -> MoEModelSpec:
    """The model description `conf/model/<name>.yaml`, without going through Hydra."""
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise FileNotFoundError(f"no model config {name!r} at {path}; expected one of {known}")
    with open(path) as f:
        return spec_from_mapping(yaml.safe_load(f))
