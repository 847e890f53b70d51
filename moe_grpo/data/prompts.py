"""Where the driver's prompts come from: the built-in task's generator or a dataset's rows, one interface.

A `PromptSource` (`orchestrator/run_prompts.py` builds the run's from its config): `take(n)` gives
the next `n` training prompts as `Example`s (prompt text, token ids, reference
answer, the row's other fields for the reward), `held_out` the evaluation set,
`bad_rows` how many dataset rows were skipped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moe_grpo.data.chat import MessageDropped, as_text, without_nulls
from moe_grpo.data.dataset import MISSING, BadRow, Rows, field_value, log_skipped
from moe_grpo.data.tasks import MARKERS, Example, eval_examples, make_examples

class PromptSource:
    """Training prompts in order, the held-out set, and the dataset rows skipped."""

    held_out: list[Example]
    bad: list[BadRow]
    rng: np.random.Generator

    def take(self, n: int) -> list[Example]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """Where the source stands (its generator's state, and a dataset's place in its shuffled pass)."""
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]

    def check_resumable(self, state: dict[str, Any]) -> None:
        """Refuse (ValueError) a checkpoint's state this source cannot continue from (a dataset's rows changed)."""

    @property
    def bad_rows(self) -> int:
        return len(self.bad)

    def longest_prompt(self) -> tuple[int, str]:
        """(tokens, where) of the longest prompt this source can give: what the engines' context must hold."""
        examples = self.held_out + list(getattr(self, "train", []))
        if not examples:
            return 0, ""
        e = max(examples, key=lambda x: len(x.prompt_ids))
        return len(e.prompt_ids), e.where

    def probe_set(self, n: int) -> list[Example]:
        """`n` fixed prompts for the mismatch probe: the first of the held-out set (of the training rows when
        there is none; the probe trains on nothing, so either is fine)."""
        return list((self.held_out or getattr(self, "train", []))[:n])


class TaskPrompts(PromptSource):
    """Fresh prompts of a built-in task (data/tasks.py), drawn from the run's generator."""

    def __init__(self, task: Any, tokenizer: Any, rng: np.random.Generator) -> None:
        self.task, self.tokenizer, self.rng = task, tokenizer, rng
        self.held_out = eval_examples(task, tokenizer)
        self.bad = []

    def take(self, n: int) -> list[Example]:
        return make_examples(self.task, self.tokenizer, self.rng, n)

    def longest_prompt(self) -> tuple[int, str]:
        # The generator's longest strings have task.max_len letters; the byte tokenizer gives every string of one
        # length the same number of tokens, a checkpoint's own may not, so the held-out prompts count too.

        letters = (self.task.alphabet * self.task.max_len)[:self.task.max_len]
        generated = len(self.tokenizer.encode(letters + MARKERS[self.task.name]))
        held_out, where = super().longest_prompt()
        return (generated, f"task.max_len={self.task.max_len}") if generated >= held_out else (held_out, where)


