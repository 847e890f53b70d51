"""pass@k against its definition (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), and what it must refuse."""

from math import comb

import pytest

from moe_grpo.evaluation.pass_at_k import pass_at_k


@pytest.mark.parametrize("n,c,k", [(8, 0, 1), (8, 1, 1), (8, 3, 4), (8, 5, 4), (8, 8, 8), (10, 2, 5), (200, 7, 100)])
def test_matches_the_combinatorial_definition(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_values_a_user_can_check_by_hand():
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)  # pass@1 is the fraction correct
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 3 of the 6 pairs hold the correct sample
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0


def test_refuses_impossible_counts():
    with pytest.raises(ValueError, match="k=9 with n=8 samples, expected 1 <= k <= n"):
        pass_at_k(8, 1, 9)
    with pytest.raises(ValueError, match="c=9 correct of n=8 samples"):
        pass_at_k(8, 9, 1)
