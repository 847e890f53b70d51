"""What the driver does with one prompt's completions: score them, shape them (DAPO), turn groups into learner rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_grpo.algo.advantages import group_relative_advantages
from moe_grpo.algo.shaping import carries_signal, overlong_penalty
from moe_grpo.orchestrator.buffer import Group
from moe_grpo.reward.scoring import group_scored
from moe_grpo.rollout.types import SamplingSettings

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig
    from moe_grpo.evaluation.config import EvaluateConfig

log = logging.getLogger("moe_grpo")

REWARD_FAILURE_PATIENCE = 2
"""The run stops once this many batches' worth of groups in a row (and at least `REWARD_FAILURE_MIN_GROUPS`) were
left by the reward functions with fewer than two scored samples: a reward that fails on every sample (a wrong
signature, a field the rows lack, a value that is no number) would otherwise sample new prompts forever without a
step. Scattered failures do not reach it: at half the samples failing, a group of 8 keeps two or more 96% of the
time, a group of 4 69% (32 lost in a row: about 1 in 10^16). A reward that depends on a service which is down fails
every group too: a run stopped so resumes with `resume=true` once it is back."""
REWARD_FAILURE_MIN_GROUPS = 32


def reward_failure_limit(run: RunConfig) -> int:
    """Groups in a row without two scored samples, or with a sample failed in its engine, that stop the run
    (`REWARD_FAILURE_PATIENCE`)."""
    return max(REWARD_FAILURE_PATIENCE * run.algo.prompts_per_step, REWARD_FAILURE_MIN_GROUPS)


class NothingToTrainError(RuntimeError):
    """Every group comes back unusable, so no step can ever train: the run stops naming why (exit 1, one line)."""


class RewardFailedError(NothingToTrainError):
    """The reward functions fail on (nearly) every sample: nothing can be trained."""


class SamplesFailedError(NothingToTrainError):
    """Every group comes back with a sample failed in its engine (a routing capture that fails on every request,
    say): nothing can be trained."""


DYNAMIC_SAMPLING_PATIENCE = 10
"""Dynamic sampling drops at most this many batches' worth of all-equal groups in a row; after that it lets them
through (zero advantage, so they only dilute the step) with a warning, instead of sampling forever once a task is
solved or hopeless."""


NO_SIGNAL_STEPS = 10
"""Without dynamic sampling: after this many steps' worth of groups in a row whose samples all scored the same (no
advantage, nothing trained), the run warns once: a user's trial ran 4 steps of reward 0, loss 0 and grad_norm 0
from a random checkpoint and was told nothing (expected there; a real model with a broken answer format looks the
same)."""


def sampling_settings(run: RunConfig | EvaluateConfig, tokenizer: Any, *, greedy: bool = False,
                      seed: int | None = None) -> SamplingSettings:
    """The engines' sampling for training rollouts (or greedy, for evaluation)."""
    stops = tuple(tokenizer.stop_ids)
    if greedy:
        return SamplingSettings(n=1, temperature=0.0, max_tokens=run.rollout.max_tokens, stop_token_ids=stops)
    return SamplingSettings(n=run.algo.group_size, temperature=run.rollout.temperature, top_p=run.rollout.top_p,
                            max_tokens=run.rollout.max_tokens, stop_token_ids=stops, seed=seed)


def prompt_seed(run: RunConfig, index: int) -> int:
    """The sampling seed of the run's `index`-th admitted prompt (its samples use seed, seed + 1, ...): the same
    prompt number draws the same samples in a resumed run as in an uninterrupted one."""
    return (run.seed * 1_000_003 + index * run.algo.group_size) % (2**62)


def completion_sequence(completion: Any, advantage: float) -> Any:
    """A completion as a learner row: prompt + completion tokens, its routing trace, sampling log-probs and versions,
    with `advantage` on every response token (training rows and the mismatch probe's rows alike)."""
    from moe_grpo.learner.batch import LearnerSequence

    c = completion
    return LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids),
                           routing=c.routing, advantage=float(advantage), old_logprobs=c.logprobs,
                           versions=c.versions)


def learner_sequences(groups: list[Any]) -> list[Any]:
    """Every completion of `groups` as a learner row, with its group-relative advantage."""
    return [completion_sequence(c, a) for g in groups for c, a in zip(g.completions, g.advantages)]


@dataclass
class Scoring:
    """One train group back from its engine, its rewards being computed off the driver's loop."""

    request: Any
    """The engine pool's Request (sent again if a checkpoint is taken before the group is scored)."""
    engine: str
    completions: list[Any]
    scores: Any = None
    """Future of the group's reward `Scores`; None when the group was dropped before scoring (a failed sample)."""


