"""The math-answer reward: Hugging Face's `math-verify` parses and compares, with what GSM8K needs on top.

`math-verify` (the library TRL, verl and open-r1 use) finds a completion's
answer (a `\\boxed{}` first, then the last expression), reads LaTeX (fractions,
`{,}` thousands separators), currency and units, and compares mathematically
(`0.75` == `\\frac{3}{4}`, `1,250` == 1250). On top of it, for GSM8K:

- a completion that writes GSM8K's `#### N` is scored on the number right
  after its last `####` (what follows, e.g. "and 5" or "wait, 73", is not its
  answer);
- a mixed number `2 1/2` is read as 2 + 1/2 (math-verify reads it as 2 * 1/2);
- the reference is the number after the last `####` of the dataset's answer, or the answer itself when it is
  a number alone (verl's prepared GSM8K).

Bad model output never raises (it scores 0); a reference that holds no number
is a bad row (`gsm8k_row_problem` at load time; `ValueError` naming it here).
`math-verify`'s own timeouts use SIGALRM, which only the main thread may set;
they are off here: the reward worker's `reward.timeout_s` bounds every call.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Sequence

_MIXED_NUMBER = re.compile(r"(?<![\d.,/])(\d+)\s+(\d+)/(\d+)(?![\d/])")
_LEADING_NUMBER = re.compile(r"\s*[-\u2212]?\s*[$\u20ac\u00a3]?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")
"""GSM8K's final answer after `####`: a number with its sign, currency, separators, decimals, or a fraction."""
_BARE_NUMBER = re.compile(r"[-\u2212]?\s*[$\u20ac\u00a3]?\s*\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?")
"""A reference that is a number alone (no `####`): the same forms."""


def _not_the_timeout_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Timeout is disabled")


# math-verify warns once per process that its own timeouts are off, "you must provide the logic for timeout
# interruption yourself": here every reward worker did (up to 8 lines on a gsm8k run's console). That logic is
# reward.timeout_s (the module's docstring); nothing for a user to act on.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_the_timeout_notice)


def _normalize(text: str) -> str:
    text = text.replace("\u2212", "-")  # the Unicode minus sign models copy from LaTeX renderings
    return _MIXED_NUMBER.sub(r"(\1 + \2/\3)", text)


def _parse(text: str) -> list[Any]:
    from math_verify import parse

    try:
        return parse(_normalize(text), parsing_timeout=None)
    except Exception:  # noqa: BLE001 - math-verify raises on some malformed LaTeX; bad output scores 0
        return []


def answer_text(completion: str) -> str:
    """The part of a completion its answer is read from: the number right after its last `####` (its first line if
    no number starts it), else all of it."""
    if "####" in completion:
        tail = completion.rsplit("####", 1)[-1]
        lead = _LEADING_NUMBER.match(tail)
        return lead.group(0) if lead else (tail.strip().splitlines() or [""])[0]
    return completion


def reference_answer(answer: str) -> list[Any]:
    """A GSM8K reference (the text after the last `####`, the whole text when there is none), parsed; [] when it
    holds no number or expression."""
    return _parse(answer.rsplit("####", 1)[-1])


def completion_answer(completion: str) -> list[Any]:
    """The completion's answer as math-verify parses it ([] when it gives none)."""
    return _parse(answer_text(completion))


def is_correct(completion: str, reference: str) -> bool:
    """Whether the completion's answer equals the reference's, mathematically; raises ValueError when the
    reference holds no answer (a bad row)."""
    from math_verify import verify

    want = reference_answer(reference)
    if not want:
        raise ValueError(f"reference answer {reference[-60:]!r} holds no number")
    got = completion_answer(completion)
    if not got:
        return False
    try:
        return bool(verify(want, got, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - sympy can fail on odd expressions; no answer is a wrong answer
        return False


def math_answer_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str],
                       **_: Any) -> list[float]:
    """1.0 where the completion's answer equals the reference's (`#### N`), else 0.0."""
    del prompts
    return [1.0 if is_correct(str(completion), str(ref)) else 0.0 for completion, ref in zip(completions, answer)]


def gsm8k_row_problem(answer: Any, answer_key: str = "answer") -> str | None:
    """Why a GSM8K row's answer (the value at `answer_key`) cannot be scored, or None: it needs GSM8K's `#### N`
    or to be a number alone (verl's prepared GSM8K keeps the bare number in `reward_model.ground_truth`)."""
    ans = str(answer)
    if "####" not in ans:
        if _BARE_NUMBER.fullmatch(ans.strip()):
            return None
        return f"field {answer_key!r} has no '#### N' final answer and is not a number"
    if not reference_answer(ans):
        return f"field {answer_key!r}: no number after '####' ({ans.rsplit('####', 1)[-1].strip()[:40]!r})"
    return None
