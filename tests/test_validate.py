"""The shared range checks: a section built directly in code (not through Hydra, whose values are type-checked
first) still refuses NaN, infinity and booleans where a number is expected, naming the key."""

import math

import pytest

from moe_grpo.learner.config import LearnerConfig
from moe_grpo.orchestrator.config import ClusterConfig, RolloutConfig
from moe_grpo.validate import at_least, between, positive, unknown_key


@pytest.mark.parametrize("build, message", [
    (lambda: RolloutConfig(request_timeout_s=math.inf), "rollout.request_timeout_s=inf: expected a number > 0"),
    (lambda: RolloutConfig(request_timeout_s=math.nan), "rollout.request_timeout_s=nan: expected a number > 0"),
    (lambda: LearnerConfig(lr=math.nan), "learner.lr=nan: expected a number > 0"),
    (lambda: ClusterConfig(num_engines=True), "cluster.num_engines=True: expected an integer >= 1"),
    (lambda: LearnerConfig(micro_batch_size=2.5), "learner.micro_batch_size=2.5: expected an integer >= 1"),
])
def test_sections_built_in_code_refuse_non_finite_and_non_integer_values(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert str(info.value) == message


def test_bounds_are_inclusive_unless_said_open():
    between("x", 0.0, 0.0, 1.0)
    between("x", 1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"x=1.0: expected a number >= 0 and < 1"):
        between("x", 1.0, 0.0, 1.0, high_open=True)
    with pytest.raises(ValueError, match=r"x=0: expected a number > 0"):
        positive("x", 0)
    at_least("n", 0, 0)
    with pytest.raises(ValueError, match=r"n=-1: expected an integer >= 0 \(0 = off\)"):
        at_least("n", -1, 0, "(0 = off)")


def test_an_unknown_key_is_named_with_the_nearest_one_and_its_sections_keys():
    keys = {"algo": {"group_size", "kl_coef"}, "steps": None}
    assert unknown_key("algo.group_size", keys) is None and unknown_key("steps", keys) is None
    assert unknown_key("algo.grup_size", keys) == ("unknown key algo.grup_size (did you mean algo.group_size?); "
                                                   "algo's keys: group_size, kl_coef")
    assert unknown_key("algo.zzz", keys) == "unknown key algo.zzz; algo's keys: group_size, kl_coef"
    assert unknown_key("stepz", keys) == "unknown key stepz (did you mean steps?); `--help` lists every key"
    assert unknown_key("steps.x", keys) is None, "below a plain field: the conversion judges it"
    assert unknown_key("replay", keys, {"replay": "use routing.replay"}) == "use routing.replay"
    nested = {"logger": {"wandb": {"mode", "project"}, "every": None}}
    assert unknown_key("logger.wandb.mode", nested) is None and unknown_key("logger.every", nested) is None
    assert unknown_key("logger.wandb.mod", nested) == (
        "unknown key logger.wandb.mod (did you mean logger.wandb.mode?); logger.wandb's keys: mode, project")
