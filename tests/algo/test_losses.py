"""The GRPO family, its corrections, aggregation and KL penalty against values worked out by hand, gradients included."""

import math

import numpy as np
import pytest
import torch

from moe_grpo.algo.corrections import Correction
from moe_grpo.algo.losses import CISPO, GSPO, LOSSES, PPOClip, PolicyLoss, clipped_surrogate

NONE = Correction("none")


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def _run(loss, logp, old, adv, mask, segments=None, ref=None):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    seg = None if segments is None else torch.tensor(segments)
    value, stats = loss(logp, t(old), t(adv), t(mask), torch.zeros_like(t(mask)), segments=seg,
                        ref_logprobs=None if ref is None else t(ref))
    value.backward()
    return float(value.detach()), logp.grad.flatten().tolist(), {k: float(v) for k, v in stats.items()}


def A(nested):
    """pytest.approx of a nested list, flattened like the gradients `_run` returns."""
    return pytest.approx([v for row in nested for v in row])


def grpo(low=0.2, high=0.2, correction=NONE, **kw):
    return PolicyLoss(PPOClip(low, high), correction, **kw)


# ---------------------------------------------------------------- PPO clip (grpo, dr_grpo, dapo)
def test_inside_the_clip_the_loss_is_minus_ratio_times_advantage_and_its_gradient_too():
    # ratios e^0.1 and e^-0.1 lie inside [0.8, 1.2]; the gradient of -r*A wrt logp is -r*A.
    r1, r2 = math.exp(0.1), math.exp(-0.1)
    loss, grad, stats = _run(grpo(), [[-1.0, -2.0]], [[-1.1, -1.9]], [[1.0, -2.0]], [[1.0, 1.0]])
    assert loss == pytest.approx(-(r1 * 1.0) - (r2 * -2.0))
    assert grad == A([[-r1 * 1.0, -r2 * -2.0]])
    assert stats["clip_fraction"] == 0 and stats["correction/truncated_fraction"] == 0
    assert stats["ratio_mean"] == pytest.approx(r1 + r2)


def test_the_clipped_surrogate_by_hand_values_clip_flags_and_gradients():
    """The one clipped surrogate PPOClip and GSPO share: -min(r A, clip(r) A), flagged where the clip changed r, and
    a gradient only where the unclipped term is the minimum. Would catch the two copies drifting apart (a sign, a
    bound, the flag) since both now call it."""
    ratio = torch.tensor([0.5, 1.0, 1.5, 1.5, 0.5], requires_grad=True)
    advantages = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0])
    per_token, clipped = clipped_surrogate(ratio, advantages, 0.2, 0.3)
    # clip(r) = [0.8, 1.0, 1.3, 1.3, 0.8]: -min(r A, clip(r) A) per token
    assert per_token.tolist() == pytest.approx([-0.5, -1.0, 1.5, -1.3, 0.8])
    assert clipped.tolist() == [True, False, True, True, True]
    per_token.sum().backward()
    assert ratio.grad.tolist() == pytest.approx([-1.0, -1.0, 1.0, 0.0, 0.0]), "no gradient where the clip binds"


def test_positive_advantage_above_the_upper_clip_has_no_gradient():
    loss, grad, stats = _run(grpo(high=0.2), [[-1.0]], [[-1.5]], [[2.0]], [[1.0]])  # r = e^0.5 = 1.65 > 1.2
    assert loss == pytest.approx(-1.2 * 2.0)
    assert grad == A([[0.0]])
    assert stats["clip_fraction"] == 1


def test_dapo_clip_higher_lets_a_ratio_of_1_25_keep_its_gradient():
    r = math.exp(math.log(1.25))
    _, grad_sym, _ = _run(grpo(0.2, 0.2), [[math.log(1.25)]], [[0.0]], [[1.0]], [[1.0]])
    _, grad_dapo, _ = _run(grpo(0.2, 0.28), [[math.log(1.25)]], [[0.0]], [[1.0]], [[1.0]])
    assert grad_sym == A([[0.0]]) and grad_dapo == A([[-r]])


def test_asymmetric_clip_uses_its_own_lower_bound():
    # A < 0 and r below 1 - low: min(r*A, clip*A) = clip*A (constant) -> no gradient.
    loss, grad, _ = _run(grpo(0.1, 0.3), [[-2.0]], [[-1.0]], [[-1.0]], [[1.0]])
    assert loss == pytest.approx(0.9)
    assert grad == A([[0.0]])


def test_masked_tokens_contribute_nothing():
    loss, grad, stats = _run(grpo(), [[-1.0, -3.0]], [[-1.0, -0.1]], [[1.0, 5.0]], [[1.0, 0.0]])
    assert loss == pytest.approx(-1.0)
    assert grad == A([[-1.0, 0.0]])
    assert stats["clip_fraction"] == 0


