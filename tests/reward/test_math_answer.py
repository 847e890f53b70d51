"""The math-answer reward reads numbers as numbers: separators, signs, decimals, GSM8K's `#### N`."""

import pytest

from moe_grpo.reward.math_answer import completion_answer, gsm8k_row_problem, math_answer_reward, reference_answer


@pytest.mark.parametrize("completion, reference", [
    ("so the total is 1,250", "1000 + 250 = 1250\n#### 1250"),
    ("#### 1250", "#### 1,250"),
    ("The answer is $1,250.00.", "#### 1250"),
    ("\\boxed{-3}", "5 - 8 = -3\n#### -3"),
    ("It is 0.5 of the cake", "#### .5"),
    ("2.50", "#### 2.5"),
    ("first 7, then 12, final answer: 12", "#### 12"),
])
def test_equal_numbers_score_one(completion, reference):
    assert math_answer_reward(["q"], [completion], [reference]) == [1.0]


@pytest.mark.parametrize("completion, reference", [
    ("1,25", "#### 125"),          # not a thousands separator: reads 1
    ("3", "#### -3"),              # the sign counts
    ("12.5", "#### 125"),
    ("no number here", "#### 4"),
    ("#### 4 and 5", "#### 5"),    # after its own ####, the completion's answer is the first number
])
def test_other_numbers_score_zero(completion, reference):
    assert math_answer_reward(["q"], [completion], [reference]) == [0.0]


def test_gsm8k_reference_is_the_number_after_the_last_marker():
    assert reference_answer("48/2 = 24\n48+24 = 72\n#### 72") == 72
    assert reference_answer("#### 1,250") == 1250
    assert completion_answer("we get 3 then 4 so 7") == 7


def test_rows_without_a_final_answer_are_refused_by_reason():
    assert gsm8k_row_problem({"answer": "#### 72"}) is None
    assert "no '#### N'" in gsm8k_row_problem({"answer": "seventy-two"})
    assert "no number after" in gsm8k_row_problem({"answer": "#### many"})
    with pytest.raises(ValueError, match="holds no number"):
        math_answer_reward(["q"], ["1"], ["#### none"])
