"""Completions as learner rows (orchestrator/groups.py): the one conversion training and the mismatch probe share."""

from types import SimpleNamespace

import numpy as np

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
