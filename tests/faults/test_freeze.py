"""A whole job frozen and thawed, as SLURM's `scontrol suspend` and gang scheduling's time slices (SIGSTOP to every
process of the job), a cgroup freezer or a paused VM do it: every process of the run, its own Ray cluster's
included, stopped for longer than `rollout.request_timeout_s`, then continued.

Until 2026-11-28 the frozen time counted toward every deadline: on thaw the engine was named hung and restarted (one
of `rollout.max_restarts`), the version it was loading failed, a request was sent again and Ray printed an
"Unhandled error" traceback on the console (a 20 s freeze with an 8 s timeout; with the default 120 s timeout any
freeze longer than that). Now the deadlines count only the time their process ran (moe_grpo/awake_clock.py) and the
run goes on as if nothing had happened."""

import os
import signal
import time

import psutil
import pytest

from runs import Run

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]

REQUEST_TIMEOUT_S = 5
FREEZE_S = 12  # more than twice the timeout: the engine's requests and a version's load are in flight across it
STEPS = 8


def test_a_run_frozen_longer_than_its_timeouts_goes_on_when_thawed_without_a_restart(tmp_path):
    # Longer completions: generation is the slower phase, so requests are in flight when the freeze lands.
    run = Run(tmp_path / "run", f"steps={STEPS}", "mode=async", f"rollout.request_timeout_s={REQUEST_TIMEOUT_S}",
              "rollout.max_tokens=48", own_ray=True)  # Ray's processes too: the whole job stops
    try:
        run.wait_step(3)
        processes = [psutil.Process(run.proc.pid)] + psutil.Process(run.proc.pid).children(recursive=True)
        for p in processes:
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.NoSuchProcess:
                pass
        time.sleep(FREEZE_S)
        for p in processes:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        code = run.finish(300)
    except BaseException:
        for p in psutil.Process(os.getpid()).children(recursive=True):  # nothing of the run left stopped
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass
        run.kill()
        raise
    assert code == 0, run.output[-4000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    faults = {k: v for k, v in rows[-1].items() if k.startswith("faults/") and v}
    assert faults == {}, f"the freeze counted as faults: {faults}\n{run.output[-4000:]}"
    for noise in ("hung", "restarting", "did not take version", "Unhandled error", "Traceback"):
        assert noise not in run.output, f"{noise!r} after a freeze:\n{run.output[-4000:]}"
