"""The run's cleanup runs to its last step whatever arrives meanwhile: a second SIGTERM (SLURM's at the time limit),
a Ctrl-C, a step that fails. Fast: the steps are functions, the signals real (sent to this process)."""

import logging
import os
import re
import signal
from types import SimpleNamespace

import pytest

from moe_grpo.orchestrator.session import SignalRelay, Teardown

STEPS = ("reward workers", "run record", "sync hosts", "pools", "private dir", "weight slots")
"""The steps of `train`'s cleanup, in its order."""


class RayLike:
    """What `ray.init` installs for SIGTERM in the driver: a handler that exits on the spot."""

    def __init__(self):
        self.calls = 0

    def __call__(self, signum, frame):
        self.calls += 1
        raise SystemExit(1)


@pytest.fixture
def relay():
    """A relay made before Ray (as `train` makes it), Ray's handler installed, then the relay's over it."""
    before = {s: signal.getsignal(s) for s in SignalRelay.HELD}
    relay = SignalRelay()
    ray_handler = RayLike()
    signal.signal(signal.SIGTERM, ray_handler)
    relay.install()
    yield relay, ray_handler, before
    for signum, handler in before.items():
        signal.signal(signum, handler)


def teardown_signalled_at(relay, at, signum):
    ran = []
    teardown = Teardown(relay)

    def step(name):
        def run():
            if name == at:
                os.kill(os.getpid(), signum)  # handled in this thread, inside this step
            ran.append(name)
        return run

    for name in STEPS:
        teardown.add(name, step(name))
    return teardown, ran


@pytest.mark.parametrize("at", STEPS)
def test_a_second_sigterm_during_the_cleanup_does_not_cut_it_short(relay, at, caplog):
    """`train` gave the handlers back as the first line of its cleanup, so a second SIGTERM landing in any later step
    reached Ray's handler, which exits: the steps after it (the pools, the private directory, the weight slots) were
    skipped. Now every step runs, the signal is logged, and the handlers from before Ray are back at the end."""
    relay, ray_handler, before = relay
    teardown, ran = teardown_signalled_at(relay, at, signal.SIGTERM)
    with caplog.at_level(logging.INFO, logger="moe_grpo"):
        teardown.run()
    assert ran == list(STEPS) and teardown.done == list(STEPS)
    assert ray_handler.calls == 0 and relay.held == ["SIGTERM"]
    assert "cleanup: SIGTERM arrived during it and did not cut it short" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM], "not Ray's: its node is gone"


def test_ctrl_c_and_repeated_signals_during_the_cleanup_are_held_too(relay, caplog):
    relay, ray_handler, before = relay
    teardown, ran = teardown_signalled_at(relay, "pools", signal.SIGINT)
    teardown.add("again", lambda: [os.kill(os.getpid(), signal.SIGTERM) for _ in range(2)])
    with caplog.at_level(logging.WARNING, logger="moe_grpo"):
        teardown.run()
    assert ran == list(STEPS) and teardown.done[-1] == "again"
    assert relay.held == ["SIGINT", "SIGTERM", "SIGTERM"]
    assert "SIGINT, SIGTERM x2 arrived during it" in caplog.text
    assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]


def test_a_failing_step_is_logged_and_the_later_ones_still_run(relay, caplog):
    relay, _, _ = relay
    ran, records = [], []

    def broken():
        raise RuntimeError("raylet unreachable")

    teardown = Teardown(relay, after_each=lambda: records.append(len(ran)))
    teardown.add("pools", broken)
    teardown.add("weight slots", lambda: ran.append("weight slots"))
    with caplog.at_level(logging.WARNING, logger="moe_grpo"):
        teardown.run()
    assert ran == ["weight slots"] and teardown.failed == ["pools"] and records == [0, 1]
    assert "cleanup: pools failed (RuntimeError: raylet unreachable); the rest of the cleanup goes on" in caplog.text


