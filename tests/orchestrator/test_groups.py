"""Completions as learner rows (orchestrator/groups.py): the one conversion training and the mismatch probe share."""

from types import SimpleNamespace

import numpy as np
import pytest

from moe_grpo.orchestrator.groups import completion_sequence, learner_sequences
from moe_grpo.routing.trace import RoutingTrace
from moe_grpo.rollout.types import Completion


def _completion() -> Completion:
    routing = RoutingTrace.from_array(np.arange(4 * 2 * 2, dtype=np.int16).reshape(4, 2, 2) % 8, num_experts=8)
    return Completion(np.array([5, 6]), np.array([7, 8, 9]), np.array([-0.5, -1.0, -1.5], np.float32),
                      routing=routing, versions=np.array([3, 3, 4]))


def test_a_completion_becomes_prompt_plus_response_with_its_routing_logprobs_versions_and_advantage():
    """What the learner trains on and what the probe scores: tokens prompt + completion, the prompt's length, the
    engine's routing (replayed), its log-probs (the ratio's denominator) and versions (staleness). Would catch a
    field dropped or taken from the wrong place in the conversion training and the probe both use."""
    c = _completion()
    row = completion_sequence(c, 0.25)
    assert row.tokens.tolist() == [5, 6, 7, 8, 9] and row.prompt_len == 2
    assert row.old_logprobs.tolist() == [-0.5, -1.0, -1.5] and row.versions.tolist() == [3, 3, 4]
    assert row.routing is c.routing and row.advantage == 0.25


def test_every_completion_of_every_group_trains_with_its_own_advantage():
    c1, c2, c3 = _completion(), _completion(), _completion()
    groups = [SimpleNamespace(completions=[c1, c2], advantages=np.array([1.0, -1.0])),
              SimpleNamespace(completions=[c3], advantages=np.array([0.5]))]
    rows = learner_sequences(groups)
    assert [r.advantage for r in rows] == [1.0, -1.0, 0.5]
    assert [r.routing for r in rows] == [c1.routing, c2.routing, c3.routing]


def test_a_reward_failing_on_every_sample_stops_the_run_by_name_and_scattered_failures_do_not():
    """A reward function that raises on every sample (a signature naming a field the rows lack, say) left every
    group unscored; the driver freed each lost group's slot and sampled new prompts forever, with no step, no
    metrics row and no error (a user's trial, 2026-11-28). Now `reward_failure_limit` groups in a row (two batches'
    worth, at least 32) stop the run with an error naming the function and what it raised; a group that scores resets
    the count, so failures scattered between good groups never stop a run."""
    from test_loop import small_run

    from moe_grpo.data.tasks import Example
    from moe_grpo.orchestrator.groups import RewardFailedError, reward_failure_limit, score_group
    from moe_grpo.orchestrator.state import RunState
    from moe_grpo.reward.functions import Rewards

    run = small_run()  # 4 prompts a step, groups of 4
    limit = reward_failure_limit(run)
    assert limit == 32, "small batches get the floor: 2 in a row would stop a run at 50% failures every ~10 groups"
    rewards = Rewards(["user_rewards:length_penalty"], [1.0])
    try:
        example = Example("p", (1,), "", {}, "train.jsonl:3")
        completions = [SimpleNamespace(token_ids=[1, 2])] * 4
        failing = rewards.score(["p"] * 4, ["a"] * 4, {"trap": ["raise"] * 4})
        good = rewards.score(["p"] * 4, ["a", "bb", "ccc", "d"], {"trap": ["none"] * 4})
        state = RunState()
        for _ in range(3):  # scattered: limit - 1 lost groups, then one that scores, again and again
            for _ in range(limit - 1):
                assert score_group(run, example, completions, state, "engine0", rewards, failing) is None
            assert score_group(run, example, completions, state, "engine0", rewards, good) is not None
        assert state.reward_failed == 3 * (limit - 1) * 4
        for _ in range(limit - 1):
            score_group(run, example, completions, state, "engine0", rewards, failing)
        with pytest.raises(RewardFailedError, match=r"user_rewards:length_penalty\) left 32 groups in a row .*"
                                                    r"this row's reward raises on purpose"):
            score_group(run, example, completions, state, "engine0", rewards, failing)
    finally:
        rewards.close()


def test_samples_failing_in_their_engine_on_every_group_stop_the_run_and_scattered_ones_do_not():
    """An engine whose every request fails (a PP=3 engine of the default model: its first stage, dense only,
    recorded no routing, and every request failed "routing captured by 2 of 3 pipeline stages") had its groups
    dropped and new prompts sent forever: no step, no error, until the user's timeout (a user's trial, 2026-11-28).
    Now as many groups in a row as stop a failing reward stop the run, naming the engine and the error; a good
    group resets the count."""
    from test_loop import small_run

    from moe_grpo.data.tasks import Example
    from moe_grpo.orchestrator.groups import SamplesFailedError, drop_failed, reward_failure_limit
    from moe_grpo.orchestrator.state import RunState

    run = small_run()
    limit = reward_failure_limit(run)
    example = Example("p", (1,), "", {}, "train.jsonl:3")
    good = [SimpleNamespace(ok=True, token_ids=[1, 2], error=None, finish_reason="stop")] * 4
    failed = [SimpleNamespace(ok=False, token_ids=[1], error="routing captured by 2 of 3 pipeline stages",
                              finish_reason="error"), *good[1:]]
    state = RunState()
    for _ in range(3):
        for _ in range(limit - 1):
            assert drop_failed(run, failed, example, "engine0", state)
        assert not drop_failed(run, good, example, "engine0", state)
    assert state.requests_lost == 3 * (limit - 1)
    for _ in range(limit - 1):
        drop_failed(run, failed, example, "engine0", state)
    with pytest.raises(SamplesFailedError, match=r"32 groups in a row came back with failed samples .* from engine0: "
                                                 r"routing captured by 2 of 3 pipeline stages"):
        drop_failed(run, failed, example, "engine0", state)


def test_ten_steps_of_groups_without_signal_warn_once_and_a_group_with_signal_resets_the_count(caplog):
    """A run whose reward gives every sample of a prompt the same score trains nothing (advantages 0, loss and
    grad_norm 0) and said nothing about it (a user's trial, 2026-11-28: reward 0 at every step from a random
    checkpoint; a real model with a broken answer format looks the same)."""
    from test_loop import small_run

    from moe_grpo.orchestrator.groups import NO_SIGNAL_STEPS, shape_group
    from moe_grpo.orchestrator.state import RunState

    run = small_run()  # 4 prompts a step, no dynamic sampling
    flat = SimpleNamespace(rewards=np.zeros(4, np.float32), completions=[])
    signal_ = SimpleNamespace(rewards=np.array([0, 1, 0, 0], np.float32), completions=[])
    state = RunState()
    with caplog.at_level("WARNING", logger="moe_grpo"):
        for _ in range(NO_SIGNAL_STEPS * 4 - 1):
            assert shape_group(run, flat, state) is flat
        assert "no signal" not in caplog.text
        shape_group(run, flat, state)
        assert caplog.text.count("no signal: the last 40 groups (10 steps' worth) each gave all their samples the same "
                                 "reward") == 1
        for _ in range(20):
            shape_group(run, flat, state)
        assert caplog.text.count("no signal") == 1, "once, not at every group after"
        shape_group(run, signal_, state)
        for _ in range(NO_SIGNAL_STEPS * 4):
            shape_group(run, flat, state)
        assert caplog.text.count("no signal") == 2, "a group with signal starts the count again"
