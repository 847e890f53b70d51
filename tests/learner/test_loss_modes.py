"""The learner with the GRPO family: split-invariant normalisers, R2 routing, the KL reference policy."""

import dataclasses

import pytest
import torch

from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.algo.config import AlgoConfig
from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner


@pytest.fixture(scope="module")
def learner():
    return MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=4, lr=1e-2, seed=3))


def grads(learner):
    return torch.cat([p.main_grad.flatten().clone() for p in learner.module.parameters()])


def with_old_logprobs(learner, seqs, shift=0.05):
    lps = learner.logprobs(seqs, replay=True)
    for i, (s, lp) in enumerate(zip(seqs, lps)):
        s.old_logprobs = lp[s.prompt_len - 1:] + shift * ((-1) ** i)  # a small train-inference gap
    return seqs


@pytest.mark.parametrize("algo", [dict(loss="grpo"), dict(loss="dr_grpo"), dict(loss="cispo"),
                                  # GSPO's preset clip (4e-4) would clip every sequence at this 0.05 gap
                                  dict(loss="gspo", clip_ratio_low=0.2, clip_ratio_high=0.2),
                                  dict(loss="grpo", loss_agg="seq-mean-token-sum", correction="mis",
                                       correction_level="sequence", correction_high=1.1)])
def test_the_loss_and_its_gradient_do_not_depend_on_how_the_batch_is_split_into_microbatches(learner, algo):
    seqs = with_old_logprobs(learner, make_sequences(tiny_spec(), n=4, seed=1))
    loss_fn = AlgoConfig(**algo).token_loss(16)
    out = {}
    for mbs in (4, 1):
        learner.config = dataclasses.replace(learner.config, micro_batch_size=mbs)
        learner.zero_grad()
        out[mbs] = (learner.forward_backward(seqs, replay="r3", loss_fn=loss_fn), grads(learner))
    learner.zero_grad()
    learner.config = dataclasses.replace(learner.config, micro_batch_size=4)
    assert out[1][0]["loss"] == pytest.approx(out[4][0]["loss"], rel=1e-5, abs=1e-7)
    torch.testing.assert_close(out[1][1], out[4][1], rtol=1e-4, atol=1e-7)
    assert out[4][1].abs().sum() > 0


def test_r2_replays_the_routing_the_learner_recorded_even_after_the_weights_move(learner):
    seqs = make_sequences(tiny_spec(), n=4, seed=2)
    mbs = learner._microbatches(seqs, False)
    recorded = learner._record_own_routing(mbs)
    assert len(recorded) == len(mbs) and recorded[0].shape[1:] == (tiny_spec().num_moe_layers, tiny_spec().top_k)
    saved = [layer.mlp.router.weight.data.clone() for layer in learner.module.decoder.layers if hasattr(layer.mlp, "router")]
    try:
        for layer in learner.module.decoder.layers:  # new router weights: free routing now differs
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.data.normal_(0, 1.0)
        learner._run(mbs, replay=False, targets=recorded, forward_only=True, record_free=True, record_used=True,
                     loss_fn=lambda mb, out: (out.sum() * 0.0, {}))
        slots = learner.replayer.slots
        assert learner.replayer.applied_fraction() == 1.0
        for slot in slots:
            torch.testing.assert_close(slot.used[0].to(torch.int64), recorded[0][:, slot.moe_index])
        differ = sum(float((torch.sort(s.free[0], -1).values != torch.sort(recorded[0][:, s.moe_index], -1).values)
                           .any(-1).float().mean()) for s in slots)
        assert differ > 0, "the perturbed routers should prefer other experts; replay must override them"
    finally:
        i = 0
        for layer in learner.module.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.data.copy_(saved[i])
                i += 1


def test_r2_step_applies_replay_everywhere_and_matches_free_routing_on_unchanged_weights(learner):
    seqs = with_old_logprobs(learner, make_sequences(tiny_spec(), n=4, seed=4))
    learner.zero_grad()
    off = learner.forward_backward(seqs, replay="off")
    g_off = grads(learner)
    learner.zero_grad()
    r2 = learner.forward_backward(seqs, replay="r2")
    g_r2 = grads(learner)
    learner.zero_grad()
    assert off["replay/applied"] == 0.0
    # One optimizer step per batch: the recording forward ran on the same weights, so it chose what 'off' chooses.
    assert r2["loss"] == pytest.approx(off["loss"], rel=1e-6)
    torch.testing.assert_close(g_r2, g_off, rtol=1e-5, atol=1e-8)
    with pytest.raises(ValueError, match="replay='r4'"):
        learner.forward_backward(seqs, replay="r4")


def test_kl_penalty_is_zero_against_itself_grows_after_a_step_and_the_reference_forward_leaves_weights_alone():
    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=4, lr=1e-2, seed=7))
    seqs = with_old_logprobs(learner, make_sequences(tiny_spec(), n=4, seed=5), shift=0.0)
    loss_fn = AlgoConfig(kl_coef=0.1).token_loss(16)
    with pytest.raises(ValueError, match="reference policy"):
        learner.forward_backward(seqs, loss_fn=loss_fn)
    learner.zero_grad()
    learner.set_reference()
    first = learner.train_step(seqs, replay="r3", loss_fn=loss_fn)
    assert first["kl/reference"] == pytest.approx(0.0, abs=1e-12)
    before = learner.logprobs(seqs, replay=True)
    second = learner.train_step(seqs, replay="r3", loss_fn=loss_fn)
    assert second["kl/reference"] > 1e-6, "one step away from the reference the KL must be positive"
    # The reference forward swapped weights in and back: the step's own log-probs are the live weights'.
    assert second["train/rollout_kl"] > 0
    after = learner.logprobs(seqs, replay=True)
    assert any(float(abs(a - b).max()) > 1e-4 for a, b in zip(after, before)), "the second step moved the weights"
