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


class FailingWrites:
    """A file or event writer on a file system that filled up: every write raises ENOSPC."""

    def __init__(self):
        self.closed = False

    def _full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    write = flush = add_scalar = _full

    def close(self):
        self.closed = True


def test_a_full_disk_under_the_record_stops_the_run_naming_the_file_and_tensorboard_alone_is_dropped(tmp_path, caplog):
    """A run whose directory's file system filled up ended with ~120 lines of TensorBoard's traceback, twice, and no
    word of the checkpoint (a user's trial, 2026-11-28). TensorBoard's copy failing now only stops its events;
    metrics.jsonl failing stops the run with `RecordWriteError` naming the file (the run says it in one line)."""
    import pytest

    from moe_grpo.orchestrator.run_record import REQUIRED_KEYS, RecordWriteError, RunRecord

    record = RunRecord(tmp_path, 3, progress=False)
    full = {k: 0.0 for k in REQUIRED_KEYS} | {"step": 1.0}
    record._tb = events = FailingWrites()
    with caplog.at_level("WARNING", logger="moe_grpo"):
        record.log(full)
    assert record._tb is None and events.closed and "TensorBoard's event file could not be written" in caplog.text
    assert [r["step"] for r in record.rows] == [1.0], "metrics.jsonl has the row"
    record._file = FailingWrites()
    with pytest.raises(RecordWriteError, match=rf"the run record {tmp_path / 'metrics.jsonl'} could not be written at "
                                               r"step 2: OSError: \[Errno 28\] No space left on device"):
        record.log(full | {"step": 2.0})
    record.close_files()  # the cleanup closes what is left without a second traceback


def test_a_nearly_full_file_system_is_named(monkeypatch):
    import shutil
    from collections import namedtuple

    from moe_grpo.orchestrator.run_dirs import low_disk_note

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(30 << 20, 29 << 20, 1 << 20))
    assert low_disk_note("/run") == "; /run's file system has 1 MiB free"
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 << 30, 50 << 30, 50 << 30))
    assert low_disk_note("/run") == ""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, (1 << 50) - (20 << 30), 20 << 30))
    assert low_disk_note("/run") == "", "20 GiB free on a 1 PiB file system is not full"


def test_a_record_file_removed_under_the_run_stops_it(tmp_path):
    """Writes through an open file whose directory was deleted succeed, into nothing: the run went on writing its
    rows nowhere (the review of 2026-11-28)."""
    import pytest

    from moe_grpo.orchestrator.run_record import REQUIRED_KEYS, RecordWriteError, RunRecord

    record = RunRecord(tmp_path, 3, progress=False)
    full = {k: 0.0 for k in REQUIRED_KEYS} | {"step": 1.0}
    record.log(full)
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(RecordWriteError, match=r"could not be written at step 2: FileNotFoundError: .* was removed"):
        record.log(full | {"step": 2.0})
    record.close_files()


def test_the_progress_bar_shows_each_steps_figures_with_its_count_and_no_eval_without_a_held_out_set(tmp_path, capsys):
    """The bar showed `eval nan` for a whole run without a held-out set, and each step's figures one step late (the
    postfix was set after the count's refresh; a user's trial, 2026-11-28)."""
    import math

    from moe_grpo.orchestrator.run_record import REQUIRED_KEYS, RunRecord

    record = RunRecord(tmp_path, 3, progress=True)
    record._bar.mininterval = 0  # a real step takes longer than tqdm's 0.1 s between refreshes
    try:
        row = {k: 0.0 for k in REQUIRED_KEYS} | {"step": 1.0, "reward/mean": 0.25, "eval/reward/mean": math.nan}
        record.log(row)
        shown = capsys.readouterr().err.rsplit("\r", 1)[-1]
        assert "1/3" in shown and "reward 0.250 tok/s 0" in shown and "eval" not in shown, shown
        record.log(row | {"step": 2.0, "reward/mean": 0.5, "eval/reward/mean": 0.75})
        shown = capsys.readouterr().err.rsplit("\r", 1)[-1]
        assert "2/3" in shown and "reward 0.500 eval 0.750" in shown, shown
    finally:
        record.close_files()
