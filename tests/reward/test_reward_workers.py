"""Reward functions run in worker processes: a hung call is timed out by killing its worker, which frees it; a worker
that dies fails only its call; the next call gets a fresh worker; the process exits without waiting on either."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from moe_grpo.awake_clock import awake_now
from moe_grpo.reward.functions import Rewards

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the helpers are named `tests.reward.hanging_rewards:...`, here and in the workers
    sys.path.insert(0, ROOT)

from tests.reward.procs import alive as _alive, workers_of as _workers_of  # noqa: E402

HELPERS = "tests.reward.hanging_rewards"


@pytest.mark.slow  # waits out reward timeouts
def test_a_reward_hanging_every_third_call_costs_only_those_calls(tmp_path, monkeypatch):
    """15 calls, 5 of them hung: a thread pool of 4 would have every thread stuck by the 13th and time that one out
    too; with workers each hung call costs its timeout and nothing after it."""
    monkeypatch.setenv("HANG_COUNTER", str(tmp_path / "calls"))
    timeout = 0.5
    fn = f"{HELPERS}:hangs_every_third_call"
    r = Rewards([fn], [1.0], timeout_s=timeout)
    try:
        t_all = time.perf_counter()
        for call in range(1, 16):
            completions = ["a" * call, "b" * (call + 1)]
            t0 = time.perf_counter()
            s = r.score(["p", "p"], completions)
            took = time.perf_counter() - t0
            if call % 3 == 0:
                assert s.failed.all(), (call, s.rewards)
                assert len(s.errors) == 1 and s.errors[0].startswith(
                    f"{fn}: TimeoutError: did not return within reward.timeout_s=0.5 s"), (call, s.errors)
                assert timeout <= took < timeout + 1.5, (call, took)
            else:
                assert s.errors == [] and s.rewards.tolist() == [call, call + 1], (call, s.errors, s.rewards)
            assert len(_workers_of(os.getpid(), fn)) <= 1, "a hung worker was left behind"
        total = time.perf_counter() - t_all
        assert 5 * timeout <= total < 5 * timeout + 6.0, total
    finally:
        r.close()
    assert _workers_of(os.getpid(), fn) == []


def test_an_async_reward_that_blocks_its_event_loop_is_timed_out(tmp_path):
    """asyncio's own timeout cannot cancel a coroutine stuck in a blocking call; killing its worker can."""
    fn = f"{HELPERS}:blocks_its_event_loop"
    r = Rewards([fn, f"{HELPERS}:async_length"], [1.0, 1.0], timeout_s=0.5)
    try:
        t0 = time.perf_counter()
        s = r.score(["p"], ["abc"])
        assert time.perf_counter() - t0 < 2.5
        assert s.failed.all() and s.errors == [f"{fn}: TimeoutError: did not return within reward.timeout_s=0.5 s "
                                               "(its worker process was killed; the next call starts a fresh one)"]
        ok = Rewards([f"{HELPERS}:async_length"], [2.0], timeout_s=5)
        assert ok.score(["p", "p"], ["abc", "de"]).rewards.tolist() == [6.0, 4.0]
        ok.close()
    finally:
        r.close()


def test_a_reward_that_kills_its_worker_fails_that_call_by_name_and_the_next_call_works():
    fn = f"{HELPERS}:exits"
    r = Rewards([fn], [1.0], timeout_s=10)
    try:
        assert r.score(["p"] * 2, ["a", "b"]).rewards.tolist() == [1.0, 1.0]
        s = r.score(["p"] * 2, ["a", "b"], {"how": ["exit", None]})
        assert s.failed.all() and len(s.errors) == 1, s.errors
        assert s.errors[0].startswith(f"{fn}: RewardWorkerDied: its worker process exited with code 3 during the call")
        assert r.score(["p"] * 2, ["a", "b"], {"how": [None, None]}).rewards.tolist() == [1.0, 1.0]
        s = r.score(["p"], ["a"], {"how": ["segfault"]})
        assert s.failed.all() and "killed by signal SIGSEGV (exit code -11) during the call" in s.errors[0], s.errors
        assert r.score(["p"], ["a"]).rewards.tolist() == [1.0]
        # A worker that dies between calls (killed from outside) costs nothing: the call goes to a fresh one.
        os.kill(r._lanes[0][0].proc.pid, 9)
        time.sleep(0.2)
        s = r.score(["p"], ["a"])
        assert s.errors == [] and s.rewards.tolist() == [1.0]
    finally:
        r.close()


