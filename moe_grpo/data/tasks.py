"""Built-in tasks the embedded model can learn on a CPU: the answer is a function of the prompt.

`reverse` (default), `copy` and `sort` take a short string of letters and ask
for it reversed, copied or sorted. The prompt is the letters followed by the
task's marker (`<`, `=`, `^`), the answer ends with <eos>. A model that never
reads the prompt cannot score: the letters are drawn fresh for every prompt,
and the held-out set is drawn from a separate seed (and checked disjoint from
nothing the training stream could repeat: 10 letters, lengths 3-5 give 111k
strings).

Reward (`score`): the fraction of answer positions right, over the longer of
the answer and the completion, so extra or missing letters cost; in [0, 1].
The reward follows the user-reward signature
`fn(prompts, completions, **row_fields) -> list[float]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from moe_grpo.data.tokenizer import ByteTokenizer
from moe_grpo.validate import at_least

MARKERS = {"reverse": "<", "copy": "=", "sort": "^"}
DATASET_TASKS = ("gsm8k",)
"""Tasks that have no generator: their prompts come from `data.train_path` (data/dataset.py)."""


@dataclass(frozen=True)
class TaskConfig:
    """The built-in task (config group `task`)."""

    name: str = "reverse"
    """'reverse', 'copy' or 'sort' the letters the prompt holds (generated prompts, or rows of `data.train_path`
    with an `answer`), or 'gsm8k': rows of `data.train_path` in GSM8K's format (`question`, `answer` ending in
    `#### N`), scored by the math-answer reward (moe_grpo/reward/math_answer.py)."""
    alphabet: str = "abcdefghij"
    """Letters the prompts are drawn from."""
    min_len: int = 3
    """Shortest string of letters in a prompt."""
    max_len: int = 5
    """Longest string of letters in a prompt."""
    eval_size: int = 64
    """Held-out prompts, scored greedily at every evaluation."""
    eval_seed: int = 987654
    """Seed of the held-out set (training prompts come from the run's seed)."""

    def __post_init__(self) -> None:
        if self.name not in MARKERS and self.name not in DATASET_TASKS:
            raise ValueError(f"task.name={self.name!r}, expected one of {sorted(MARKERS) + list(DATASET_TASKS)}")
        if len(set(self.alphabet)) < 2 or any(not c.isalpha() or not c.isascii() for c in self.alphabet):
            raise ValueError(f"task.alphabet={self.alphabet!r}, expected at least 2 distinct ASCII letters")
        at_least("task.min_len", self.min_len, 1)
        at_least("task.max_len", self.max_len, self.min_len, "(task.min_len)")
        at_least("task.eval_size", self.eval_size, 1)
        at_least("task.eval_seed", self.eval_seed, 0)  # numpy's generators refuse negative seeds

    @property
    def max_answer_tokens(self) -> int:
        """Longest answer in tokens (letters + <eos>)."""
        return self.max_len + 1


@dataclass(frozen=True)
class Example:
    """One prompt of a task and what a right answer is."""

    prompt: str | list[dict[str, str]]
    """Prompt text (a task's letters + marker), or a dataset row's chat messages as given (its chat template made
    `prompt_ids`); the reward functions get it as the prompt."""
    prompt_ids: tuple[int, ...]
    """Prompt token ids, <bos> first."""
    answer: str
    """The right completion text (without <eos>); what a warm start teaches ('' when the data has none)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """Fields handed to the reward function as keyword arguments (a dataset row without its prompt field;
    `answer` for the built-in tasks)."""
    where: str = ""
    """Where the prompt came from (`file:line` for a dataset row), for messages."""


def solve(name: str, letters: str) -> str:
    if name == "reverse":
        return letters[::-1]
    if name == "sort":
        return "".join(sorted(letters))
    return letters


def make_examples(cfg: TaskConfig, tokenizer: ByteTokenizer, rng: np.random.Generator, n: int) -> list[Example]:
    """`n` fresh prompts of the task."""
    if cfg.name not in MARKERS:
        raise ValueError(f"task.name={cfg.name!r} has no prompt generator; its prompts come from data.train_path")
    out = []
    letters = np.array(list(cfg.alphabet))
    for _ in range(n):
        length = int(rng.integers(cfg.min_len, cfg.max_len + 1))
        s = "".join(rng.choice(letters, size=length))
        prompt = s + MARKERS[cfg.name]
        answer = solve(cfg.name, s)
        out.append(Example(prompt, tuple(tokenizer.encode(prompt)), answer, {"answer": answer}))
    return out


def eval_examples(cfg: TaskConfig, tokenizer: ByteTokenizer) -> list[Example]:
    """The held-out set: the same for every run of the same task config."""
    return make_examples(cfg, tokenizer, np.random.default_rng(cfg.eval_seed), cfg.eval_size)


def score(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_: Any) -> list[float]:
    """Fraction of answer positions right, over max(len(answer), len(completion)); 1.0 only for an exact answer."""
    del prompts  # the answer already says what the prompt asked
    out = []
    for completion, want in zip(completions, answer):
        completion, want = str(completion), str(want)  # a dataset's answer may be a number (JSON, Parquet)
        longest = max(len(want), len(completion))
        if longest == 0:
            out.append(1.0)
            continue
        right = sum(a == b for a, b in zip(completion, want))
        out.append(right / longest)
    return out


def supervised_sequences(examples: Sequence[Example], tokenizer: Any) -> list[tuple[list[int], int]]:
    """(prompt + answer + <eos> token ids, prompt length) per example: the warm start's data."""
    return [(list(e.prompt_ids) + tokenizer.encode_answer(e.answer), len(e.prompt_ids)) for e in examples]