# ---------------------------------------------------------------- GSPO
def test_gspo_uses_the_length_normalised_sequence_ratio_in_value_and_gradient():
    # One sequence, tokens' log-ratios 0.1 and -0.3: s = exp(mean) = exp(-0.1), inside [1-0.2, 1+0.2].
    loss_fn = PolicyLoss(GSPO(0.2, 0.2), NONE, loss_agg="seq-mean-token-mean")
    s = math.exp(-0.1)
    loss, grad, stats = _run(loss_fn, [[-1.0, -2.0]], [[-1.1, -1.7]], [[2.0, 2.0]], [[1.0, 1.0]])
    assert loss == pytest.approx(-s * 2.0)  # seq-mean-token-mean of the same value s*A on both tokens
    # d/dlogp_t of -(1/2) sum_t s_t A with s_t = sg(s) pi_t / sg(pi_t): -(1/2) s A per token.
    assert grad == A([[-0.5 * s * 2.0, -0.5 * s * 2.0]])
    assert stats["clip_fraction"] == 0


def test_gspo_clips_per_sequence_not_per_token():
    # Token ratios e^0.5 and e^-0.5 would both be clipped token-wise; their geometric mean is 1.
    loss_fn = PolicyLoss(GSPO(3e-4, 4e-4), NONE, loss_agg="seq-mean-token-mean")
    loss, grad, stats = _run(loss_fn, [[0.0, 0.0], [0.0, 0.0]], [[-0.5, 0.5], [-0.5, -0.5]], [[1.0, 1.0], [1.0, 1.0]],
                             [[1.0, 1.0], [1.0, 1.0]])
    # Row 0: s = 1 (in range) -> gradient -(1/2) per token. Row 1: s = e^0.5 > 1 + 4e-4, A > 0 -> clipped, no gradient.
    assert grad == A([[-0.5, -0.5], [0.0, 0.0]])
    assert loss == pytest.approx(-1.0 - (1 + 4e-4))
    assert stats["clip_fraction"] == 2  # both tokens of row 1


# ---------------------------------------------------------------- CISPO
def test_cispo_keeps_the_gradient_of_clipped_tokens_with_a_detached_capped_weight():
    # r = e^0.5 = 1.65 > 1.2: PPO would zero it; CISPO's gradient is -min(r, 1.2) * A.
    loss, grad, stats = _run(PolicyLoss(CISPO(0.2, 0.2), NONE), [[-1.0, -2.0]], [[-1.5, -1.9]], [[2.0, -1.0]],
                             [[1.0, 1.0]])
    w2 = math.exp(-0.1)
    assert loss == pytest.approx(-1.2 * 2.0 * -1.0 - w2 * -1.0 * -2.0)
    assert grad == A([[-1.2 * 2.0, -w2 * -1.0]])
    assert stats["clip_fraction"] == 1


# ---------------------------------------------------------------- corrections
def test_tis_truncates_the_weight_of_a_large_ratio_with_negative_advantage():
    r = math.exp(1.5)  # 4.48 > 2
    loss, grad, stats = _run(grpo(correction=Correction("tis", high=2.0)), [[-0.5]], [[-2.0]], [[-1.0]], [[1.0]])
    # -min(r*A, clip*A) with A=-1 picks the ratio term; TIS makes its weight min(r, 2) = 2, in value and gradient.
    assert loss == pytest.approx(2.0)
    assert grad == A([[2.0]])
    assert stats["correction/truncated_fraction"] == 1 and stats["correction/masked_fraction"] == 0
    _, grad_off, _ = _run(grpo(), [[-0.5]], [[-2.0]], [[-1.0]], [[1.0]])
    assert grad_off == A([[r]])  # without TIS the stale token's weight is the full ratio


def test_sequence_level_tis_weights_every_token_of_the_sequence_by_min_of_the_sequence_ratio_and_the_cap():
    """verl's sequence-level rollout IS and TRL's sequence truncation: every token of a sequence is weighted by
    min(R, C), R = the product of its tokens' ratios, C = correction_high (here 2)."""
    corr = Correction("tis", level="sequence", high=2.0)
    # Sequence 0: log-ratios 0.5 + 0.5 -> R = e > 2: both tokens weigh 2 in all. Sequence 1: ratio 1: weight 1.
    loss, grad, stats = _run(grpo(0.9, 0.9, corr), [[0.0, 0.0], [0.0, 0.0]], [[-0.5, -0.5], [0.0, 0.0]],
                             [[-1.0, -1.0], [-1.0, -1.0]], [[1.0, 1.0], [1.0, 1.0]])
    assert grad == A([[2.0, 2.0], [1.0, 1.0]])
    assert loss == pytest.approx(2 * 2.0 + 2 * 1.0)
    assert stats["correction/truncated_fraction"] == 2
    # One token far likelier to the learner (r = e^2 = 7.4), the other less (e^-1.5): R = e^0.5 = 1.65 < C, so
    # both tokens weigh R; the old per-token form r_t * min(1, C/R) gave the first 7.4, over three times the cap.
    _, grad, stats = _run(grpo(9.0, 9.0, corr), [[2.0, -1.5]], [[0.0, 0.0]], [[-1.0, -1.0]], [[1.0, 1.0]])
    assert grad == A([[math.exp(0.5), math.exp(0.5)]])
    assert max(grad) <= 2.0 and stats["correction/truncated_fraction"] == 0