def test_workers_are_fresh_interpreters():
    """Not forks of the caller: they see none of its state (here a module attribute set in this process)."""
    import tests.reward.hanging_rewards as helpers

    helpers.MARK = "set in the test process"
    r = Rewards([f"{HELPERS}:pid_and_mark"], [1.0])
    try:
        pid, mark = r.score(["p", "p"], ["a", "b"]).rewards.tolist()
        assert pid != os.getpid() and pid == r._lanes[0][0].proc.pid and mark == 0.0
        if os.path.exists(f"/proc/{int(pid)}/oom_score_adj"):
            # Before the engines and learner ranks (Ray's workers, 1000) under memory pressure: a reward leaking
            # memory took those down first, and the run blamed the learner (a user's trial, 2026-11-28)
            assert open(f"/proc/{int(pid)}/oom_score_adj").read().strip() == "1000"
    finally:
        r.close()
        helpers.MARK = None


SCRIPT = textwrap.dedent('''
    import json, os, sys, threading, time
    from moe_grpo.reward.functions import Rewards
    from tests.reward.procs import workers_of as _workers_of

    timed_out = Rewards(["tests.reward.hanging_rewards:hangs"], [1.0], timeout_s=0.5)
    s = timed_out.score(["p"], ["a"])
    assert s.failed.all() and "did not return within reward.timeout_s=0.5" in s.errors[0], s.errors
    # A call still hung when the run ends (here in a thread, with a long timeout), and an idle worker.
    hung = Rewards(["tests.reward.hanging_rewards:hangs"], [1.0], timeout_s=600)
    result = []
    thread = threading.Thread(target=lambda: result.append(hung.score(["p"], ["a"])), daemon=True)
    thread.start()
    idle = Rewards(["tests.reward.hanging_rewards:exits"], [1.0])
    assert idle.score(["p"], ["a"]).rewards.tolist() == [1.0]
    time.sleep(0.5)
    out = {"workers": _workers_of(os.getpid())}
    if sys.argv[1] == "close":
        t0 = time.monotonic()
        timed_out.close(); hung.close(); idle.close()
        out["close_s"] = time.monotonic() - t0
        thread.join(5)
        out["hung_errors"] = result[0].errors if result else None
        out["left"] = _workers_of(os.getpid())
    print(json.dumps(out), flush=True)
''')


@pytest.mark.parametrize("end", ["close", "no-close"])
def test_the_process_exits_at_once_with_a_reward_call_hung(tmp_path, end):
    """A script that times a call out, leaves another hung, and returns (after close(), or without): it exits within
    seconds, and none of its workers outlives it."""
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), end], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    took = time.perf_counter() - t0
    assert took < 15.0, f"the script took {took:.1f} s to exit"
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["workers"]) == 2, out  # the hung call's and the idle one's (the timed-out one's was killed)
    if end == "close":
        assert out["close_s"] < 2.0 and out["left"] == [], out
        assert out["hung_errors"] and "closed" in out["hung_errors"][0], out
    deadline = time.monotonic() + 3.0  # reaped by the script itself; an orphan would be its init's to reap
    while any(_alive(p) for p in out["workers"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in out["workers"]), out


KILLED_SCRIPT = textwrap.dedent('''
    import os, sys, threading, time
    from moe_grpo.reward.functions import Rewards
    from tests.reward.procs import workers_of

    def report():
        for _ in range(100):
            time.sleep(0.1)
            if workers_of(os.getpid()):
                time.sleep(0.5)  # the call is in the worker by now
                break
        print(" ".join(map(str, workers_of(os.getpid()))) or "none", flush=True)

    def hang():
        Rewards(["tests.reward.hanging_rewards:hangs"], [1.0], timeout_s=600).score(["p"], ["a"])

    threading.Thread(target=report, daemon=True).start()
    if sys.argv[1] == "main-thread":
        hang()
    else:
        threading.Thread(target=hang, daemon=True).start()
        time.sleep(600)
''')


@pytest.mark.parametrize("started_from", ["main-thread", "other-thread"])
def test_a_worker_dies_with_a_driver_that_is_killed(tmp_path, started_from):
    """SIGKILL to the driver mid-call (nothing of it runs to clean up): its hung worker goes too, by the kernel's
    parent-death signal where the main thread started it, else by its own watch on its parent (within a second or
    two)."""
    script = tmp_path / "run.py"
    script.write_text(KILLED_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), started_from], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
    assert line and line != "none", line
    workers = [int(p) for p in line.split()]
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers), workers


