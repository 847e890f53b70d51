"""What `python -m moe_grpo.train` prints last (moe_grpo/command_line.py)."""

import math

from moe_grpo.command_line import closing_line, part_failed

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


def test_a_part_failing_past_repair_ends_the_run_in_one_line_with_the_traceback_in_its_log(tmp_path, capsys):
    """An engine that could not start crossed Ray as its whole traceback, and the run ended in Hydra's "Error
    executing job" and ~30 lines of the driver's own stack (a trial with rollout.kv_cache_gib=200, 2026-11-28)."""
    import ray

    from moe_grpo.orchestrator.groups import RewardFailedError
    from moe_grpo.orchestrator.learner_group import LearnerFailedError
    from moe_grpo.rollout.engine_error import EngineError

    log = str(tmp_path / "train.log")
    in_actor = EngineError("engine engine0: vLLM failed to start on /r/model_v0: ValueError: Available memory on "
                           "node 0 (14.35/16.46 GiB) ...")
    crossed_ray = ray.exceptions.RayTaskError("EngineWorker.start", "Traceback ...\n  File x.py\n", in_actor,
                                              proctitle="ray::EngineWorker.start()").as_instanceof_cause()
    assert isinstance(crossed_ray, EngineError), "what the driver catches"
    assert part_failed(crossed_ray, log) == 1
    assert capsys.readouterr().err == ("[moe_grpo] stopped: engine engine0: vLLM failed to start on /r/model_v0: "
                                       f"ValueError: Available memory on node 0 (14.35/16.46 GiB) ...; the run's log: {log}\n")
    assert "EngineWorker.start" in (tmp_path / "train.log").read_text(), "the whole error is kept in the log"
    assert part_failed(LearnerFailedError("learner rank 1 (pid 7) died during step 4; last checkpoint: step_000002"),
                       log) == 1
    assert capsys.readouterr().err.startswith("[moe_grpo] stopped: learner rank 1 (pid 7) died during step 4; last "
                                              "checkpoint: step_000002; the run's log: ")
    # A reward's error of several lines is said whole, on one line (not its last line alone).
    part_failed(RewardFailedError("the reward functions (my.reward) left 8 groups ...; last error: my.reward: "
                                  "ValueError: could not parse\nexpected '#### <n>'"), log)
    assert "last error: my.reward: ValueError: could not parse expected '#### <n>'; the run's log" in \
        capsys.readouterr().err
