"""The collapse guard's decision (`rollback_due`), without a run: go on, roll back to the checkpoint written before
the jump began, or stop naming why. The whole-run rollback is tests/faults/test_learner_faults.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_grpo.orchestrator import collapse_guard
from moe_grpo.orchestrator.collapse_guard import rollback_due
from moe_grpo.orchestrator.config import CheckpointConfig
from moe_grpo.orchestrator.state import RunState
from moe_grpo.orchestrator.watch import JumpWatch
from moe_grpo.routing.config import RoutingConfig

METRICS = {"train/rollout_kl": 0.5, "train/router_disagreement": 0.4}


def _watch(in_a_row: int) -> JumpWatch:
    watch = JumpWatch()
    watch.in_a_row = in_a_row
    return watch


def _run(on_jump: str = "rollback"):
    """The two sections `rollback_due` reads, as a run has them."""
    return SimpleNamespace(routing=RoutingConfig(on_jump=on_jump, jump_sustain=2, max_rollbacks=1),
                           checkpoint=CheckpointConfig(every=2, keep=3))


def test_a_jump_sustained_for_jump_sustain_steps_rolls_back_to_before_it_began(monkeypatch):
    asked = []
    monkeypatch.setattr(collapse_guard.run_checkpoint, "rollback_target",
                        lambda run_dir, began: asked.append(began) or Path(run_dir) / "step_000004")
    assert rollback_due(_run(), _watch(1), RunState(step=7), METRICS, "/runs/a", lambda: "hint") is None
    got = rollback_due(_run(), _watch(2), RunState(step=7), METRICS, "/runs/a", lambda: "hint")
    assert asked == [6], "the jump began at step 6 (steps 6 and 7 jumped)"
    assert got.target == Path("/runs/a/step_000004")
    assert "jumped for 2 steps in a row through step 7" in got.seen and "train/rollout_kl 0.5" in got.seen


def test_on_jump_warn_never_rolls_back():
    assert rollback_due(_run("warn"), _watch(5), RunState(step=7), METRICS, "/runs/a", lambda: "hint") is None


def test_the_run_stops_naming_why_when_it_cannot_roll_back(monkeypatch):
    monkeypatch.setattr(collapse_guard.run_checkpoint, "rollback_target", lambda run_dir, began: None)
    with pytest.raises(RuntimeError, match=r"no checkpoint written before the jump began \(step 6\).*last: x"):
        rollback_due(_run(), _watch(2), RunState(step=7), METRICS, "/runs/a", lambda: "last: x")
    with pytest.raises(RuntimeError, match=r"after 1 rollback\(s\) \(routing.max_rollbacks=1\); stopping. last: x"):
        rollback_due(_run(), _watch(2), RunState(step=7, rollbacks=1), METRICS, "/runs/a", lambda: "last: x")
