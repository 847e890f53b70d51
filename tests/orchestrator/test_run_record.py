"""The run record's step row: figures a broken run gets wrong must show, not be clipped into range."""

from types import SimpleNamespace

import numpy as np

from moe_grpo.orchestrator.run_record import step_row
from moe_grpo.orchestrator.state import RunState
from moe_grpo.rollout.types import Completion


class EmptyBuffer(list):
    dropped_stale = 0


def row(train_seconds: float, interval: float) -> dict[str, float]:
    state = RunState(step=3)
    completion = Completion(prompt_ids=np.arange(4), token_ids=np.arange(3), versions=np.array([1, 2, 2]))
    groups = [SimpleNamespace(rewards=np.array([0.0, 1.0]), completions=[completion, completion])]
    engines = SimpleNamespace(restarts=0, requests_resubmitted=0, sync_failures=0)
    return step_row(state, {"train_seconds": train_seconds}, groups, trained_version=2, interval=interval,
                    train_seconds=train_seconds, infer_busy=0.5, rollout_tokens=6, sync={},
                    buffer=EmptyBuffer(), engines=engines, abort_resubmits=0.0)


def test_a_train_time_longer_than_the_step_shows_as_a_busy_fraction_above_one():
    """The learner's time of a step lies inside the driver's interval of it; `util/train_busy` was clamped to 1, so
    a train time measured over the wrong span (two steps, or a clock that is not the interval's) read as a fully busy
    learner, and the whole-run tests' `util/train_busy <= 1` could not fail."""
    measured = row(train_seconds=3.0, interval=2.0)
    assert measured["util/train_busy"] == 1.5
    assert row(train_seconds=1.0, interval=2.0)["util/train_busy"] == 0.5
    assert measured["staleness/max"] == 1 and measured["staleness/mean"] == 1 / 3


def test_every_key_of_a_step_row_is_in_the_metrics_reference():
    """docs/reference/metrics.md says every key it lists is in every row; a key written but not listed is one a
    user cannot look up. Would have caught: `loss`, `nll`, `grad_norm`, `clip_fraction`, `ratio_mean`,
    `response_length/mean`, `buffer/*`, `eval/step`, `rollout/resubmitted` and `time/*` written on every row and
    missing from the page."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "metrics.md").read_text()
    table = "\n".join(line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `"))
    documented = set(re.findall(r"`([^`]+)`", table))
    missing = sorted(set(row(1.0, 2.0)) - documented)
    assert not missing, f"keys of metrics.jsonl rows not in docs/reference/metrics.md's tables: {missing}"
