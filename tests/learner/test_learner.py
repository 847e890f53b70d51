"""The learner's step on one process: recompute + replay, non-finite guard, checkpoints, config errors."""

import math
import os
import re

import numpy as np
import pytest
import torch

from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner, NonFiniteError
from moe_grpo.models.megatron import MegatronOptions


def router_grads(learner):
    return [layer.mlp.router.weight.main_grad.clone() for layer in learner.module.decoder.layers
            if hasattr(layer.mlp, "router")]


def test_activation_recompute_replays_the_same_ids_in_the_recomputed_forward():
    seqs = make_sequences(tiny_spec(), n=4)
    plain = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, seed=5))
    plain.zero_grad()
    m_plain = plain.forward_backward(seqs, replay=True)
    grads_plain = router_grads(plain)
    plain_calls = plain.replayer.calls

    recomputing = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, seed=5),
                                  options=MegatronOptions(recompute=True))
    recomputing.zero_grad()
    m_rec = recomputing.forward_backward(seqs, replay=True)
    # Every router ran twice per microbatch (forward + recompute) and both used replayed ids.
    assert recomputing.replayer.calls == 2 * plain_calls
    assert all(not s.replay.replay_backward_list for s in recomputing.replayer.slots), "recompute FIFO not drained"
    assert abs(m_rec["loss"] - m_plain["loss"]) < 1e-6
    for a, b in zip(router_grads(recomputing), grads_plain):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert a.abs().sum() > 0


@pytest.fixture(scope="module")
def learner():
    return MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, lr=1e-2))


def test_train_step_changes_the_policy_in_the_advantage_direction(learner):
    seqs = make_sequences(tiny_spec(), n=4)
    for s, a in zip(seqs, (1.0, -1.0, 1.0, -1.0)):
        s.advantage = a
    before = learner.logprobs(seqs, replay=True)
    metrics = learner.train_step(seqs, replay=True)
    after = learner.logprobs(seqs, replay=True)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    gain = [float((a[s.prompt_len - 1:] - b[s.prompt_len - 1:]).mean()) for a, b, s in zip(after, before, seqs)]
    assert gain[0] > 0 and gain[2] > 0, f"positive-advantage completions should become likelier: {gain}"
    assert gain[1] < 0 and gain[3] < 0, f"negative-advantage completions should become less likely: {gain}"


def test_non_finite_loss_stops_the_step_and_leaves_weights_unchanged(learner):
    seqs = make_sequences(tiny_spec(), n=2)
    seqs[0].advantage = float("nan")
    weights = [p.detach().clone() for p in learner.module.parameters()]
    with pytest.raises(NonFiniteError, match="no update") as refused:
        learner.train_step(seqs, replay=True)
    # The driver logs it as "step N skipped (learner: <this>)": a step count of the learner's own (its updates,
    # the warm start's included) read "step 3 skipped (learner: step 5: ...)".
    assert not re.search(r"step \d", str(refused.value)), str(refused.value)
    for w, p in zip(weights, learner.module.parameters()):
        assert torch.equal(w, p)
    # The learner is still usable afterwards.
    seqs[0].advantage = 1.0
    assert math.isfinite(learner.train_step(seqs, replay=True)["loss"])


def test_rollout_logprobs_give_the_mismatch_kl(learner):
    seqs = make_sequences(tiny_spec(), n=2)
    current = learner.logprobs(seqs, replay=True)
    for s, lp in zip(seqs, current):
        s.old_logprobs = lp[s.prompt_len - 1:]
    metrics = learner.forward_backward(seqs, replay=True)
    assert abs(metrics["train/rollout_kl"]) < 1e-6  # same policy: k3 is zero
    for s in seqs:
        s.old_logprobs = s.old_logprobs - 0.1
    metrics = learner.forward_backward(seqs, replay=True)
    expected = math.exp(0.1) - 1 - 0.1  # k3 for a constant log-ratio of 0.1
    assert abs(metrics["train/rollout_kl"] - expected) < 1e-5
    learner.zero_grad()