def test_mis_masks_what_tis_would_truncate_at_token_and_sequence_level():
    logp, old, adv, mask = [[-0.5, -1.0]], [[-2.0, -1.1]], [[-1.0, -1.0]], [[1.0, 1.0]]
    loss, grad, stats = _run(grpo(correction=Correction("mis", high=2.0)), logp, old, adv, mask)
    r2 = math.exp(0.1)
    assert grad == A([[0.0, r2]]) and loss == pytest.approx(r2)
    assert stats["correction/masked_fraction"] == 1 and stats["correction/truncated_fraction"] == 0
    # Sequence level: the product e^1.6 > 2 masks the whole sequence.
    _, grad_seq, stats_seq = _run(grpo(correction=Correction("mis", level="sequence", high=2.0)), logp, old, adv, mask)
    assert grad_seq == A([[0.0, 0.0]]) and stats_seq["correction/masked_fraction"] == 2


def test_icepop_masks_tokens_outside_the_band_on_both_sides():
    # ratios: e^1 = 2.7 (inside [0.5, 5]), e^2 = 7.4 (above), e^-1 = 0.37 (below), 1 (inside)
    loss, grad, stats = _run(grpo(0.9, 0.9, Correction("icepop", low=0.5, high=5.0)), [[1.0, 2.0, -1.0, 0.0]],
                             [[0.0, 0.0, 0.0, 0.0]], [[-1.0, -1.0, -1.0, -1.0]], [[1.0, 1.0, 1.0, 1.0]])
    assert grad == A([[math.e, 0.0, 0.0, 1.0]])
    assert stats["correction/masked_fraction"] == 2


def test_corrections_read_segments_so_packed_rows_hold_several_sequences():
    # One packed row: sequence 0 = positions 0-1 (product ratio e^1.2 > 2 -> masked), sequence 1 = positions 2-3.
    corr = Correction("mis", level="sequence", high=2.0)
    _, grad, _ = _run(grpo(0.9, 0.9, corr), [[0.6, 0.6, 0.0, 0.0]], [[0.0, 0.0, 0.0, 0.0]], [[-1.0] * 4], [[1.0] * 4],
                      segments=[[0, 0, 1, 1]])
    assert grad == A([[0.0, 0.0, 1.0, 1.0]])


# ---------------------------------------------------------------- aggregation
def _agg(mode, segments=None):
    # Sequence a: 3 tokens of A = -1 at ratio 1 (loss 1 each); sequence b: 1 token of A = -2 (loss 2).
    loss_fn = grpo(loss_agg=mode, max_response_tokens=4)
    logp = [[0.0, 0.0, 0.0, 0.0]] if segments else [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    adv = [[-1.0, -1.0, -1.0, -2.0]] if segments else [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]
    mask = [[1.0] * 4] if segments else [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    return loss_fn, _run(loss_fn, logp, logp, adv, mask, segments=segments)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode,numerator,normaliser,grad_a,grad_b", [
    ("token-mean", 5.0, "tokens", 1.0, 2.0),                       # / 4 tokens
    ("seq-mean-token-sum", 5.0, "sequences", 1.0, 2.0),            # / 2 sequences
    ("seq-mean-token-mean", 1.0 + 2.0, "sequences", 1 / 3, 2.0),   # per-sequence means
    ("seq-mean-token-sum-norm", 5.0 / 4, "sequences", 0.25, 0.5),  # / L = 4
])
def test_loss_agg_numerators_and_normalisers(packed, mode, numerator, normaliser, grad_a, grad_b):
    loss_fn, (loss, grad, _) = _agg(mode, [[0, 0, 0, 1]] if packed else None)
    assert loss_fn.normaliser == normaliser
    assert loss == pytest.approx(numerator)
    assert grad[:3] == pytest.approx([grad_a] * 3) and grad[3] == pytest.approx(grad_b)


