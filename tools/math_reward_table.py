"""Prints the math reward's table in docs/guides/datasets-rewards.md: each completion of
tests/reward/math_cases.py scored by the project (moe_grpo/reward/math_answer.py) and by `math-verify` alone (its
default parse of the completion against the reference's final answer), with the false positives of each.

    .venv/bin/python tools/math_reward_table.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "reward"))


def math_verify_alone(completion: str, reference: str) -> bool:
    from math_verify import parse, verify

    try:
        gold = parse(reference.rsplit("####", 1)[-1], parsing_timeout=None)
        return bool(verify(gold, parse(completion, parsing_timeout=None), timeout_seconds=None))
    except Exception:  # noqa: BLE001
        return False


def main() -> None:
    from math_cases import CASES

    from moe_grpo.reward.math_answer import math_answer_reward

    def cell(text: str) -> str:
        return "`" + text.replace("\n", "⏎").replace("|", "\\|") + "`" if text else "(empty)"

    print("| form | completion | reference | right | project | math-verify alone |")
    print("| --- | --- | --- | --- | --- | --- |")
    false_pos = {"project": 0, "alone": 0}
    wrong = {"project": 0, "alone": 0}
    for form, completion, reference, right in CASES:
        ours = math_answer_reward([""], [completion], [reference])[0] == 1.0
        alone = math_verify_alone(completion, reference)
        for name, got in (("project", ours), ("alone", alone)):
            false_pos[name] += got and not right
            wrong[name] += got != right
        print(f"| {form} | {cell(completion)} | {cell(reference)} | {'yes' if right else 'no'} | {int(ours)} | "
              f"{int(alone)} |")
    print(f"\n{len(CASES)} completions. False positives (reward for a wrong answer): project {false_pos['project']}, "
          f"math-verify alone {false_pos['alone']}; scores that disagree with `right`: project {wrong['project']}, "
          f"math-verify alone {wrong['alone']}.")


if __name__ == "__main__":
    main()