def test_an_unpicklable_row_field_fails_that_call_only_and_a_closed_rewards_fails_by_name():
    fn = f"{HELPERS}:exits"
    r = Rewards([fn], [1.0], timeout_s=10)
    try:
        assert r.score(["p"], ["a"]).rewards.tolist() == [1.0]
        pid = r._lanes[0][0].proc.pid
        s = r.score(["p"], ["a"], {"extra": [lambda: 0]})
        assert s.failed.all() and s.errors[0].startswith(f"{fn}: ") and "pickle" in s.errors[0], s.errors
        assert r.score(["p"], ["a"]).rewards.tolist() == [1.0] and r._lanes[0][0].proc.pid == pid  # same worker
    finally:
        r.close()
    s = r.score(["p"], ["a"])
    assert s.failed.all() and s.errors == [f"{fn}: RuntimeError: the reward functions were closed"]
    assert _workers_of(os.getpid(), fn) == []


@pytest.mark.slow  # waits out reward timeouts
@pytest.mark.parametrize("workers", [1, 3])
def test_other_batches_are_scored_while_a_call_hangs(workers):
    """A hung call holds one worker until its timeout; with `reward.workers` > 1 the batches submitted after it are
    scored meanwhile, each within a fraction of the timeout. With one worker they wait behind it (what every call
    did before scoring moved off the driver's loop: a run's steps took 83-98 s with a reward hanging every third
    call, and the driver declared an idle engine hung)."""
    timeout = 4.0
    r = Rewards([f"{HELPERS}:hangs_if_asked"], [1.0], timeout_s=timeout, workers=workers)
    try:
        for lane in r._lanes:  # every worker started and ready (a fresh interpreter takes a while on a slow machine)
            for w in lane:
                w.send((["p"], ["warm"], {"hang": [False]}, 1))
                w.receive(awake_now() + 120, 120)
        t0 = time.perf_counter()
        hung = r.submit(["p"], ["x"], {"hang": [True]})
        assert time.perf_counter() - t0 < 0.5, "submit returns at once"
        time.sleep(0.2)  # the hung call has its worker
        others = [r.submit(["p", "p"], ["a" * n, "b"], {"hang": [False, False]}) for n in (1, 2, 3, 4)]
        done = [f.result(timeout=3 * timeout) for f in others]
        others_s = time.perf_counter() - t0
        assert [s.rewards.tolist() for s in done] == [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]]
        s = hung.result(timeout=3 * timeout)
        assert s.failed.all() and "did not return within reward.timeout_s=4" in s.errors[0], s.errors
        if workers == 1:  # the one worker was the hung one: everything waited for its timeout
            assert others_s >= timeout and not hung.running()
        else:
            assert others_s < timeout / 2, f"the other batches took {others_s:.2f} s behind a hung call"
    finally:
        r.close()


def test_reward_workers_is_checked():
    from moe_grpo.reward.config import RewardConfig

    assert RewardConfig().workers >= 2, "a hung call must not hold every group by default"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"reward.workers=.*expected an integer >= 1"):
            RewardConfig(workers=bad)