# ---------------------------------------------------------------- KL penalty
def test_kl_penalty_k1_and_k3_values_and_gradients():
    logp, ref = [[-1.0, -2.0]], [[-1.5, -1.0]]
    d = [-0.5, 1.0]  # log(pi_ref / pi)
    zero_adv = [[0.0, 0.0]]
    k1 = grpo(kl_coef=0.1, kl_estimator="k1")
    loss, grad, stats = _run(k1, logp, logp, zero_adv, [[1.0, 1.0]], ref=ref)
    assert loss == pytest.approx(0.1 * sum(-x for x in d)) and grad == A([[0.1, 0.1]])
    assert stats["kl/reference"] == pytest.approx(-sum(d))
    k3 = grpo(kl_coef=0.1, kl_estimator="k3")
    loss, grad, stats = _run(k3, logp, logp, zero_adv, [[1.0, 1.0]], ref=ref)
    assert loss == pytest.approx(0.1 * sum(math.exp(x) - 1 - x for x in d))
    # d/dlogp (e^d - 1 - d) with d = ref - logp: -e^d + 1
    assert grad == A([[0.1 * (1 - math.exp(x)) for x in d]])
    assert "kl/reference" not in grpo().stat_keys
    with pytest.raises(ValueError, match="ref_logprobs"):
        _run(k3, logp, logp, zero_adv, [[1.0, 1.0]])


# ---------------------------------------------------------------- config
def test_mismatched_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="advantages"):
        grpo()(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3), torch.zeros(1, 2), torch.zeros(1, 2))


def test_every_configurable_loss_name_has_a_loss_and_bad_names_fail():
    from moe_grpo.algo.config import LOSS_NAMES, AlgoConfig

    assert set(LOSS_NAMES) == set(LOSSES)
    for name, value in [("loss", "ppo2"), ("loss_agg", "mean"), ("correction", "clip"), ("kl_estimator", "k2"),
                        ("correction_level", "batch")]:
        with pytest.raises(ValueError, match=f"algo.{name}"):
            AlgoConfig(**{name: value})
    with pytest.raises(ValueError, match="icepop"):
        AlgoConfig(correction="icepop", correction_level="sequence")


def test_presets_fill_what_the_user_left_and_user_values_win():
    from moe_grpo.algo.config import AlgoConfig

    dr = AlgoConfig(loss="dr_grpo")
    assert (dr.normalize_std, dr.loss_agg) == (False, "seq-mean-token-sum-norm")
    dapo = AlgoConfig(loss="dapo")
    assert (dapo.clip_ratio_low, dapo.clip_ratio_high, dapo.dynamic_sampling) == (0.2, 0.28, True)
    assert dapo.overlong_buffer_tokens(20) == 4
    assert AlgoConfig(loss="dapo", clip_ratio_high=0.3).clip_ratio_high == 0.3
    assert AlgoConfig(correction="icepop").correction_high == 5.0
    built = AlgoConfig(loss="gspo").token_loss(16)
    assert isinstance(built.objective, GSPO) and built.loss_agg == "seq-mean-token-mean"
    assert AlgoConfig(loss="dr_grpo").token_loss(16).max_response_tokens == 16


# ---------------------------------------------------------------- advantages and DAPO's reward pieces
def test_advantages_with_and_without_std_normalisation():
    from moe_grpo.algo.advantages import group_relative_advantages

    r = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    assert group_relative_advantages(r, normalize_std=False).tolist() == [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]]
    # verl and TRL divide by the sample std (ddof 1): sqrt(4 * 0.25 / 3) = 0.5774, so +-0.5 / (0.5774 + 1e-6);
    # the population std (0.5) would give +-1, sqrt(G / (G - 1)) = 1.155 times larger.
    sample_std = math.sqrt(((1 - 0.5) ** 2 * 4) / 3)
    assert group_relative_advantages(r)[0] == pytest.approx([0.5 / (sample_std + 1e-6)] * 1 + [-0.5 / (sample_std + 1e-6)] * 2
                                                            + [0.5 / (sample_std + 1e-6)], rel=1e-6)
    assert group_relative_advantages(r)[1].tolist() == [0, 0, 0, 0]
    g8 = np.array([[1.0, 0, 0, 0, 1, 1, 0, 1]])
    assert group_relative_advantages(g8)[0, 0] == pytest.approx(0.5 / (np.std(g8, ddof=1) + 1e-6), rel=1e-6)


def test_overlong_penalty_by_hand_and_the_dynamic_sampling_filter():
    from moe_grpo.algo.shaping import carries_signal, overlong_penalty

    got = overlong_penalty(np.array([10, 16, 17, 18, 20, 25]), max_tokens=20, buffer=4, penalty=1.0)
    assert got.tolist() == pytest.approx([0, 0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(np.array([20]), max_tokens=20, buffer=0).tolist() == [0.0]
    assert not carries_signal(np.array([0.5, 0.5, 0.5])) and carries_signal(np.array([0.5, 0.5, 0.25]))