def test_the_cleanup_line_names_its_slowest_steps_with_their_times(relay, caplog):
    """A user whose run takes seconds to end sees which release took them (and a test of the suite's time, too)."""
    import time

    relay, _, _ = relay
    teardown = Teardown(relay)
    teardown.add("the pools", lambda: time.sleep(0.3))
    teardown.add("the run record", lambda: time.sleep(0.1))
    teardown.add("the weight slots", lambda: None)
    with caplog.at_level(logging.INFO, logger="moe_grpo"):
        teardown.run()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("cleanup done"))
    assert re.search(r"\(the pools 0\.[3-9] s, the run record 0\.[1-9] s\)$", line), line  # slowest first
    assert teardown.seconds["the pools"] >= 0.3 and set(teardown.seconds) == {"the pools", "the run record",
                                                                             "the weight slots"}


def test_before_the_schedule_a_sigterm_stops_the_start_up_and_afterwards_reaches_the_driver(relay):
    relay, _, _ = relay
    with pytest.raises(KeyboardInterrupt, match="SIGTERM during start-up"):
        os.kill(os.getpid(), signal.SIGTERM)

    class Driver:
        record = object()
        got = []

        def on_signal(self, signum):
            self.got.append(signum)

    relay.driver = Driver()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert Driver.got == [signal.SIGUSR1]


