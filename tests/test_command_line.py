"""What `python -m moe_grpo.train` prints last (moe_grpo/command_line.py)."""

import math

from moe_grpo.command_line import closing_line

FAULTS = {"requests_lost": 0, "steps_skipped": 0, "sync_failures": 0, "engine_restarts": 1,
          "requests_resubmitted": 3, "rollbacks": 0}


def _summary(**kw):
    return {"steps": 300, "resumed_from": None, "seconds": 276.0, "eval_start": 0.756, "eval_end": 0.9,
            "faults": dict.fromkeys(FAULTS, 0), **kw}


def test_a_fresh_run_says_its_steps_time_rewards_and_record():
    assert closing_line(_summary(), "async", "/runs/a") == (
        "[moe_grpo] 300 steps in 4.6 min (async); held-out reward 0.756 at step 0 -> 0.900 at the end; "
        "record in /runs/a")


def test_one_step_is_one_step():
    assert closing_line(_summary(steps=1), "async", "/r").startswith("[moe_grpo] 1 step in 4.6 min (async);")


def test_a_resumed_run_says_how_many_steps_this_process_took_in_its_time():
    """Would have caught: a run resumed at step 200 closing with "300 steps in 1.5 min", as if it had taken all
    300 in that time."""
    line = closing_line(_summary(resumed_from=200, seconds=90.0), "async", "/runs/a")
    assert line.startswith("[moe_grpo] 300 steps, 100 of them in 1.5 min after resuming at step 200 (async);"), line


def test_faults_survived_are_named_and_an_unmeasured_reward_says_so():
    line = closing_line(_summary(faults=FAULTS, eval_start=math.nan, eval_end=None), "sync", "/r")
    assert "; no held-out reward measured;" in line, line
    assert "held-out reward 0.756 at step 0 -> not measured at the end" in closing_line(_summary(eval_end=None), "a", "r")
    assert "faults survived: engine_restarts 1, requests_resubmitted 3; record in /r" in line