def test_offpolicy_metrics_count_only_the_stale_sequences(learner):
    """Sequence 0 was sampled by version 0 with log-probs 0.1 off, sequence 1 by the current version 1 exactly:
    the drift shows in `offpolicy/kl` alone, the whole batch's KL is diluted by the fresh tokens."""
    seqs = make_sequences(tiny_spec(), n=2)
    current = learner.logprobs(seqs, replay=True)
    for i, (s, lp) in enumerate(zip(seqs, current)):
        s.old_logprobs = lp[s.prompt_len - 1:] - (0.1 if i == 0 else 0.0)
        s.versions = np.full(len(s.old_logprobs), i)
    metrics = learner.forward_backward(seqs, replay=True, policy_version=1)
    k3 = math.exp(0.1) - 1 - 0.1
    stale, fresh = (len(s.old_logprobs) for s in seqs)
    assert metrics["offpolicy/kl"] == pytest.approx(k3, rel=1e-3)
    assert metrics["offpolicy/stale_fraction"] == pytest.approx(stale / (stale + fresh))
    assert metrics["train/rollout_kl"] == pytest.approx(k3 * stale / (stale + fresh), rel=1e-3)
    assert 0 <= metrics["offpolicy/router_disagreement"] <= 1
    metrics = learner.forward_backward(seqs, replay=True, policy_version=0)  # nothing older than version 0
    assert metrics["offpolicy/stale_fraction"] == 0 and math.isnan(metrics["offpolicy/kl"])
    learner.zero_grad()


def test_the_probe_scores_with_the_published_weights_not_the_current_ones(learner):
    """Rollout log-probs taken with version 7's weights: after another step the probe still finds no gap
    (it scores with the snapshot), while the trained weights differ; the snapshot is used once."""
    seqs = make_sequences(tiny_spec(), n=3, seed=4)
    learner.snapshot_weights(7)
    published = learner.logprobs(seqs, replay=True)
    for s, lp in zip(seqs, published):
        s.old_logprobs = lp[s.prompt_len - 1:]
    learner.train_step(make_sequences(tiny_spec(), n=2, seed=9), replay=True)
    moved = learner.logprobs(seqs, replay=True)
    assert max(float(np.abs(a - b).max()) for a, b in zip(published, moved)) > 1e-4
    result = learner.probe(seqs, 7)
    assert result["kl_replay_on"] < 1e-9, result  # same weights, same (replayed) routing
    assert result["kl_replay_off"] >= 0 and 0 <= result["router_disagreement"] <= 1
    # The traces are random expert choices, not this model's: free routers disagree with most of them.
    assert result["router_disagreement"] > 0.3
    assert learner.probe(seqs, 7) is None, "a version's snapshot serves one probe"
    for a, b in zip(moved, learner.logprobs(seqs, replay=True)):
        np.testing.assert_array_equal(a, b)  # the live weights are back


def test_checkpoint_round_trip_is_exact_and_atomic(learner, tmp_path):
    seqs = make_sequences(tiny_spec(), n=2)
    before = learner.logprobs(seqs, replay=True)
    target = tmp_path / "ckpt"
    learner.save_checkpoint(str(target))
    assert target.is_dir() and not (tmp_path / "ckpt.tmp").exists()
    learner.train_step(seqs, replay=True)
    learner.load_checkpoint(str(target))
    for a, b in zip(before, learner.logprobs(seqs, replay=True)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="no Megatron checkpoint"):
        learner.load_checkpoint(str(tmp_path / "missing"))


def test_bad_learner_settings_are_named():
    with pytest.raises(ValueError, match="lr=-1"):
        LearnerConfig(lr=-1)
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        LearnerConfig(micro_batch_size=0)


def test_the_learner_scores_the_distribution_the_engines_sample_from_at_their_temperature():
    """With rollout.temperature=0.5 every log-prob is of softmax(logits / 0.5), as verl's and TRL's actors compute
    it (the engine reports the same distribution's log-probs): the output layer's logits are divided by it."""
    seqs = make_sequences(tiny_spec(), n=2)
    plain = MegatronLearner(tiny_spec(), config=LearnerConfig(seed=11))
    hot = MegatronLearner(tiny_spec(), config=LearnerConfig(seed=11), temperature=0.5)
    tokens = torch.tensor(seqs[0].tokens[None, :], dtype=torch.long)
    positions = torch.arange(tokens.shape[1])[None, :]
    with torch.no_grad():
        a = plain.module(tokens, positions, attention_mask=None)
        b = hot.module(tokens, positions, attention_mask=None)
    torch.testing.assert_close(b, a / 0.5)
    lp_plain, lp_hot = plain.logprobs(seqs, replay=True)[0], hot.logprobs(seqs, replay=True)[0]
    assert np.abs(lp_plain - lp_hot).max() > 1e-3
    with pytest.raises(ValueError, match="temperature=0"):
        MegatronLearner(tiny_spec(), temperature=0.0)


def _weights(learner):
    return {k: v.detach().clone() for k, v in learner.module.state_dict().items() if isinstance(v, torch.Tensor)}


def _advantaged(n, seed=0):
    seqs = make_sequences(tiny_spec(), n=n)
    rng = np.random.default_rng(seed)
    for s in seqs:
        s.advantage = float(rng.choice([-1.0, 1.0]))
    return seqs


