"""How a run that has taken its last step ends when a SIGTERM lands then: at the final checkpoint, cleanly. Fast: the
driver's schedule, checkpoint and export are stand-ins that keep the real ones' contract (a checkpoint written while
a SIGTERM is pending raises `Stopped`); `Driver.on_signal` is the real one."""

import dataclasses
import signal
from pathlib import Path
from types import SimpleNamespace

from moe_grpo.orchestrator import run_checkpoint
from moe_grpo.orchestrator.driver import Driver, Stopped
from moe_grpo.orchestrator.training_run import run_to_end
from moe_grpo.orchestrator.state import RunState

STEPS = 3


class EndingDriver:
    """The driver's end of a run: the schedule takes its last step, then `signal_after_last` (if any) arrives."""

    on_signal = Driver.on_signal

    def __init__(self, signal_after_last=None, every=0):
        self.run = SimpleNamespace(steps=STEPS, checkpoint=SimpleNamespace(at_end=True, every=every))
        self.state = RunState()
        self.last_checkpoint = None
        self.due = self.stop_after_checkpoint = None
        self.engines = SimpleNamespace(stopping=False)  # a SIGTERM tells the pool to restart no engine
        self.signal_after_last = signal_after_last
        self.run_dir = "/nonexistent"
        self.written, self.calls = [], []

    def run_schedule(self):
        self.state.step = self.state.published = STEPS
        if self.run.checkpoint.every:
            self.last_checkpoint = Path(run_checkpoint.step_name(STEPS))
        if self.signal_after_last is not None:
            self.on_signal(self.signal_after_last)

    def checkpoint(self, reason):
        self.written.append((self.state.step, reason))
        self.last_checkpoint = Path(run_checkpoint.step_name(self.state.step))
        self.due = None
        if self.stop_after_checkpoint:
            raise Stopped(self.stop_after_checkpoint)
        return self.last_checkpoint

    @property
    def learners(self):  # the learner ranks, as `export_policy` reaches them (`LearnerGroup.call`)
        return self

    def call(self, method, *args, what, ranks=None):
        self.calls.append(method)
        return ["policy"]

    def finish_probes(self):  # the probe rounds in progress, once the policy is out
        self.calls.append("finish_probes")


def test_a_sigterm_after_the_last_step_stops_at_the_final_checkpoint():
    """The final checkpoint was written outside the `except Stopped` of `train`: a SIGTERM that landed after the last
    step (SLURM's time limit, a run that just made it) made it raise `Stopped` out of `train`: a traceback, exit 1,
    and no policy. Now the run stops there like any SIGTERM'd run: checkpoint written, the signal returned (exit 143),
    the export left to the resumed run (which finds every step done and exports)."""
    driver = EndingDriver(signal_after_last=signal.SIGTERM)
    assert run_to_end(driver) == "SIGTERM"
    assert driver.written == [(STEPS, "end")] and "export_version" not in driver.calls
    assert driver.engines.stopping, "the SIGTERM also tells the engine pool to restart no engine"


def test_a_sighup_after_the_last_step_stops_at_the_final_checkpoint_as_a_sigterm_does():
    """A closed ssh session or terminal (SIGHUP) is a stop like a scheduler's: before 2026-11-28 it killed the driver."""
    driver = EndingDriver(signal_after_last=signal.SIGHUP)
    assert run_to_end(driver) == "SIGHUP" and driver.engines.stopping


def test_a_run_that_finishes_writes_its_checkpoint_and_exports():
    driver = EndingDriver()
    assert run_to_end(driver) is None
    assert driver.written == [(STEPS, "end")] and driver.calls == ["export_version", "finish_probes"]


def test_sigusr1_after_the_last_step_checkpoints_and_the_run_still_finishes():
    driver = EndingDriver(signal_after_last=signal.SIGUSR1)
    assert run_to_end(driver) is None
    assert driver.written == [(STEPS, "end")] and driver.calls == ["export_version", "finish_probes"] and driver.due is None


def test_a_sigterm_after_the_last_step_with_its_checkpoint_already_written_still_exports():
    """checkpoint.every divides steps: the last step's checkpoint exists, nothing is owed; the export goes on."""
    driver = EndingDriver(signal_after_last=signal.SIGTERM, every=STEPS)
    assert run_to_end(driver) is None
    assert driver.written == [] and driver.calls == ["export_version", "finish_probes"]


def test_a_checkpoint_whose_write_fails_leaves_no_partial_directory(tmp_path):
    """A learner rank failing to write its part (a full disk) stops the run; the partial `step_N.tmp` stayed on the
    full disk, holding the room (a user's trial, 2026-11-28). `Driver.checkpoint` is the real one."""
    import pytest

    class Failing:
        checkpoint = Driver.checkpoint
        training, run_dir, state = None, tmp_path, RunState(step=4)

        def take_finished(self):
            pass

        @property
        def learners(self):
            return self

        def call(self, method, path, what):
            (Path(path) / "0_0.distcp").write_bytes(b"x" * 1024)  # part of the write, then the disk is full
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        Failing().checkpoint("every")
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_checkpoint_saves_what_the_engines_and_rewards_finished_as_buffered_groups(tmp_path):
    """Before 2026-11-26 groups whose engine results or rewards the loop had not yet taken were saved as requests in
    flight, and a resume sampled them again. `Driver.checkpoint` (the real one) takes what is finished before the
    driver's state is saved: the finished group is in the saved buffer, not among the requests."""
    from moe_grpo.orchestrator.run_checkpoint import load_driver_state

    class Checkpointing:
        checkpoint = Driver.checkpoint
        training, run_dir, state, stop_after_checkpoint = None, tmp_path, RunState(step=2), None
        run = SimpleNamespace(parallel=None, checkpoint=SimpleNamespace(keep=2))
        watch = SimpleNamespace(in_a_row=0)
        buffered, in_flight = [], ["group 7"]  # group 7's completions and reward are in, not yet taken

        def take_finished(self):
            self.buffered, self.in_flight = self.buffered + self.in_flight, []

        def state_dict(self):
            return {"buffer": list(self.buffered), "requests": list(self.in_flight)}

    class OneRank:
        def call(self, method, path, what):
            (Path(path) / "0_0.distcp").write_bytes(b"weights")

        def __len__(self):
            return 1

    Checkpointing.learners = OneRank()
    Checkpointing.run.parallel = dataclasses.make_dataclass("Parallel", [])()
    path = Checkpointing().checkpoint("every")
    assert load_driver_state(path) == {"buffer": ["group 7"], "requests": []}
