"""Which reward functions score completions (config group `reward`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from moe_grpo.validate import positive

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")

TASK_REWARDS = {
    "reverse": "moe_grpo.data.tasks:score",
    "copy": "moe_grpo.data.tasks:score",
    "sort": "moe_grpo.data.tasks:score",
    "gsm8k": "moe_grpo.reward.math_answer:math_answer_reward",
}
"""The reward each task uses when `reward.fn` is empty."""
BUILT_IN = {
    "moe_grpo.data.tasks:score": "the fraction of the answer's characters in place, 1 only for the exact answer",
    "moe_grpo.reward.math_answer:math_answer_reward": "1 where math-verify finds the completion's answer equal to "
                                                      "the reference, else 0",
}
"""What each built-in reward computes, in the run's start-up line (`RewardConfig.describe`)."""


def _as_tuple(value: Any) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    return tuple(value)


@dataclass(frozen=True)
class RewardConfig:
    """Reward functions: `fn(prompts, completions, **row_fields) -> list[float]`, plain or async."""

    fn: tuple[str, ...] = ()
    """'package.module:function' (one, or a list); empty = the task's own reward (data/tasks.py `score`, or the
    math-answer reward for task.name=gsm8k). Each gets the prompts (as the rows hold them: text or chat messages),
    the completion texts and, as keyword arguments, every other field of the rows (one list per field; `answer` is
    the value at data.answer_key; a function without **kwargs gets only those it names)."""
    weights: tuple[float, ...] = ()
    """One weight per function (the reward is the weighted sum); empty = 1.0 each."""
    timeout_s: float = 30.0
    """A call not back within this many seconds marks its samples failed (`reward/failed`); the run goes on. Each
    function runs in a worker process of its own: a call that times out has its worker killed (a fresh one serves the
    next call), so a hung function holds nothing and never keeps the run from exiting."""
    workers: int = 4
    """Worker processes per function: how many groups are scored at once, off the driver's loop. A hung call holds
    one worker (and costs its own group) until `timeout_s`; the other groups are scored on the others meanwhile, so
    a step waits on a hanging function for about `timeout_s`, not `timeout_s` per hung call. Each worker is a
    Python process that imports the function (about 30-150 MB, more with math-verify's sympy)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fn", tuple(str(f) for f in _as_tuple(self.fn)))
        object.__setattr__(self, "weights", tuple(float(w) for w in _as_tuple(self.weights)))
        for f in self.fn:
            if not _DOTTED.match(f):
                raise ValueError(f"reward.fn={f!r}, expected 'package.module:function'")
        if self.weights and len(self.weights) != len(self.fn):
            raise ValueError(f"reward.weights={list(self.weights)} has {len(self.weights)} entries for "
                             f"{len(self.fn)} reward.fn; expected one weight per function (or none)")
        if any(not math.isfinite(w) for w in self.weights):
            raise ValueError(f"reward.weights={list(self.weights)}, expected finite numbers")
        positive("reward.timeout_s", self.timeout_s)
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"reward.workers={self.workers!r}, expected an integer >= 1")

    def describe(self, task_name: str) -> str:
        """What scores the completions, for the start-up's log line and an evaluation's record: a dataset without
        `task=` or `reward.fn` is scored by the toy tasks' position score, which a user should see named."""
        fns, weights = self.resolved(task_name)
        parts = [f"{w:g} x {fn}" if len(fns) > 1 else fn for fn, w in zip(fns, weights)]
        parts = [f"{p} ({BUILT_IN[fn]})" if fn in BUILT_IN else p for p, fn in zip(parts, fns)]
        return " + ".join(parts) + ("" if self.fn else f" (task {task_name}'s own, no reward.fn given)")

    def resolved(self, task_name: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """(functions, weights) with the task's default filled in."""
        fns = self.fn or (TASK_REWARDS[task_name],)
        return fns, self.weights or (1.0,) * len(fns)