RAY_SHUTDOWN = """
import os, signal, sys, time
import ray
from moe_grpo.orchestrator.session import SignalRelay, keep_handlers_through_ray_shutdown
if sys.argv[1] == "keep":
    keep_handlers_through_ray_shutdown()
relay = SignalRelay()
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
relay.hold()  # what the cleanup does before its first step
ray.shutdown()
os.kill(os.getpid(), signal.SIGTERM)  # lands right after the shutdown, before the cleanup's next step
time.sleep(0.5)
print("held", relay.held, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["keep", "without"])
def test_ray_shutdown_leaves_the_sigterm_handler_in_place(keep):
    """`ray.shutdown()` set SIGTERM to SIG_DFL at the C level (uninstalling Ray's failure-signal handler), so in
    a whole run a second SIGTERM that landed while Ray's processes were being stopped, or after, killed the driver
    mid-cleanup (exit -15, the private directory and weight slots left). With `keep_handlers_through_ray_shutdown`
    the relay's handler is still in place after it. (`without`: the Ray behaviour it works around, checked so that a
    Ray that no longer does this is noticed.)"""
    import shutil
    import subprocess
    import sys
    import tempfile

    short = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    try:
        out = subprocess.run([sys.executable, "-c", RAY_SHUTDOWN, keep], capture_output=True, text=True,
                             timeout=300, env={**os.environ, "RAY_TMPDIR": short})
    finally:
        shutil.rmtree(short, ignore_errors=True)
    if keep == "keep":
        assert out.returncode == 0 and "held ['SIGTERM']" in out.stdout, out.stdout + out.stderr[-3000:]
    else:
        assert out.returncode == -signal.SIGTERM, (out.returncode, out.stdout, out.stderr[-3000:])


def test_a_sighup_stops_the_start_up_as_a_sigterm_does_and_is_held_during_the_cleanup(relay):
    """SIGHUP is what a driver gets when the ssh session or terminal it was started from closes. Unhandled, it killed
    the driver at once: no checkpoint, no cleanup, its processes, vLLM's ring buffers and weight slots left behind
    (a user's trial, 2026-11-28)."""
    relay, _, _ = relay
    if relay.original[signal.SIGHUP] == signal.SIG_IGN:  # this test process started under nohup: as a terminal would
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        relay = SignalRelay()
        relay.install()
    with pytest.raises(KeyboardInterrupt, match="SIGHUP during start-up"):
        os.kill(os.getpid(), signal.SIGHUP)
    assert relay.stopped_start == "SIGHUP", "the start-up's stop is a scheduler's, not a Ctrl-C"
    teardown, ran = teardown_signalled_at(relay, "pools", signal.SIGHUP)
    teardown.run()
    assert ran == list(STEPS) and relay.held == ["SIGHUP"]


def test_a_run_started_under_nohup_keeps_ignoring_sighup():
    """nohup sets SIGHUP to ignored so that a closed terminal leaves the run alone: the relay must not take it over
    (the review of 2026-11-28: it did, and a dropped ssh session stopped nohup'd runs)."""
    before = signal.getsignal(signal.SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        relay = SignalRelay()
        relay.install()
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGUSR1) == relay.handle
        relay.restore()
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_first_ctrl_c_asks_the_driver_for_a_checkpoint_and_a_second_stops_at_once(relay, capfd):
    """A Ctrl-C stopped the run at once, without a checkpoint: every step since the last periodic one (50 by default)
    was lost, after a 50-line KeyboardInterrupt traceback (a user's trial, 2026-11-28: 11 steps). Now the first is
    a SIGTERM's stop (a checkpoint at the step's end, then the cleanup; the terminal says so) and a second one
    stops at once. Before the schedule, there is nothing to checkpoint: a Ctrl-C stops the start-up."""
    relay, _, _ = relay
    if relay.original[signal.SIGINT] == signal.SIG_IGN:  # a suite started in the background: as a terminal would
        signal.signal(signal.SIGINT, signal.default_int_handler)
        relay = SignalRelay()
        relay.install()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    assert relay.stopped_start is None, "a Ctrl-C, not a scheduler's stop"

    class Driver:
        record = object()
        stop_after_checkpoint = None
        state, run = SimpleNamespace(step=3), SimpleNamespace(steps=10)

        def on_signal(self, signum):
            self.stop_after_checkpoint = signal.Signals(signum).name

    relay.driver = Driver()
    os.kill(os.getpid(), signal.SIGINT)  # no exception: the driver checkpoints at the step's end, then stops
    assert relay.driver.stop_after_checkpoint == "SIGINT"
    assert "Ctrl-C: stopping after a checkpoint at the end of this step (Ctrl-C again stops at once" in \
        capfd.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    relay.driver = Driver()
    relay.driver.state.step = 10  # the steps done: the final checkpoint and export are what is left
    os.kill(os.getpid(), signal.SIGINT)
    assert "Ctrl-C: the steps are done; finishing the run's end (Ctrl-C again abandons it)" in capfd.readouterr().err


def test_processes_started_while_ray_starts_ignore_ctrl_c_and_the_driver_keeps_its_handler():
    """A Ctrl-C reaches every process of the terminal's group; in a Ray worker it raised KeyboardInterrupt inside a
    running task and Ray's core worker crashed with a 30-line stack dump (a user's trial, 2026-11-28). What starts
    inside `ctrl_c_left_to_this_process` (`ray.init`'s servers, and the workers they start) ignores it."""
    import subprocess
    import sys

    from moe_grpo.processes import ctrl_c_left_to_this_process

    def ignores_sigint(pid):
        mask = next(line for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:")).split()[1]
        return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))

    before = signal.getsignal(signal.SIGINT)
    with ctrl_c_left_to_this_process():
        inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert ignores_sigint(inside.pid) and ignores_sigint(outside.pid) == (before == signal.SIG_IGN)
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        inside.kill()
        outside.kill()
        inside.wait()
        outside.wait()


def test_a_gcs_lost_after_a_signal_leaves_the_signal_as_the_runs_stop():
    """A SIGTERM to every process of a run on its own cluster ends its GCS too. When the learner's death took longer
    than the GCS watch's 5 s, the run stopped as a lost cluster (exit 1) instead of by the SIGTERM (exit 143): a
    suite run, 2026-11-29. The GCS's loss now stops a run only when nothing else already does."""
    from moe_grpo.orchestrator.cluster_watch import GCS_LOST
    from moe_grpo.orchestrator.session import _tell_gcs_lost

    told = []
    signalled = SimpleNamespace(stop_after_checkpoint="SIGTERM", on_signal=told.append)
    _tell_gcs_lost(signalled)
    assert told == []
    running = SimpleNamespace(stop_after_checkpoint=None, on_signal=told.append)
    _tell_gcs_lost(running)
    assert told == [GCS_LOST]
