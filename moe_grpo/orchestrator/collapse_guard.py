"""The collapse guard's decision after each trained step (`routing.on_jump`): go on, roll back to a checkpoint
written before the jump began, or stop the run naming why. The driver applies a rollback (`Driver.guard`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from moe_grpo.orchestrator import run_checkpoint
from moe_grpo.orchestrator.state import RunState
from moe_grpo.orchestrator.watch import JumpWatch

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig


@dataclass(frozen=True)
class Rollback:
    """A rollback the guard decided on."""

    target: Path
    """The run checkpoint to restore: the newest written before the jump began (`run_checkpoint.rollback_target`)."""
    seen: str
    """What jumped and for how long, for the log line."""


def rollback_due(run: RunConfig, watch: JumpWatch, state: RunState, metrics: dict[str, float], run_dir: str,
                 checkpoint_hint: Callable[[], str]) -> Rollback | None:
    """With `routing.on_jump=rollback`, a jump `watch` has seen sustained for `jump_sustain` steps through
    `state.step` calls for a rollback; None otherwise. Raises RuntimeError (with `checkpoint_hint()`) when the run
    has used its `max_rollbacks` or no checkpoint written before the jump began is there to restore."""
    cfg = run.routing
    if cfg.on_jump != "rollback" or watch.in_a_row < cfg.jump_sustain:
        return None
    seen = (f"train/rollout_kl {metrics.get('train/rollout_kl', float('nan')):.3g}, train/router_disagreement "
            f"{metrics.get('train/router_disagreement', float('nan')):.3g} jumped for {watch.in_a_row} "
            f"steps in a row through step {state.step}")
    if state.rollbacks >= cfg.max_rollbacks:
        raise RuntimeError(f"collapse guard: {seen}, after {state.rollbacks} rollback(s) "
                           f"(routing.max_rollbacks={cfg.max_rollbacks}); stopping. {checkpoint_hint()}")
    jump_began = state.step - watch.in_a_row + 1
    target = run_checkpoint.rollback_target(run_dir, jump_began)
    if target is None:
        ck = run.checkpoint
        raise RuntimeError(f"collapse guard: {seen}, and no checkpoint written before the jump began (step "
                           f"{jump_began}) is there to roll back to (checkpoint.every={ck.every}; "
                           f"checkpoint.keep={ck.keep} may keep only checkpoints of the jump's steps); stopping. "
                           f"{checkpoint_hint()}")
    return Rollback(target, seen)
