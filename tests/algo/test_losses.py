"""The GRPO token loss against values worked out by hand, gradients included."""

import math

import pytest
import torch

from moe_grpo.algo.losses import GRPOLoss


def _run(logp, old, adv, mask, **kw):
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    loss, stats = GRPOLoss(**kw)(logp, t(old), t(adv), t(mask), torch.zeros_like(t(mask)))
    loss.backward()
    return float(loss), logp.grad.tolist(), {k: float(v) for k, v in stats.items()}


def test_inside_the_clip_the_loss_is_minus_ratio_times_advantage_and_its_gradient_too():
    # ratios e^0.1 and e^-0.1 lie inside [0.8, 1.2]; the gradient of -r*A wrt logp is -r*A.
    r1, r2 = math.exp(0.1), math.exp(-0.1)
    loss, grad, stats = _run([-1.0, -2.0], [-1.1, -1.9], [1.0, -2.0], [1.0, 1.0])
    assert loss == pytest.approx(-(r1 * 1.0) - (r2 * -2.0))
    assert grad == pytest.approx([-r1 * 1.0, -r2 * -2.0])
    assert stats["clip_fraction"] == 0 and stats["tis_truncated_fraction"] == 0


def test_positive_advantage_above_the_upper_clip_has_no_gradient():
    r = math.exp(0.5)  # 1.65 > 1 + 0.2
    loss, grad, stats = _run([-1.0], [-1.5], [2.0], [1.0], clip_ratio_high=0.2, tis_clip=0)
    assert loss == pytest.approx(-1.2 * 2.0)
    assert grad == pytest.approx([0.0])
    assert stats["clip_fraction"] == 1
    del r


def test_asymmetric_clip_uses_its_own_lower_bound():
    # A < 0 and r below 1 - low: min(r*A, clip*A) = clip*A (constant) -> no gradient.
    loss, grad, _ = _run([-2.0], [-1.0], [-1.0], [1.0], clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert loss == pytest.approx(0.9)
    assert grad == pytest.approx([0.0])


def test_tis_truncates_the_gradient_weight_of_a_large_ratio_with_negative_advantage():
    r = math.exp(1.5)  # 4.48 > tis_clip 2
    loss, grad, stats = _run([-0.5], [-2.0], [-1.0], [1.0], tis_clip=2.0)
    # -min(r*A, clip*A) with A=-1 picks the ratio term; TIS caps that ratio (value and gradient) at 2.
    assert loss == pytest.approx(2.0)
    assert grad == pytest.approx([2.0])
    assert stats["tis_truncated_fraction"] == 1
    _, grad_off, _ = _run([-0.5], [-2.0], [-1.0], [1.0], tis_clip=0)
    assert grad_off == pytest.approx([r])  # without TIS the stale token's weight is the full ratio


def test_masked_tokens_contribute_nothing():
    loss, grad, stats = _run([-1.0, -3.0], [-1.0, -0.1], [1.0, 5.0], [1.0, 0.0])
    assert loss == pytest.approx(-1.0)
    assert grad == pytest.approx([-1.0, 0.0])
    assert stats["clip_fraction"] == 0


def test_mismatched_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match="advantages"):
        GRPOLoss()(torch.zeros(2), torch.zeros(2), torch.zeros(3), torch.zeros(2), torch.zeros(2))


def test_every_configurable_loss_name_has_a_loss_and_bad_names_fail():
    from moe_grpo.algo.config import LOSS_NAMES, AlgoConfig
    from moe_grpo.algo.losses import LOSSES

    assert set(LOSS_NAMES) == set(LOSSES)
    with pytest.raises(ValueError, match="algo.loss"):
        AlgoConfig(loss="ppo2")
