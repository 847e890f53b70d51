"""User reward functions: dotted paths, row fields as keyword arguments, weights, async, failures as NaN."""

import math
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from moe_grpo.reward.config import RewardConfig
from moe_grpo.reward.functions import Rewards

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "orchestrator"))


def test_fields_arrive_as_keyword_lists_and_weights_add_up(tmp_path, monkeypatch):
    import json

    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("USER_REWARD_LOG", str(log))
    r = Rewards(["user_rewards:length_penalty", "user_rewards:only_answer"], [2.0, 1.0])
    s = r.score(["p", "p"], ["ab", "abcd"], {"answer": ["#### 1", "#### 1"], "trap": ["none", "none"], "id": [7, 7]})
    assert s.rewards.tolist() == pytest.approx([2 * -0.02 + 1.0, 2 * -0.04 + 1.0])
    seen = json.loads(log.read_text())
    assert seen["fields"] == {"answer": ["#### 1", "#### 1"], "trap": ["none", "none"], "id": [7, 7]}
    assert seen["prompts"] == ["p", "p"]


def test_a_function_that_names_its_fields_gets_only_those():
    r = Rewards(["user_rewards:only_answer"], [1.0])
    assert r.score(["p"], ["x"], {"answer": ["a"], "other": [1]}).rewards.tolist() == [1.0]


def test_raise_nan_wrong_length_and_timeouts_mark_samples_failed():
    raising = Rewards(["user_rewards:length_penalty"], [1.0]).score(["p"] * 2, ["a", "b"], {"trap": ["raise"] * 2})
    assert raising.failed.tolist() == [True, True] and "raises on purpose" in raising.errors[0]
    nan = Rewards(["user_rewards:length_penalty"], [1.0]).score(["p"] * 3, ["a", "b", "c"], {"trap": ["nan"] * 3})
    assert nan.failed.tolist() == [True, False, False] and math.isfinite(nan.rewards[1])
    wrong = Rewards(["user_rewards:wrong_length"], [1.0]).score(["p"] * 2, ["a", "b"])
    assert wrong.failed.all() and "1 values for 2 completions" in wrong.errors[0]
    # Strings were counted as "not finite (NaN/inf/None)" and "0.5" silently taken as 0.5 (a user's trial,
    # 2026-11-28): a value that is no number now fails the call, naming it.
    for fn, shown in (("user_rewards:returns_labels", "'good' (str) at position 0"),
                      ("user_rewards:returns_number_strings", "'0.5' (str) at position 0")):
        labels = Rewards([fn], [1.0]).score(["p"] * 2, ["a", "b"])
        assert labels.failed.all() and shown in labels.errors[0], labels.errors
    for fn in ("user_rewards:sleeps", "user_rewards:async_sleeps"):
        t0 = time.perf_counter()
        slow = Rewards([fn], [1.0], timeout_s=0.3).score(["p"], ["a"])
        assert slow.failed.all() and "reward.timeout_s=0.3" in slow.errors[0], fn
        # The function sleeps 30 s; the caller is back after the 0.3 s timeout plus, at most, its worker's start
        # (a fresh interpreter: several seconds on a loaded 2-core machine), never after the function.
        assert time.perf_counter() - t0 < 10, "the caller waited past the timeout"


def test_async_functions_are_awaited():
    assert Rewards(["user_rewards:async_constant"], [2.0]).score(["p"] * 2, ["a", "b"]).rewards.tolist() == [1.0, 1.0]


def test_bad_paths_fail_at_start_by_name():
    with pytest.raises(ImportError, match="cannot import 'no_such_module'"):
        Rewards(["no_such_module:f"], [1.0])
    with pytest.raises(ImportError, match="has no 'missing'"):
        Rewards(["user_rewards:missing"], [1.0])
    with pytest.raises(TypeError, match="expected a function"):
        Rewards(["user_rewards:not_a_function"], [1.0])
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        RewardConfig(fn="user_rewards.length_penalty")
    with pytest.raises(ValueError, match="one weight per function"):
        RewardConfig(fn=["a:f", "b:g"], weights=[1.0])


def test_default_is_the_task_reward():
    assert RewardConfig().resolved("gsm8k") == (("moe_grpo.reward.math_answer:math_answer_reward",), (1.0,))
    assert RewardConfig(fn="a.b:c").resolved("reverse") == (("a.b:c",), (1.0,))
    r = Rewards(*RewardConfig().resolved("gsm8k"))
    assert r.score(["q"], ["#### 1250"], {"answer": ["#### 1,250"]}).rewards.tolist() == [1.0]
    assert np.isnan(r.score(["q"], ["1"], {"answer": ["#### x"]}).rewards).all()


def test_the_reward_in_use_is_named_at_start_the_toy_score_as_what_it_is(caplog):
    """A dataset without `task=` or `reward.fn` is scored by the toy tasks' position score (" 49" scores 0 against
    "49"), and nothing named it: a user's trial took it for a math reward (2026-11-28)."""
    from moe_grpo.orchestrator.session import check_reward_paths
    from moe_grpo.reward.config import RewardConfig

    run = SimpleNamespace(reward=RewardConfig(), task=SimpleNamespace(name="reverse"))
    with caplog.at_level("INFO", logger="moe_grpo"):
        check_reward_paths(run)
    assert ("reward: moe_grpo.data.tasks:score (the fraction of the answer's characters in place, 1 only for the "
            "exact answer) (task reverse's own, no reward.fn given)") in caplog.text
    two = RewardConfig(fn=("user_rewards:length_penalty", "moe_grpo.reward.math_answer:math_answer_reward"),
                       weights=(0.5, 1.0))
    assert two.describe("gsm8k") == ("0.5 x user_rewards:length_penalty + 1 x moe_grpo.reward.math_answer:"
                                     "math_answer_reward (1 where math-verify finds the completion's answer equal to "
                                     "the reference, else 0)")
