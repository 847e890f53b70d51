"""The math-answer reward: a completion's final number against the reference, as numbers, not strings.

`1,250`, `1250`, `1250.00` and `$1,250` are the same answer; `-3` and `0.5`
are read with their sign and decimals. GSM8K references end in `#### N`; the
completion's answer is, in order of preference: the number after its last
`####`, inside its last `\\boxed{...}`, after "answer is", or its last number.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Sequence

# A number with optional sign, thousands separators (1,250 / 1,250,000) and decimals; commas must group 3 digits.
_NUMBER = re.compile(r"(?<![\w.])[-−]?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])[-−]?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*([^\n]*)", re.IGNORECASE)


def parse_number(text: str) -> Decimal | None:
    """The first number in `text` as an exact Decimal (`1,250` -> 1250, `-0.50` -> -0.5), or None."""
    m = _NUMBER.search(text)
    if not m:
        return None
    raw = m.group(0).replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    try:
        return Decimal(raw)
    except InvalidOperation:
        return None


def _last_number(text: str) -> Decimal | None:
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def reference_answer(answer: str) -> Decimal | None:
    """A GSM8K reference: the number after the last `####` (the whole text when there is none)."""
    tail = answer.rsplit("####", 1)[-1]
    return parse_number(tail)


def completion_answer(completion: str) -> Decimal | None:
    """The number a completion gives as its answer (see the module docstring for the order)."""
    if "####" in completion:
        return parse_number(completion.rsplit("####", 1)[-1])
    boxed = _BOXED.findall(completion)
    if boxed:
        return parse_number(boxed[-1])
    stated = _ANSWER_IS.findall(completion)
    if stated:
        value = parse_number(stated[-1])
        if value is not None:
            return value
    return _last_number(completion)


def same_number(a: Decimal | None, b: Decimal | None) -> bool:
    return a is not None and b is not None and a == b


def math_answer_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                       **_: Any) -> list[float]:
    """1.0 where the completion's final number equals the reference's (`#### N`), else 0.0."""
    del prompts
    out = []
    for completion, ref in zip(completions, answer):
        want = reference_answer(str(ref))
        if want is None:
            raise ValueError(f"reference answer {str(ref)[-60:]!r} holds no number")
        out.append(1.0 if same_number(completion_answer(completion), want) else 0.0)
    return out


def gsm8k_row_problem(row: dict[str, Any], answer_key: str = "answer") -> str | None:
    """Why a GSM8K row cannot be scored (its answer has no `#### N`), or None."""
    ans = str(row.get(answer_key, ""))
    if "####" not in ans:
        return f"field {answer_key!r} has no '#### N' final answer"
    if reference_answer(ans) is None:
        return f"field {answer_key!r}: no number after '####' ({ans.rsplit('####', 1)[-1].strip()[:40]!r})"
    return None
