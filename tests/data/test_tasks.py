"""The built-in task: the reward depends on the prompt, partial credit, held-out set fixed."""

import numpy as np
import pytest

from moe_grpo.data.tasks import TaskConfig, eval_examples, make_examples, score
from moe_grpo.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer(512)


def test_the_same_completion_scores_differently_on_different_prompts():
    a, b = make_examples(TaskConfig(), TOK, np.random.default_rng(0), 2)
    assert a.answer != b.answer
    rewards = score([a.prompt, b.prompt], [a.answer, a.answer], [a.answer, b.answer])
    assert rewards[0] == 1.0 and rewards[1] < 1.0


@pytest.mark.parametrize("name,letters,want", [("reverse", "abc", "cba"), ("copy", "abc", "abc"), ("sort", "cab", "abc")])
def test_each_task_asks_for_its_own_answer(name, letters, want):
    from moe_grpo.data.tasks import solve

    assert solve(name, letters) == want


def test_partial_credit_counts_positions_over_the_longer_string():
    assert score(["x"], ["cbx"], ["cba"]) == [pytest.approx(2 / 3)]
    assert score(["x"], ["cbaaa"], ["cba"]) == [pytest.approx(3 / 5)]
    assert score(["x"], [""], ["cba"]) == [0.0]


def test_completion_text_stops_at_eos_and_the_held_out_set_is_fixed():
    ids = TOK.encode("dcb", bos=False) + [TOK.eos_id] + TOK.encode("zz", bos=False)
    assert TOK.completion_text(ids) == "dcb"
    assert eval_examples(TaskConfig(), TOK) == eval_examples(TaskConfig(), TOK)
    assert all(e.prompt_ids[0] == TOK.bos_id for e in eval_examples(TaskConfig(), TOK))


def test_bad_task_settings_fail_by_name():
    with pytest.raises(ValueError, match="task.name"):
        TaskConfig(name="translate")
    with pytest.raises(ValueError, match="min_len"):
        TaskConfig(min_len=4, max_len=2)
