"""What the run that exported a policy was trained with, against an evaluation's own settings.

`python -m moe_grpo.evaluate` reads the policy directory only and starts from its own defaults, so an evaluation of
a `task=gsm8k` run's policy without `task=gsm8k` scores it with the toy tasks' reward and reports 0 without a word
(a user's trial, 2026-11-28). A run's `policy/` sits in its run directory, whose `config.yaml` names what it trained
with: the settings that decide a score and differ are named (a warning, and `evaluation.json`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

COMPARED = ("task.name", "reward.fn", "reward.weights", "rollout.max_tokens")
"""The settings that decide a held-out score. The data keys only count where both score a dataset."""
DATA_KEYS = ("data.prompt_key", "data.answer_key")


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return list(tree) if isinstance(tree, (list, tuple)) else tree


def run_config_of(policy: str | Path) -> Path | None:
    """The config.yaml of the run that exported `policy` (a run directory's `policy/`), or None."""
    path = Path(policy).resolve().parent / "config.yaml"
    return path if path.is_file() and (Path(policy).resolve().parent / "metrics.jsonl").exists() else None


def differences_from_the_run(evaluation: dict[str, Any], policy: str | Path) -> list[str]:
    """`key: the run's X, here Y` for each setting that decides a score and differs; [] when the policy is no run's
    or everything matches. `evaluation`: the evaluation's settings as a plain tree (dataclasses.asdict)."""
    path = run_config_of(policy)
    if path is None:
        return []
    try:
        run = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    keys = COMPARED + (DATA_KEYS if _get(run, "data.eval_path") and _get(evaluation, "data.eval_path") else ())
    return [f"{key}: the run's {_get(run, key)!r}, here {_get(evaluation, key)!r}" for key in keys
            if _get(run, key) != _get(evaluation, key)]
