"""The run's prompts: its dataset or built-in task as a `PromptSource`, checked against the reward and the engines.

Built from the whole run config, so it sits with the orchestrator: which rows are bad depends on the reward (GSM8K's
`#### N` answer, reward/math_answer.py), and the engines' context on the rollout settings (rollout/context.py);
moe_grpo/data/ reads rows and makes examples and knows neither.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from moe_grpo.data.chat import kind, message_problem
from moe_grpo.data.dataset import MISSING, NoUsableRows, Rows, field_value, read_rows
from moe_grpo.data.prompts import DatasetPrompts, PromptSource, TaskPrompts
from moe_grpo.reward.config import TASK_REWARDS
from moe_grpo.reward.math_answer import gsm8k_row_problem
from moe_grpo.rollout.context import context_length

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig
    from moe_grpo.evaluation.config import EvaluateConfig

log = logging.getLogger("moe_grpo")


def required_fields(run: RunConfig | EvaluateConfig) -> list[str]:
    """Fields every row must have: the prompt, and the answer where something reads it (`answer_reader`)."""
    fields = [run.data.resolved_prompt_key(run.task.name)]
    if answer_reader(run) is not None:
        fields.append(run.data.answer_key)
    return fields


def answer_reader(run: RunConfig | EvaluateConfig) -> str | None:
    """What reads each row's answer, said to a dataset refused for lacking it: GSM8K's format, the built-in reward
    (no `reward.fn`) or a warm start; None where nothing does."""
    key = run.data.answer_key
    other = "data.answer_key=FIELD names the field that holds them"
    if run.task.name == "gsm8k":
        return f"task=gsm8k reads each row's {key!r} (its format has one); {other}"
    if not run.reward.fn:
        return f"the built-in reward scores against each row's {key!r}; {other}"
    if getattr(run, "warm_start", 0) > 0:
        return (f"warm_start_steps={run.warm_start} trains on each row's {key!r}; {other}, or warm_start_steps=0 "
                "runs without")
    return None


def prompt_source(run: RunConfig, tokenizer: Any, rng: np.random.Generator, run_dir: str | None = None) -> PromptSource:
    """The run's prompts: `data.train_path` when set, else the built-in task's generator.

    Bad rows are logged with their line numbers and, when `run_dir` is given, listed in `run_dir/bad_rows.txt`."""
    if not run.data.train_path:
        return TaskPrompts(run.task, tokenizer, rng)
    check = _row_check(run)
    needed = required_fields(run)
    why = answer_reader(run)
    train = _or_list_bad_rows(lambda: read_rows(run.data.train_path, needed, check, why=why), run_dir)
    held_out = _or_list_bad_rows(lambda: read_rows(run.data.eval_path, needed, check, why=why), run_dir, train.bad) \
        if run.data.eval_path else None
    refuse_a_second_answer(run, train, held_out)
    source = DatasetPrompts(train, held_out, tokenizer, rng, needed[0], run.data.answer_key, run.data.eval_size,
                            run.data.max_prompt_tokens)
    list_bad_rows(run_dir, source.bad)
    refuse_unusable("train_path", train, source.train, source.bad)
    if held_out is not None:
        refuse_unusable("eval_path", held_out, source.held_out, source.bad)
    held_files = {held_out.path, *held_out.files, *(b.path for b in held_out.bad)} if held_out is not None else set()
    held_out_bad = sum(b.path in held_files for b in source.bad)  # a glob's bad rows name their own files
    log.info("data: %d training rows from %s%s; %d bad row(s) skipped%s", len(source.train), run.data.train_path,
             f", {len(source.held_out)} held-out rows from {run.data.eval_path}" if held_out is not None else "",
             source.bad_rows, f" ({source.bad_rows - held_out_bad} training, {held_out_bad} held-out)"
             if held_out_bad and held_out_bad < source.bad_rows else " (held-out)" if held_out_bad else "")
    return source


def _or_list_bad_rows(read: Callable[[], Rows], run_dir: str | None, earlier: Sequence[Any] = ()) -> Rows:
    """`read()`; a dataset refused for having no usable row still lists its bad rows (after `earlier` ones) in
    run_dir/bad_rows.txt, as a run that goes on does."""
    try:
        return read()
    except NoUsableRows as e:
        list_bad_rows(run_dir, [*earlier, *e.bad])
        raise


def list_bad_rows(run_dir: str | None, bad: Sequence[Any]) -> None:
    """run_dir/bad_rows.txt: each skipped row with its file, line and reason (nothing without `run_dir` or rows)."""
    if run_dir is not None and bad:
        Path(run_dir, "bad_rows.txt").write_text("".join(f"{b}\n" for b in bad))


def refuse_unusable(name: str, rows: Rows, usable: list[Any], bad: list[Any]) -> None:
    """Refuse `data.<name>` when rows were read but none is left after encoding, naming the first one dropped then
    (the chat template refused it, or it is over data.max_prompt_tokens)."""
    if not usable:
        files = set(rows.files) or {rows.path}
        dropped = [b for b in bad if b.path in files and b not in rows.bad]
        raise ValueError(f"data.{name}={rows.path!r}: none of its {len(rows.rows)} readable rows is usable (first: "
                         f"{dropped[0] if dropped else '?'})")


def refuse_a_second_answer(run: RunConfig | EvaluateConfig, *files: Rows | None) -> None:
    """A built-in reward reads its reference from the field `answer`, which is the value at `data.answer_key` unless
    the row has an `answer` of its own (data/prompts.py): refuse that pairing rather than score against the other."""
    key = run.data.answer_key
    builtin = [f for f in run.reward.resolved(run.task.name)[0] if f in TASK_REWARDS.values()]
    if key == "answer" or not builtin:
        return
    for rows in filter(None, files):
        i = next((i for i, row in enumerate(rows.rows) if "answer" in row), None)
        if i is not None:
            file, line = rows.place(i)
            raise ValueError(f"data.answer_key={key!r}, but {file}:{line} also has a field 'answer', where "
                             f"{builtin[0]} would read the reference: rename that field, or set "
                             "data.answer_key=answer")


def _row_check(run: RunConfig | EvaluateConfig) -> Callable[[dict[str, Any]], str | None]:
    """What makes a row bad beyond a missing field: a prompt that is neither text nor chat messages (a number was
    trained on as its Python repr), a malformed message, and under GSM8K an answer without a number."""
    prompt_key, answer_key, gsm8k = run.data.resolved_prompt_key(run.task.name), run.data.answer_key, \
        run.task.name == "gsm8k"

    def check(row: dict[str, Any]) -> str | None:
        prompt = field_value(row, prompt_key)
        if isinstance(prompt, list):
            problem = message_problem(prompt)
            if problem:
                return f"field {prompt_key!r}: {problem}"
        elif prompt is not MISSING and prompt is not None and not isinstance(prompt, str):
            return (f"field {prompt_key!r} is {kind(prompt)} ({str(prompt)[:40]!r}), expected text or a list of chat "
                    "messages")
        return gsm8k_row_problem(field_value(row, answer_key), answer_key) if gsm8k else None

    return check


def held_out_source(run: RunConfig | EvaluateConfig, tokenizer: Any) -> PromptSource:
    """The held-out set alone, as a training run builds it (what `python -m moe_grpo.evaluate` scores): the rows of
    `data.eval_path` (at most `data.eval_size`), else the built-in task's held-out set. `run` needs `task`, `data`
    and `reward`."""
    if not run.data.eval_path:
        return TaskPrompts(run.task, tokenizer, np.random.default_rng(0))
    needed = required_fields(run)
    rows = read_rows(run.data.eval_path, needed, _row_check(run))
    refuse_a_second_answer(run, rows)
    source = DatasetPrompts(Rows(run.data.eval_path), rows, tokenizer, np.random.default_rng(0), needed[0],
                            run.data.answer_key, run.data.eval_size, run.data.max_prompt_tokens)
    refuse_unusable("eval_path", rows, source.held_out, source.bad)
    return source


def engine_context(run: RunConfig, source: PromptSource) -> int:
    """The engines' context (`rollout.max_model_len`, 0 = auto) for this run's prompts; refuses a run whose longest
    prompt plus `rollout.max_tokens` does not fit, naming the numbers (rollout/context.py)."""
    longest, where = source.longest_prompt()
    return context_length(run.rollout, run.model.max_position_embeddings, longest, where,
                          dataset=bool(run.data.train_path))
