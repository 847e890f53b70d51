"""What `python -m moe_grpo.evaluate` runs with (conf/evaluate.yaml over `EvaluateConfig`, registered as
`evaluate_defaults`). The sections it shares with a training run (`task`, `data`, `reward`, `rollout`) are the same
dataclasses, so a run's overrides mean the same thing here."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from moe_grpo import validate
from moe_grpo.config import _field_defaults, _plain, _section, checked_types
from moe_grpo.data.config import DataConfig
from moe_grpo.data.tasks import DATASET_TASKS, TaskConfig
from moe_grpo.orchestrator.config import RolloutConfig
from moe_grpo.reward.config import RewardConfig


@dataclass(frozen=True)
class EvaluateConfig:
    """A policy, a dataset, and how to sample and score it."""

    policy: str | None = None
    """The policy to score: a run's exported `policy/` directory, or any Hugging Face checkpoint directory `init.hf`
    takes (config.json, safetensors weights, tokenizer files)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The built-in task: its held-out set is scored when `data.eval_path` is not set, and its reward by default."""
    data: DataConfig = field(default_factory=DataConfig)
    """`data.eval_path`: a JSONL / Parquet file to score instead (with `prompt_key`, `answer_key`, `eval_size` as in a
    training run)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions, as in a training run (empty = the task's own)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Engine and sampling: `max_tokens`, `temperature` / `top_p` of the pass@k samples, `dtype`, `max_model_len`,
    `max_num_seqs`, `kv_cache_gib`, `request_timeout_s` (the training-only keys are not used)."""
    samples: int = 8
    """Completions sampled per prompt at `rollout.temperature` for pass@k (n of the estimator); 0 = greedy only."""
    pass_k: tuple[int, ...] = (1, 4, 8)
    """The k of each pass@k reported; each at most `samples`."""
    correct_at: float = 1.0
    """A completion counts as correct (accuracy, pass@k) when its reward is at least this; the built-in tasks and the
    math reward give 1.0 only for a right answer."""
    seed: int = 0
    """Sampling seed: sample j of prompt i draws from `seed + i * samples + j`, so a rerun gives the same samples."""
    output: str | None = None
    """Directory for `evaluation.json` (the summary) and `evaluation_rows.jsonl` (one line per prompt); None = the
    Hydra run directory (outputs/evaluate/<date>/<time>)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pass_k", tuple(int(k) for k in self.pass_k))
        if not self.policy:
            raise ValueError("policy is not set; expected policy=DIR, a run's policy/ directory or a Hugging Face "
                             "checkpoint directory")
        if not (Path(self.policy) / "config.json").is_file():
            raise ValueError(f"policy={self.policy!r}: expected a model directory with a config.json (a run's "
                             "policy/ or a Hugging Face checkpoint)")
        if self.data.train_path:
            raise ValueError(f"data.train_path={self.data.train_path!r}: evaluate does not read training rows; set "
                             "data.eval_path to the file to score")
        if self.task.name in DATASET_TASKS and not self.data.eval_path:
            raise ValueError(f"task.name={self.task.name!r} has no built-in held-out set; set data.eval_path")
        if self.samples < 0:
            raise ValueError(f"samples={self.samples}, expected >= 0 (0 = greedy only)")
        if self.samples and any(not 1 <= k <= self.samples for k in self.pass_k):
            raise ValueError(f"pass_k={list(self.pass_k)} with samples={self.samples}: expected 1 <= k <= samples "
                             "for every k (the estimator needs at least k samples)")


def defaults_tree() -> dict[str, Any]:
    """The dataclass defaults as Hydra's base config."""
    tree: dict[str, Any] = {}
    for f in fields(EvaluateConfig):
        if f.name in _SECTIONS:
            tree[f.name] = _plain(_field_defaults(_SECTIONS[f.name]))
        else:
            tree[f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
    return tree


def unknown_key(key: str) -> str | None:
    """Why the evaluation command line's `key` names nothing `EvaluateConfig` reads, or None."""
    keys: dict[str, Any] = {f.name: None for f in fields(EvaluateConfig)}
    keys.update({name: validate.dataclass_keys(cls) for name, cls in _SECTIONS.items()})
    return validate.unknown_key(key, keys)


def from_hydra(cfg: Any) -> EvaluateConfig:
    """Convert the composed config (or a plain dict) into an `EvaluateConfig`; unknown keys are refused by name."""
    tree = cfg if isinstance(cfg, dict) else _container(cfg)
    top = {f.name for f in fields(EvaluateConfig)}
    unknown = sorted(set(tree) - top - {"hydra"})
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; expected a subset of {sorted(top)}")
    kwargs = {name: _section(cls, name, tree.get(name)) for name, cls in _SECTIONS.items()}
    kwargs.update(checked_types(EvaluateConfig, {k: v for k, v in tree.items() if k in top and k not in _SECTIONS}))
    return EvaluateConfig(**kwargs)


def _container(cfg: Any) -> dict[str, Any]:
    return dict(OmegaConf.to_container(cfg, resolve=True))


_SECTIONS = {"task": TaskConfig, "data": DataConfig, "reward": RewardConfig, "rollout": RolloutConfig}
