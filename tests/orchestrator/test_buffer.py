"""The rollout buffer: bounded, FIFO, and no group with a token older than max_staleness comes out."""

import numpy as np
import pytest

from moe_grpo.orchestrator.buffer import Group, RolloutBuffer
from moe_grpo.rollout.types import Completion


def group(*token_versions):
    comps = [Completion(np.array([1, 5]), np.array([7] * len(v)), np.zeros(len(v), np.float32), None,
                        np.array(v, np.int64), "stop") for v in token_versions]
    return Group(example=None, completions=comps, rewards=np.zeros(len(comps), np.float32))


def test_take_drops_groups_with_any_token_older_than_the_bound_and_counts_them():
    buf = RolloutBuffer(capacity=8, max_staleness=1)
    buf.put(group([3, 3], [3]))        # fine for version 4
    buf.put(group([2, 3], [4]))        # one token of version 2: too old for version 4
    buf.put(group([4], [4, 5]))
    taken = buf.take(2, trained_version=4)
    assert [g.oldest_version for g in taken] == [3, 4]
    assert buf.dropped_stale == 1 and len(buf) == 0


def test_take_returns_none_until_a_whole_batch_is_ready():
    buf = RolloutBuffer(capacity=4, max_staleness=0)
    buf.put(group([0]))
    assert buf.take(2, trained_version=0) is None
    buf.put(group([0]))
    assert len(buf.take(2, trained_version=0)) == 2


def test_capacity_bounds_what_is_buffered_and_in_flight():
    buf = RolloutBuffer(capacity=3, max_staleness=2)
    buf.put(group([0]))
    assert buf.room(in_flight=2) == 0
    buf.put(group([0]))
    buf.put(group([0]))
    with pytest.raises(OverflowError, match="full"):
        buf.put(group([0]))