def drop_failed(run: RunConfig, completions: list[Any], example: Any, engine: str, state: Any) -> bool:
    """Whether a group must be dropped unscored: a sample failed in the engine or is empty (counted in `state`).
    `reward_failure_limit` such groups in a row stop the run (SamplesFailedError): an engine whose every request
    fails would otherwise be sent new prompts forever, with no step and no error."""
    bad = [c for c in completions if not c.ok or len(c.token_ids) == 0]
    if not bad:
        state.failed_in_a_row = 0
        return False
    state.requests_lost += len(bad)
    state.failed_in_a_row += 1
    why = bad[0].error or bad[0].finish_reason
    log.warning("%s: %d completion(s) of prompt %s failed (%s); group dropped", engine, len(bad),
                example.where or repr(example.prompt)[:80], why)
    limit = reward_failure_limit(run)
    if state.failed_in_a_row >= limit:
        raise SamplesFailedError(f"{limit} groups in a row came back with failed samples ({state.requests_lost} "
                                 f"completions failed so far), so no step can train; the last, from {engine}: {why}")
    return True


def score_group(run: RunConfig, example: Any, completions: list[Any], state: Any, engine: str, rewards: Any,
                scores: Any) -> Any:
    """The group of `completions` with rewards (their `Scores`) and advantages, or None when it cannot be trained
    on (counted in `state`)."""
    # Samples whose reward raised, timed out or was NaN are counted and left out; the rest of the group trains.
    kept, values, failed = group_scored(rewards, example, scores)
    state.reward_failed += failed
    if len(kept) < 2:  # a group-relative advantage needs at least two samples
        state.reward_lost_in_a_row += 1
        limit = reward_failure_limit(run)
        if state.reward_lost_in_a_row >= limit:
            names = ", ".join(f.name for f in rewards.functions)
            raise RewardFailedError(
                f"the reward functions ({names}) left {limit} groups in a row with fewer than two scored samples "
                f"({state.reward_failed} samples failed so far), so no step can train; last error: "
                f"{'; '.join(scores.errors)[:300] or 'values not finite'}")
        return None
    state.reward_lost_in_a_row = 0
    adv = group_relative_advantages(values[None, :], normalize_std=run.algo.normalize_std)[0]
    return Group(example, [completions[i] for i in kept], values.astype(np.float32), adv, engine)


def shape_group(run: RunConfig, group: Any, state: Any) -> Any:
    """DAPO's reward-side pieces on a scored group, or None when dynamic sampling drops it (counted).

    Overlong shaping changes the advantages only: `group.rewards` stay the task's, so `reward/mean` means the
    same under every loss. Dynamic sampling drops a group whose (shaped) rewards are all equal."""
    if group is None:
        return None
    shaped = group.rewards.astype(np.float64)
    buffer = run.algo.overlong_buffer_tokens(run.rollout.max_tokens)
    if buffer:
        lengths = np.array([len(c.token_ids) for c in group.completions])
        shaped = shaped + overlong_penalty(lengths, max_tokens=run.rollout.max_tokens, buffer=buffer,
                                           penalty=run.algo.overlong_penalty)
        group.advantages = group_relative_advantages(shaped[None, :], normalize_std=run.algo.normalize_std)[0]
    if carries_signal(shaped):
        state.uniform_in_a_row = 0
        return group
    if run.algo.dynamic_sampling:
        if state.uniform_in_a_row < DYNAMIC_SAMPLING_PATIENCE * run.algo.prompts_per_step:
            state.uniform_in_a_row += 1
            state.dropped_uniform += 1
            return None
        if state.uniform_in_a_row == DYNAMIC_SAMPLING_PATIENCE * run.algo.prompts_per_step:
            log.warning("dynamic sampling: %d groups in a row had all-equal rewards; letting such groups through "
                        "(zero advantage) until one with signal arrives", state.uniform_in_a_row)
            state.uniform_in_a_row += 1
        return group
    state.uniform_in_a_row += 1
    if state.uniform_in_a_row == NO_SIGNAL_STEPS * run.algo.prompts_per_step:
        log.warning("no signal: the last %d groups (%d steps' worth) each gave all their samples the same reward, so "
                    "every advantage is 0 and nothing trains (loss and grad_norm 0). Check that a completion can earn "
                    "the reward: rollout.max_tokens=%d long enough for the answer's format, the reward reading the "
                    "right answer (data.answer_key, task=), a right answer scoring higher by hand",
                    state.uniform_in_a_row, NO_SIGNAL_STEPS, run.rollout.max_tokens)
    return group
