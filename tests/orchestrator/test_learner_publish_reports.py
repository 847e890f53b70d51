"""A learner rank keeps the report of every background publish, also one still writing when the next publish
starts (pure logic: the rank's WeightSync is a stand-in that finishes a publish only when the next one starts, as
`WeightSync.sync` waits for the one in flight)."""

import dataclasses

import pytest

from moe_grpo.orchestrator.learner_actor import KEPT_REPORTS, LearnerWorker


@dataclasses.dataclass
class Report:
    version: int

    def metrics(self) -> dict:
        return {"sync/bytes": 100 * self.version}


class Handle:
    def __init__(self, version: int, fail: bool, finished: bool) -> None:
        self.report, self.finished = Report(version), finished
        self.fail = fail

    def done(self) -> bool:
        return self.finished

    def wait(self) -> Report:
        self.finished = True
        if self.fail:
            raise RuntimeError(f"sync of version {self.report.version} failed on this learner rank")
        return self.report


class OnePublishAtATime:
    """`sync()` finishes the publish in flight first, then writes the next (in the background: not done yet)."""

    def __init__(self, failing: int | None = None) -> None:
        self.pending: Handle | None = None
        self.failing = failing

    def sync(self, version: int, background: bool) -> Handle:
        if self.pending is not None:
            self.pending.finished = True
        self.pending = Handle(version, fail=version == self.failing, finished=not background)
        return self.pending


def worker(sync: OnePublishAtATime) -> LearnerWorker:
    w = object.__new__(LearnerWorker)
    w.sync, w._handle, w._reports = sync, None, {}
    return w


def test_every_background_publish_is_reported_even_when_the_next_one_starts_before_it_is_collected():
    w = worker(OnePublishAtATime())
    for version in range(1, 5):
        w.publish(version, background=True)  # nothing asked for the report in between (no train step waited)
    assert sorted(w.sync_metrics()) == [1, 2, 3], "a publish still in flight when the next began lost its report"
    assert w.sync_metrics()[2] == {"sync/bytes": 200}
    w.publish(5, background=False)
    assert sorted(w.sync_metrics()) == [1, 2, 3, 4, 5]


def test_only_the_latest_reports_are_kept():
    w = worker(OnePublishAtATime())
    for version in range(1, KEPT_REPORTS + 5):
        w.publish(version, background=False)
    assert sorted(w.sync_metrics()) == list(range(5, KEPT_REPORTS + 5))


def test_a_failed_background_publish_fails_the_next_publish_before_it_starts():
    sync = OnePublishAtATime(failing=2)
    w = worker(sync)
    w.publish(1, background=True)
    w.publish(2, background=True)
    with pytest.raises(RuntimeError, match="version 2 failed"):
        w.publish(3, background=True)
    assert sync.pending.report.version == 2, "version 3 was started after version 2 failed"
