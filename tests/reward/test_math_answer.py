"""The math-answer reward on math-verify: GSM8K's forms, zero false positives, bad output never raises."""

import os
import sys

import pytest

from moe_grpo.reward.math_answer import answer_text, gsm8k_row_problem, math_answer_reward, reference_answer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from math_cases import CASES  # noqa: E402


@pytest.mark.parametrize("form, completion, reference, right", CASES,
                         ids=[f"{i}-{c[0]}" for i, c in enumerate(CASES)])
def test_each_form_models_emit_is_scored_right(form, completion, reference, right):
    assert math_answer_reward(["q"], [completion], [reference]) == [1.0 if right else 0.0]


def test_no_wrong_answer_is_rewarded_and_the_table_covers_every_form():
    """The table in docs/guides/datasets-rewards.md (tools/math_reward_table.py) is these cases: at least 40, every
    form, zero false positives (a false positive is a reward RL will find and exploit)."""
    assert len(CASES) >= 40
    assert {f for f, *_ in CASES} >= {"plain", "####", "boxed", "fraction", "thousands", "currency", "units",
                                      "bullets", "expression", "no answer"}
    wrong = [c for c in CASES if not c[3]]
    scores = math_answer_reward(["q"] * len(wrong), [c[1] for c in wrong], [c[2] for c in wrong])
    assert [c for c, s in zip(wrong, scores) if s] == []


def test_after_gsm8ks_marker_the_answer_is_the_number_that_follows_it():
    assert answer_text("work...\n#### $1,250.00 in all") == " $1,250.00"
    assert answer_text("#### 4 and 5").strip() == "4"
    assert answer_text("no marker here") == "no marker here"


@pytest.mark.parametrize("garbage", ["\\boxed{\\frac{", "}}}{{{", "\\sqrt[", "#### ", "∞" * 50, "1/0", "\x00\x01"])
def test_bad_model_output_scores_zero_and_never_raises(garbage):
    assert math_answer_reward(["q"], [garbage], ["#### 4"]) == [0.0]


def test_gsm8k_references_and_rows_without_a_final_answer():
    assert reference_answer("48/2 = 24\n48+24 = 72\n#### 72")[0] == 72
    assert reference_answer("#### 1,250")[0] == 1250
    assert gsm8k_row_problem("#### 72") is None
    assert "no '#### N'" in gsm8k_row_problem("seventy-two")
    assert "no number after" in gsm8k_row_problem("#### many")
    # a number alone is a reference too (verl's prepared GSM8K: reward_model.ground_truth = "72")
    assert [gsm8k_row_problem(n) for n in ("72", " 1,250 ", "-3.5", "$12", "3/4")] == [None] * 5
    assert "is not a number" in gsm8k_row_problem("72 apples", "reward_model.ground_truth")
    assert math_answer_reward(["q"] * 2, ["#### 1250", "#### 125"], ["1,250"] * 2) == [1.0, 0.0]
    with pytest.raises(ValueError, match="holds no number"):
        math_answer_reward(["q"], ["1"], ["#### none"])


def test_math_verifys_notice_that_its_own_timeouts_are_off_stays_off_the_console(capfd):
    """Every reward worker of a gsm8k run printed "Timeout is disabled as parsing_timeout is None ... you must
    provide the logic for timeout interuption yourself" (twice per worker, up to 8 lines per run): reward.timeout_s is
    that logic, so nothing there was for a user to act on."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "from moe_grpo.reward.math_answer import math_answer_reward as f; "
                          "print(f(['q'], ['#### 7'], ['#### 7']))"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[1.0]", out
    assert "Timeout is disabled" not in out.stderr, out.stderr
