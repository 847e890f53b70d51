"""An engine dies or hangs mid-rollout: the run restarts it, sends its prompts again, and finishes its steps.

One run of `python -m moe_grpo.train` (async, one engine, generation the slower
phase so the engine always has requests in flight, and a reward function that
hangs on every third call throughout): its vLLM process is SIGKILLed after step
2, and the restarted one is SIGSTOPped two steps after it is back.
Expected: exit 0, every step logged, two restarts counted, the resubmitted
prompts bounded by what the engine can have in flight (the buffer's capacity),
no completion lost, both failures named in the log, and after the run nothing of
it left in /dev/shm or as a process (the SIGSTOPped one included).
"""

import os
import signal

import pytest

from runs import Run, shm_entries, shm_left_behind

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 12
TIMEOUT_S = 20  # rollout.request_timeout_s: a SIGSTOPped engine is named hung within this


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory):
    shm_before = shm_entries()
    run = Run(tmp_path_factory.mktemp("engine_faults") / "run", f"steps={STEPS}", "mode=async",
              f"rollout.request_timeout_s={TIMEOUT_S}", "checkpoint.every=0",
              "rollout.max_tokens=24",  # longer completions: generation is the slower phase, the engine always busy
              "reward.fn=[faulty_rewards:hang_every_third]", "reward.timeout_s=1")
    try:
        run.wait_step(2)
        first = run.processes()["engines"]["engine0"]
        os.kill(first, signal.SIGKILL)
        run.wait_for("a restarted engine0", lambda: run.processes()["engines"]["engine0"] not in (first, 0), 400)
        second = run.processes()["engines"]["engine0"]
        at = max(r["step"] for r in run.rows())
        run.wait_step(at + 2)
        os.kill(second, signal.SIGSTOP)
        code = run.finish(900)
    except BaseException:
        run.kill()
        raise
    return run, code, (first, second), shm_before


def test_the_run_finishes_every_step_after_a_kill_and_a_hang(faulted_run):
    run, code, _, _ = faulted_run
    assert code == 0, run.output[-4000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["faults/engine_restarts"] == 2, [r["faults/engine_restarts"] for r in rows]


def test_only_the_failed_engines_requests_were_sent_again_and_none_lost(faulted_run):
    run, _, _, _ = faulted_run
    last = run.rows()[-1]
    capacity = 4 * (1 + 1)  # prompts_per_step x (max_staleness + 1): the most an engine can have in flight
    assert 1 <= last["faults/requests_resubmitted"] <= 2 * capacity, last["faults/requests_resubmitted"]
    assert "request(s) in flight are sent again" in run.output
    assert last["faults/requests_lost"] == 0


def test_each_failure_is_named_in_the_log(faulted_run):
    run, _, (first, second), _ = faulted_run
    out = run.output
    assert "engine0" in out and f"process {first} died" in out, out[-4000:]
    assert "hung" in out or f"within {TIMEOUT_S} s" in out, out[-4000:]
    assert "restarting it" in out


def test_nothing_of_the_run_is_left_behind(faulted_run):
    run, _, (first, second), shm_before = faulted_run
    assert not run.leftovers(), run.leftovers()
    for pid in (first, second):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert shm_left_behind(shm_before) == set()
    assert run.shm_left() == [], "the run's own entries, the killed and the hung engine's included"


def test_a_hanging_reward_costs_its_samples_and_never_the_run(faulted_run):
    run, code, _, _ = faulted_run
    assert code == 0
    assert run.rows()[-1]["reward/failed"] > 0
    assert "faulty_rewards:hang_every_third" in run.output and "reward.timeout_s=1" in run.output
    assert not run.leftovers(), run.leftovers()
