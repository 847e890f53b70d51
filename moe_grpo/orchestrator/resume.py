"""A resumed run: the checkpoint it continues from, and what it must share with it (`resume=true`)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_grpo.data.prompts import PromptSource
from moe_grpo.orchestrator import run_checkpoint
from moe_grpo.orchestrator.run_checkpoint import ResumeRefused
from moe_grpo.orchestrator.state import RunState

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig

log = logging.getLogger("moe_grpo")

RESUME_MUST_MATCH = ("model", "algo", "task", "data", "reward.fn", "reward.weights", "mode", "routing.replay",
                     "rollout.max_tokens", "rollout.temperature", "rollout.top_p", "learner.seed", "init", "learner.lr",
                     "learner.lr_warmup_steps", "learner.lr_decay", "learner.min_lr")
"""Config a resumed run must share with its checkpoint (what the saved buffer, prompts and optimizer mean, and the
learning-rate schedule the saved steps followed; its length, `learner.lr_decay_steps`, by `check_schedule`)."""


def check_resumable(run: RunConfig, saved_config: dict[str, Any], saved_schedule: dict[str, Any] | None = None) -> None:
    """Refuse a resume whose config changes what the checkpoint's buffer, prompts and optimizer mean, or the
    learning-rate schedule its steps followed (`saved_schedule`: the checkpoint's; older ones: from its config)."""
    now = dataclasses.asdict(run)
    changed = []
    for key in RESUME_MUST_MATCH:
        section, _, name = key.partition(".")
        a, b = now.get(section), saved_config.get(section)
        if name:
            a, b = (a or {}).get(name), (b or {}).get(name)
        if a != b:
            changed += _differences(key, a, b)
    if changed:
        raise ResumeRefused(f"resume=true: the config differs from the checkpoint's in {', '.join(changed)}; a "
                            f"resumed run must keep {list(RESUME_MUST_MATCH)} (steps (see learner.lr_decay_steps), "
                            "timeouts, cluster and the learner layout may change)")
    check_schedule(run, saved_schedule if saved_schedule is not None else _schedule_of(saved_config))


def _differences(key: str, now: Any, saved: Any) -> list[str]:
    """`key=<now> (checkpoint: <saved>)` for each leaf that differs below `key` (a section names its keys)."""
    if isinstance(now, dict) and isinstance(saved, dict):
        names = [n for n in dict.fromkeys([*now, *saved]) if now.get(n) != saved.get(n)]
        return [d for n in names for d in _differences(f"{key}.{n}", now.get(n), saved.get(n))]
    return [f"{key}={now!r} (checkpoint: {saved!r})"]


def _schedule_of(saved_config: dict[str, Any]) -> dict[str, Any]:
    """The schedule a checkpoint written before checkpoints saved theirs followed: over its run's `steps`."""
    learner = saved_config.get("learner") or {}
    decay_steps = learner.get("lr_decay_steps")
    return {**learner, "lr_decay_steps": decay_steps if decay_steps is not None else saved_config.get("steps")}


def check_schedule(run: RunConfig, saved: dict[str, Any]) -> None:
    """A resumed run's learning rate continues the checkpoint's schedule. Its length follows `steps` unless
    `learner.lr_decay_steps` is set, so a resume with another `steps` would change the learning rate of every step
    still to run (of a finished run: from `min_lr`, 0 by default, back up); that is refused unless the config says
    which schedule the run continues on."""
    cfg = run.learner
    want, now = saved.get("lr_decay_steps"), cfg.decay_steps(run.steps)
    if cfg.lr_decay == "constant" or want is None or now == want:
        return
    if cfg.lr_decay_steps is None:
        raise ResumeRefused(
            f"resume=true with steps={run.steps}: the checkpoint's learning rate decays ({cfg.lr_decay}) to "
            f"learner.min_lr={cfg.min_lr:g} at step {want}, this run's would at step {now}, which changes the learning "
            f"rate of every step still to run. Extending a run is a choice: learner.lr_decay_steps={want} keeps the "
            f"saved schedule (steps after {want} run at learner.min_lr), learner.lr_decay_steps={now} stretches it over "
            "the new steps (the learning rate rises to where that schedule stands)")
    log.warning("resume: learner.lr_decay_steps=%d, the checkpoint's schedule reached learner.min_lr at step %d: the "
                "learning rate follows the new schedule from here", now, want)


def resume_point(run: RunConfig, run_dir: str, state: RunState,
                 source: PromptSource | None = None) -> tuple[Path | None, dict[str, Any] | None]:
    """With `run.resume`, the newest checkpoint in `run_dir` and the driver's state saved there, checked against
    `run` (`check_resumable`) and against the prompts `source` (a dataset whose rows changed: refused here, before
    anything starts, where it was a traceback once the pools were up), its run state loaded into `state` (step and
    lr_scale, for the learner ranks' start); (None, None) for a fresh run. An earlier run's steps with no checkpoint to
    continue from are refused."""
    if not run.resume:
        return None, None
    found = run_checkpoint.resume_point(run_dir)
    if found is None:
        log.info("resume=true: %s holds no checkpoint and no recorded step; starting from the beginning", run_dir)
        return None, None
    resume_from = found[0]
    saved = run_checkpoint.load_driver_state(resume_from)
    check_resumable(run, saved["config"], saved.get("lr_schedule"))
    if source is not None and "source" in saved:
        try:
            source.check_resumable(saved["source"])
        except ValueError as e:
            raise ResumeRefused(f"resume=true from {resume_from}: {e}") from None
    state.load_state_dict(saved["run_state"])
    log.info("resume: continuing from %s (step %d of %d)", resume_from, state.step, run.steps)
    return resume_from, saved
