"""The run's closing summary (`train`'s return value, the closing line's source) as one documented dataclass."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_grpo.orchestrator import run_summary
from moe_grpo.orchestrator.run_summary import Faults, RunSummary
from moe_grpo.orchestrator.state import RunState


def _summary(state: RunState, last_checkpoint: Path | None, stopped: str | None = None) -> dict:
    engines = SimpleNamespace(sync_failures=1, restarts=2, requests_resubmitted=3)
    return RunSummary.of(state, engines, last_checkpoint, run_dir="/runs/a", seconds=12.5, stopped=stopped,
                         sync={"host1": {"bytes": 4}}, mismatch={"mismatch/kl": 1e-12, "mismatch/probe_version": 4.0}
                         ).as_dict()


def test_the_summary_holds_the_keys_train_returned_with_their_values():
    """`train` built its summary by hand, 14 keys and 6 fault counts in one expression (the final probe came later); `python -m moe_grpo.train`
    and the whole-run tests index it by name (the closing line names the faults above 0 in this order). Would have
    caught a key renamed or dropped, or the faults' order changed, by the move into a dataclass."""
    state = RunState(step=4, reward_failed=5, bad_rows=6, requests_lost=7, steps_skipped=8, rollbacks=9,
                     evals=[(0, 0.25), (4, 0.5)], warm_start_loss=[2.0, 1.5], resumed_from=2)
    summary = _summary(state, Path("/runs/a/checkpoints/step_000004"))
    assert summary == {
        "steps": 4, "resumed_from": 2, "eval_start": 0.25, "eval_end": 0.5, "evals": [(0, 0.25), (4, 0.5)], "warm_start_loss": [2.0, 1.5],
        "seconds": 12.5, "run_dir": "/runs/a", "policy_dir": "/runs/a/policy", "reward_failed": 5, "bad_rows": 6,
        "stopped": None, "sync": {"host1": {"bytes": 4}}, "checkpoint": "/runs/a/checkpoints/step_000004",
        "faults": {"requests_lost": 7, "steps_skipped": 8, "sync_failures": 1, "engine_restarts": 2,
                   "requests_resubmitted": 3, "rollbacks": 9},
        "mismatch": {"kl": 1e-12, "probe_version": 4.0}}
    assert list(summary) == ["steps", "resumed_from", "eval_start", "eval_end", "evals", "warm_start_loss", "seconds", "run_dir",
                             "policy_dir", "reward_failed", "bad_rows", "stopped", "sync", "checkpoint", "faults",
                             "mismatch"]
    assert _summary(RunState(step=4), None)["resumed_from"] is None, "a fresh run (RunState.resumed_from -1)"
    assert list(summary["faults"]) == ["requests_lost", "steps_skipped", "sync_failures", "engine_restarts",
                                       "requests_resubmitted", "rollbacks"]


def test_a_run_with_no_evaluation_and_no_checkpoint_says_so():
    """No held-out reward measured: NaN (the closing line prints 'not measured'); no checkpoint: None."""
    summary = _summary(RunState(step=2), None, stopped="SIGTERM")
    assert math.isnan(summary["eval_start"]) and math.isnan(summary["eval_end"])
    assert summary["checkpoint"] is None and summary["stopped"] == "SIGTERM" and summary["evals"] == []


def test_the_summary_is_frozen():
    summary = RunSummary.of(RunState(), SimpleNamespace(sync_failures=0, restarts=0, requests_resubmitted=0), None,
                            run_dir="/r", seconds=0.0, stopped=None, sync={}, mismatch={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        summary.steps = 3


@pytest.mark.parametrize("cls", [RunSummary, Faults])
def test_every_field_has_a_docstring(cls: type):
    """Each key of the summary says what it counts (the project's rule for dataclasses of settings and results)."""
    tree = ast.parse(inspect.getsource(run_summary))
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
    documented = set()
    for field, after in zip(node.body, node.body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            documented.add(field.target.id)
    assert documented == {f.name for f in dataclasses.fields(cls)}