def test_mini_batches_take_one_optimizer_step_per_part_and_r2_replays_the_routing_the_batch_started_with():
    """`algo.mini_batches=2`: two optimizer steps per batch. In r3 that is two train steps on the two halves. In
    r2 both steps replay the routing recorded with the weights the batch started from, which differs from
    re-recording before the second step (the first step moved the routers, lr 0.5): the three learners start
    equal and end where each definition puts them."""
    seqs = _advantaged(8)
    make = lambda: MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, lr=0.5, seed=3))  # noqa: E731
    batch, by_hand, per_step = make(), make(), make()

    m = batch.train_batch(seqs, mini_batches=2, replay="r3")
    assert m["step"] == 2.0 and m["sequences"] == 8.0
    by_hand.train_step(seqs[:4], replay="r3")
    by_hand.train_step(seqs[4:], replay="r3")
    for k, v in _weights(batch).items():
        torch.testing.assert_close(v, _weights(by_hand)[k], rtol=0, atol=0, msg=k)

    r2_seqs = _advantaged(8, seed=1)
    start = [batch._record_own_routing(batch._microbatches(p, False, routing=False)) for p in (r2_seqs[:4], r2_seqs[4:])]
    batch.train_batch(r2_seqs, mini_batches=2, replay="r2")
    for learner in (by_hand, per_step):
        learner.train_step(r2_seqs[:4], replay="r2")
    by_hand.train_step(r2_seqs[4:], replay="r2", r2_targets=start[1])  # the start's routing, as train_batch does
    moved = by_hand._record_own_routing(by_hand._microbatches(r2_seqs[4:], False, routing=False))
    assert any((a != b).any() for a, b in zip(moved, start[1])), "the first step should move some routing"
    per_step.train_step(r2_seqs[4:], replay="r2")  # re-recorded after the first step
    got, want, other = _weights(batch), _weights(by_hand), _weights(per_step)
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    assert any(not torch.equal(got[k], other[k]) for k in got), "re-recording before each step is another method"


def test_more_mini_batches_than_sequences_is_refused(learner):
    with pytest.raises(ValueError, match="mini_batches=5 for 4 sequences"):
        learner.train_batch(make_sequences(tiny_spec(), n=4), mini_batches=5)


def _gloo_loop_threads() -> int:
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(open(path).read().strip())
        except OSError:  # a thread that ended while listing
            pass
    return sum(n == "gloo_tcp_loop" for n in names)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_building_learners_one_after_another_in_a_process_leaves_no_gloo_threads_behind():
    """A test process (or a benchmark) builds many learners: each used to leave ~20 gloo groups, each with a TCP
    loop thread waking constantly, and a suite's process ended up with 1,100 of them thrashing two cores."""
    MegatronLearner(tiny_spec(), config=LearnerConfig(seed=1))
    before = _gloo_loop_threads()
    for seed in range(3):
        MegatronLearner(tiny_spec(), config=LearnerConfig(seed=seed))
    assert _gloo_loop_threads() == before


def test_a_batch_of_very_different_lengths_scores_each_sequence_as_it_scores_alone(learner):
    """Microbatches padded to their own longest (no pipeline stages: learner/batch.py) give every sequence the
    log-probs it gets scored on its own: padding at the end of a row changes nothing before it."""
    spec = tiny_spec()
    seqs = make_sequences(spec, n=6, seed=3)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, spec.vocab_size, size=60)
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.routing.trace import RoutingTrace

    ids = np.stack([np.stack([rng.permutation(spec.num_experts)[: spec.top_k] for _ in range(spec.num_moe_layers)])
                    for _ in range(59)])
    long_ones = [LearnerSequence(tokens, prompt_len=3, routing=RoutingTrace.from_array(ids, spec.num_experts))]
    batch = seqs[:3] + long_ones + seqs[3:]
    together = learner.logprobs(batch, replay=True)
    for s, got in zip(batch, together):
        alone = learner.logprobs([s], replay=True)[0]
        np.testing.assert_allclose(got, alone, atol=2e-6, rtol=0)


def test_routing_traces_of_a_batch_whose_last_microbatch_is_short_are_each_sequences_own(learner):
    """Three sequences at micro_batch_size=2: the second microbatch holds one row (microbatches pad to their own
    longest and hold only their rows). Would have caught: `routing_ids` reshaping every microbatch by the first one's
    row count ("shape '[5, 2, 1]' is invalid for input of size 11"), or reading the wrong rows where it divides."""
    seqs = make_sequences(tiny_spec(), n=3, seed=7)
    traces = learner.routing_traces(seqs, replay=True)["used"]
    for s, got in zip(seqs, traces):
        np.testing.assert_array_equal(np.sort(got.expert_ids, axis=-1), np.sort(s.routing.expert_ids, axis=-1))
