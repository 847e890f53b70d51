"""Scoring what the engines sampled: completion text -> the run's reward functions -> rewards, failures counted."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from moe_grpo.data.prompts import batch_fields, group_fields

log = logging.getLogger("moe_grpo")

MAX_LOGGED = 10
"""Reward failures reported one by one per run; later ones are only counted (`reward/failed`)."""


def _report(rewards: Any, where: str, failed: int, total: int, errors: list[str]) -> None:
    rewards.failures_reported = getattr(rewards, "failures_reported", 0) + 1
    if rewards.failures_reported <= MAX_LOGGED:
        log.warning("reward failed on %d of %d sample(s) of %s: %s%s", failed, total, where, "; ".join(errors)[:500],
                    " (further reward failures are counted in reward/failed, not logged)"
                    if rewards.failures_reported == MAX_LOGGED else "")


def score_group(rewards: Any, tokenizer: Any, example: Any, completions: Sequence[Any]) -> tuple[list[int], np.ndarray, int]:
    """(indices of the samples scored, their rewards, how many failed) for the completions of one prompt."""
    texts = [tokenizer.completion_text(c.token_ids) for c in completions]
    return group_scored(rewards, example, rewards.score([example.prompt] * len(texts), texts,
                                                        group_fields(example, len(texts))))


def submit_group(rewards: Any, tokenizer: Any, example: Any, completions: Sequence[Any]) -> Any:
    """Start scoring one prompt's completions off the caller's thread; a Future of their `Scores`
    (`group_scored` turns it into what `score_group` returns)."""
    texts = [tokenizer.completion_text(c.token_ids) for c in completions]
    return rewards.submit([example.prompt] * len(texts), texts, group_fields(example, len(texts)))


def group_scored(rewards: Any, example: Any, scores: Any) -> tuple[list[int], np.ndarray, int]:
    """(indices of the samples scored, their rewards, how many failed) from one group's `Scores`; failures logged."""
    failed = scores.failed
    if failed.any():
        _report(rewards, example.where or repr(example.prompt[:60]), int(failed.sum()), len(failed), scores.errors)
    kept = [i for i in range(len(failed)) if not failed[i]]
    return kept, scores.rewards[kept], int(failed.sum())


def held_out_rewards(rewards: Any, tokenizer: Any, examples: Sequence[Any],
                     token_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """The reward of one greedy completion per held-out example; a failed reward counts as 0."""
    texts = [tokenizer.completion_text(ids) for ids in token_ids]
    scores = rewards.score([e.prompt for e in examples], texts, batch_fields(examples))
    if scores.failed.any():
        _report(rewards, "the held-out set", int(scores.failed.sum()), len(texts), scores.errors)
    return np.where(scores.failed, 0.0, scores.rewards)


def score_held_out(rewards: Any, tokenizer: Any, examples: Sequence[Any], token_ids: Sequence[Sequence[int]]) -> float:
    """Mean reward of one greedy completion per held-out example (the run's `eval/reward/mean`)."""
    return float(np.mean(held_out_rewards(rewards, tokenizer, examples, token_ids)))