class DatasetPrompts(PromptSource):
    """Rows of `data.train_path`, a fresh shuffled order every pass; the held-out set from `data.eval_path`."""

    def __init__(self, train: Rows, held_out: Rows | None, tokenizer: Any, rng: np.random.Generator,
                 prompt_key: str, answer_key: str, eval_size: int | None = None,
                 max_prompt_tokens: int | None = None) -> None:
        """`max_prompt_tokens`: rows whose prompt has more tokens are bad rows (`data.max_prompt_tokens`)."""
        self.tokenizer, self.rng, self.prompt_key, self.answer_key = tokenizer, rng, prompt_key, answer_key
        self.max_prompt_tokens = max_prompt_tokens
        self.bad = train.bad + (held_out.bad if held_out is not None else [])
        train_rows = self._fitting(train, self._examples(train))
        self.train = [e for e, _ in train_rows]
        self._hashed = [row for _, row in train_rows]  # what the fingerprint hashes, beside `train`
        self.held_out = []
        if held_out is not None:
            examples = [e for e, _ in self._fitting(held_out, self._examples(held_out))]
            self.held_out = examples if eval_size is None else examples[:eval_size]
        self._order: list[int] = []
        self._fingerprint: str | None = None

    def _fitting(self, rows: Rows, examples: list[tuple[tuple[str, int], Example, list]]) -> list[tuple[Example, list]]:
        """(example, hashed row) of `examples` (of `rows`, with their places) whose prompt fits `max_prompt_tokens`;
        the others are counted as bad rows."""
        limit = self.max_prompt_tokens
        if limit is None:
            return [(e, row) for _, e, row in examples]
        skipped = [BadRow(*place, f"prompt of {len(e.prompt_ids)} tokens, more than data.max_prompt_tokens={limit}")
                   for place, e, _ in examples if len(e.prompt_ids) > limit]
        log_skipped(skipped, "prompts over data.max_prompt_tokens", rows.path)  # as read_rows logs its bad rows
        self.bad += skipped
        return [(e, row) for _, e, row in examples if len(e.prompt_ids) <= limit]

    def _examples(self, rows: Rows) -> list[tuple[tuple[str, int], Example, list]]:
        """((file, line), example, [the prompt as read, the rest of the row]: what the fingerprint hashes) per row;
        a conversation the chat template refuses or drops a message of is a bad row. Chat prompts with no chat
        template to render them stop the run (every such row would be bad: the configuration's fault)."""
        if not getattr(self.tokenizer, "has_chat_template", False):
            chat = next((i for i, row in enumerate(rows.rows) if isinstance(field_value(row, self.prompt_key), list)),
                        None)
            if chat is not None:
                file, line = rows.place(chat)
                raise ValueError(f"{file}:{line}: the prompt is a list of chat messages and the tokenizer has "
                                 "no chat template to render it (the built-in model's byte tokenizer has none): start "
                                 "from a checkpoint whose tokenizer has one (init.hf=DIR), or give each prompt as text")
        out, refused = [], []
        for i, row in enumerate(rows.rows):
            place = rows.place(i)
            read = field_value(row, self.prompt_key)
            prompt = as_text(without_nulls(read)) if isinstance(read, list) else str(read)
            try:
                ids = self.tokenizer.encode_prompt(prompt)
            except Exception as e:  # noqa: BLE001 - a template's own check (roles must alternate): this row only
                if isinstance(prompt, str):
                    raise
                why = str(e) if isinstance(e, MessageDropped) else \
                    f"the chat template refused it ({type(e).__name__}: {str(e)[:80]})"
                refused.append(BadRow(*place, f"field {self.prompt_key!r}: {why}"))
                continue
            rest = {k: v for k, v in row.items() if k != self.prompt_key}
            hashed = [read if isinstance(read, list) else prompt, rest]  # as read, before nulls were dropped
            out.append((place, self._example(*place, row, prompt, ids), hashed))
        log_skipped(refused, "rows the chat template refused", rows.path)
        self.bad += refused
        return out

    def _example(self, path: str, line: int, row: dict[str, Any], prompt: str | list, ids: list[int]) -> Example:
        """Every field but the prompt goes to the reward; the value at `data.answer_key` (another field's name or a
        dotted path) also as `answer`, the name the built-in rewards read, unless the row has an `answer` of its
        own (kept: run_prompts.py refuses that pairing where a built-in reward would read it)."""
        fields = {k: v for k, v in row.items() if k != self.prompt_key}
        answer = field_value(row, self.answer_key)
        answer = "" if answer is MISSING or answer is None else answer
        if self.answer_key != "answer" and "answer" not in row:
            fields["answer"] = answer
        return Example(prompt, tuple(ids), str(answer), fields, f"{Path(path).name}:{line}")

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = list(self.rng.permutation(len(self.train)))
            out.append(self.train[self._order.pop()])
        return out

    def fingerprint(self) -> str:
        """sha256 of the usable training rows in their order (the prompt's text or messages and the other fields as
        read, not tokens: a tokenizer's or chat template's change leaves the rows the same): what a checkpoint's place
        in the shuffled pass refers to."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for hashed in self._hashed:
                h.update(json.dumps(hashed, sort_keys=True, default=str).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "order": [int(i) for i in self._order], "rows": len(self.train),
                "fingerprint": self.fingerprint()}

    def check_resumable(self, state: dict[str, Any]) -> None:
        """Refuse (ValueError) a checkpoint's place in another dataset's pass: a count of rows that differs, or the
        same count of other rows (before 2026-11-28 accepted silently, the resumed run drawing rows by the old
        order's indices). A checkpoint written before fingerprints is checked by its count only."""
        if state.get("rows", len(self.train)) != len(self.train):
            raise ValueError(f"data.train_path now has {len(self.train)} usable rows, the checkpoint's run had "
                             f"{state['rows']}; resume with the same dataset, or start a fresh run")
        if state.get("fingerprint", self.fingerprint()) != self.fingerprint():
            raise ValueError(f"data.train_path's {len(self.train)} usable rows are not the checkpoint's (sha256 "
                             f"{self.fingerprint()[:12]}, the checkpoint's run {state['fingerprint'][:12]}); resume "
                             "with the same dataset, or start a fresh run")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_resumable(state)
        super().load_state_dict(state)
        self._order = list(state.get("order", []))


def group_fields(example: Example, n: int) -> dict[str, list[Any]]:
    """The row's fields as reward keyword arguments for `n` completions of its prompt (one list per field)."""
    return {k: [v] * n for k, v in example.fields.items()}


def batch_fields(examples: Sequence[Example]) -> dict[str, list[Any]]:
    """Reward keyword arguments for one completion per example; a field some rows lack is None there."""
    keys = list(dict.fromkeys(k for e in examples for k in e.fields))
    return {k: [e.fields.get(k) for e in examples] for k in keys}
