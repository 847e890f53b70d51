"""The driver's own state: where the run is and what it has counted. A run checkpoint saves it whole."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunState:
    """Everything the schedule has counted or decided so far (engines, buffer and prompts keep their own)."""

    step: int = 0
    """Optimizer steps taken (skipped ones included): the version the learner's weights carry."""
    published: int = 0
    """Newest version the learner ranks published to the engines."""
    admitted: int = 0
    """Prompts sent to the engines so far (new ones; resubmissions are not counted here). Also numbers each prompt's
    sampling seed."""
    lost_groups: int = 0
    """Admitted groups that will never be trained on (failed, too few rewards, dropped by dynamic sampling)."""
    generated_tokens: int = 0
    reward_failed: int = 0
    reward_lost_in_a_row: int = 0
    """Groups in a row the reward functions left with fewer than two scored samples (groups.REWARD_FAILURE_PATIENCE)."""
    bad_rows: int = 0
    requests_lost: int = 0
    """Completions that came back failed (engine-side errors); their group is dropped."""
    failed_in_a_row: int = 0
    """Groups in a row dropped for a sample failed in its engine (groups.drop_failed)."""
    steps_skipped: int = 0
    """Steps whose loss or gradient was not finite (no update taken)."""
    skipped_in_a_row: int = 0
    sync_failures: int = 0
    dropped_uniform: int = 0
    """Groups dynamic sampling dropped because all their rewards were equal."""
    uniform_in_a_row: int = 0
    rollbacks: int = 0
    """Times the collapse guard restored a checkpoint (`routing.on_jump=rollback`)."""
    lr_scale: float = 1.0
    """The learning rate relative to `learner.lr` (each rollback multiplies it by `routing.rollback_lr_factor`)."""
    discarded_groups: int = 0
    """Groups thrown away at a rollback (sampled by the weights that were rolled back)."""
    resumed_from: int = -1
    """Step of the checkpoint this process resumed from (-1: a fresh run)."""
    resume_resubmitted: int = 0
    """Prompts in flight at checkpoint time, sent again after the resume."""
    resume_buffered_groups: int = 0
    """Groups the checkpoint's buffer held when this process resumed (trained on, or dropped as stale)."""
    last_eval: float = float("nan")
    last_eval_step: int = -1
    last_eval_version: int = -1
    evals: list[tuple[int, float]] = field(default_factory=list)
    warm_start_loss: list[float] = field(default_factory=list)
    tracker_runs: dict[str, str] = field(default_factory=dict)
    """Tracker key ('wandb', 'mlflow') -> the id of this run's tracker run: a resumed run goes on in it."""

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(self)}
        for key, value in state.items():
            if key in known:
                setattr(self, key, [tuple(e) for e in value] if key == "evals" else value)
