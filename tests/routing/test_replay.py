"""Routing replay through megatron-core's RouterReplay, on the real learner (1 process)."""

import numpy as np
import pytest
import torch

from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.routing.replay import ReplayNotAppliedError, check_replay_supported
from moe_grpo.routing.trace import RoutingTrace


@pytest.fixture(scope="module")
def learner():
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    return MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, lr=1e-3))


def set_sorted(trace):
    return np.sort(trace.expert_ids.astype(np.int64), axis=-1)


def test_replay_forces_the_trace_and_router_still_learns(learner):
    spec = tiny_spec()
    seqs = make_sequences(spec, n=6, with_routing=False)
    recorded = learner.routing_traces(seqs, replay=False)["free"]
    for s, t in zip(seqs, recorded):
        t.validate(num_positions=s.num_positions, num_moe_layers=spec.num_moe_layers, top_k=spec.top_k,
                   num_experts=spec.num_experts)
        s.routing = t
    # Perturb every router: free-running routing now departs from the recorded trace.
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in learner.module.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                router.weight.add_(torch.randn(router.weight.shape, generator=gen) * 0.5)
    after = learner.routing_traces(seqs, replay=True)
    free, used = after["free"], after["used"]
    differing = sum(int((set_sorted(f) != set_sorted(r)).any(-1).sum()) for f, r in zip(free, recorded))
    total = sum(r.num_positions * spec.num_moe_layers for r in recorded)
    assert 0 < differing < total, f"perturbed routers should disagree on some (token, layer): {differing}/{total}"
    for u, r in zip(used, recorded):  # with replay: identical on every token and MoE layer
        np.testing.assert_array_equal(set_sorted(u), set_sorted(r))

    learner.train_step(seqs, replay=True)
    for layer in learner.module.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            assert router.weight.main_grad.abs().sum() > 0, "router weight got no gradient under replay"


def test_replay_that_was_not_applied_fails_loudly(learner, monkeypatch):
    spec = tiny_spec()
    seqs = make_sequences(spec, n=2)
    rep = learner.replayer
    original = rep.set_targets

    def only_first_layer(local_ids):
        original(local_ids)
        for slot in rep.slots[1:]:
            slot.replay.clear_router_replay_action()  # as if a hook had been lost

    monkeypatch.setattr(rep, "set_targets", only_first_layer)
    with pytest.raises(ReplayNotAppliedError, match=r"MoE layers \[1, 2\] routed freely"):
        learner.logprobs(seqs, replay=True)


def test_replay_without_a_trace_names_the_sequences(learner):
    seqs = make_sequences(tiny_spec(), n=3, with_routing=False)
    with pytest.raises(ValueError, match=r"sequences \[0, 1, 2\] have none"):
        learner.logprobs(seqs, replay=True)


def test_configs_that_silently_ignore_replay_are_refused():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="moe_router_fusion=True"):
        check_replay_supported(SimpleNamespace(moe_enable_routing_replay=True, moe_router_fusion=True))
    with pytest.raises(ValueError, match="moe_enable_routing_replay=False"):
        check_replay_supported(SimpleNamespace(moe_enable_routing_replay=False))
    check_replay_supported(SimpleNamespace(moe_enable_routing_replay=True, moe_router_fusion=False))


def test_packed_and_padded_batches_give_the_same_logprobs(learner):
    from dataclasses import replace

    seqs = make_sequences(tiny_spec(), n=5)
    padded = learner.logprobs(seqs, replay=True)
    learner.config = replace(learner.config, packed=True, packed_seq_len=32)
    try:
        packed = learner.logprobs(seqs, replay=True)
    finally:
        learner.config = replace(learner.config, packed=False, packed_seq_len=None)
    for a, b in zip(padded, packed):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_trace_that_does_not_fit_its_sequence_is_refused_before_the_forward(learner):
    from moe_grpo.routing.trace import RoutingTraceError

    seqs = make_sequences(tiny_spec(), n=3)
    short = seqs[1].routing.expert_ids[:-1]
    seqs[1].routing = RoutingTrace.from_array(short, tiny_spec().num_experts)
    with pytest.raises(RoutingTraceError, match=r"sequence 1: routing trace positions="):
        learner.logprobs(seqs, replay=True)
