"""The mismatch probe: the engine-vs-learner gap on the same weights, measured after every publish.

What a step's training batch shows as KL(rollout || learner) is mostly policy
drift in async runs (tokens sampled by older weights), not the numerical gap
between the engine and the learner that routing replay exists for. The probe
measures that gap alone: when version v is published the learner ranks keep a
copy of v's weights, rounded to the dtype v travels in (`rollout.dtype`) as the
engines hold it, so a bf16 engine is compared on the weights it serves (scored
with the fp32 weights instead, 512 probe samples of the default model at step
20 of two bf16 runs gave a KL 10-38% higher and 14-21% more router
disagreement: the weights' rounding on top of the bf16 arithmetic); the
engines whose turn it is (below), once they serve v, sample a few fixed prompts (fixed seeds, one sample
each); the learner scores those completions with v's weights, routing replayed
(R3) and free. Each sync is also checked end to end (a wrong shard shows up
as a large KL).

What it costs, and where it runs. The engines: each probed version is sampled
by `routing.probe_engines` engines (default 1), taken round robin
(`engines_for_round`), so the engine time per version does not grow with the
number of engines and each of N engines is still checked every N probed
versions; 0 probes every engine (each sync into every engine checked at once,
at N times the engine time). The learner ranks: their scoring of a round is
handed to them only in their idle time, while no training step is in flight
and no batch waits for one (`score(..., learners_busy=...)`), unless the next
publish would drop the round (`due`: then at once). A learner rank runs its
calls in turn, so scoring queued behind a training step ran between that step
and its publish, which the driver waits on, and scoring handed over between
steps ran ahead of the next one: either way every probed version delayed the
next weights by the probe's two forwards. `tools/bench_async.py` (one engine, 2 cores, 2026-11-26, one run
each, async steps probe on over off): 1.123 before (async_vs_ideal_ratio 1.005
on, 1.128 off; 0.82-0.88 on against 0.89 off in earlier runs); 1.000 and 1.277
in two runs when scoring only waited for the step in flight; 1.039 with the
idle-time rule (ratio 0.957 on, 0.995 off; 22 of 28 versions reported against
15 before). On that shared machine a run's ratio moves by ~0.1. What waiting
costs: a training-bound run's ranks are never idle, so its rounds are scored
when `due`, ahead of a step (it pays the probe's forwards either way); a round
waiting for idle time is reported later.

The probe never blocks the schedule: requests and learner calls are collected
as they finish, and a row carries the newest finished probe. A round still
sampling when the next version is published goes on: its completions sampled
wholly at its version still count (with served adapters, `sync.lora_apply=serve`,
every request finishes on the adapter it started on, so all of them do; with
merged weights those the update caught mid-sequence are left out). The learner
ranks keep the weights of the newest `MAX_ROUNDS` probed versions, so a round
still sampling when a version `MAX_ROUNDS` newer is published is dropped
(`mismatch/probe_dropped`), as is one where no completion came back wholly at
its version. Before 2026-11-26 every round still sampling at the next publish
was dropped: in short async runs with served adapters, whose steps (~0.3 s)
were shorter than a probe's sampling (~0.4 s), every probe of an adapter
version was.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from moe_grpo.orchestrator.engine_pool import EnginePool, Request
from moe_grpo.orchestrator.groups import completion_sequence
from moe_grpo.orchestrator.learner_group import LearnerCall, LearnerFailedError, LearnerGroup

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig

log = logging.getLogger("moe_grpo")

PROBE_SEED = 1_000_000_007
"""Sampling seed of probe prompt i: PROBE_SEED + i (the same samples for a given version on every engine)."""


def probe_due(run: RunConfig, version: int) -> bool:
    """Whether the publish of `version` is probed (the learner ranks keep a copy of its weights for it): with
    routing.probe_prompts > 0, every routing.probe_every-th published version. The one rule for the initial
    publish, every later one and the driver's first round."""
    every = run.routing.probe_every
    return run.routing.probe_prompts > 0 and every > 0 and version % (every * run.algo.sync_every) == 0


def engines_for_round(engines: Sequence[str], per_round: int, turn: int) -> list[str]:
    """The engines that sample the `turn`-th probe round (0-based, counted over the run's rounds):
    `per_round` of `engines` taken round robin in the order given, so with N engines each is chosen once every
    N / per_round rounds; `per_round` 0 (or >= N) = all of them."""
    names = list(engines)
    if per_round == 0 or per_round >= len(names):
        return names
    start = turn * per_round % len(names)
    return [names[(start + j) % len(names)] for j in range(per_round)]


MAX_ROUNDS = 2
"""Probe rounds sampling at once: the learner ranks keep the weights of that many probed versions
(`learner.megatron_learner.MAX_SNAPSHOTS`, the oldest dropped first), so an older round could not be scored."""


@dataclass
class ProbeRound:
    """One published version's probe in progress."""

    version: int
    waiting: set[str]
    """Engines not yet asked to sample it (they do once they serve `version`)."""
    outstanding: dict[str, int] = field(default_factory=dict)
    """Engine -> probe completions still to come back."""
    completions: list[Any] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    """Engines whose completions all came back at `version`."""
    learner_call: LearnerCall | None = None
    """The learner ranks' scoring of `completions`, once handed to them."""


class MismatchProbe:
    """Drives probe rounds through the engine pool and the learner ranks; `latest` is the newest result."""

    def __init__(self, examples: list[Any], sampling: Any, engines_per_round: int) -> None:
        self.examples = examples
        self.sampling = sampling
        """`sampling(seed)` -> the engines' sampling settings for one probe sample."""
        self.engines_per_round = engines_per_round
        """`routing.probe_engines`: engines that sample each round (0 = every engine), round robin."""
        self.turns = 0
        """Rounds started so far (whose turn it is in `engines_for_round`)."""
        self.rounds: list[ProbeRound] = []
        """Rounds still sampling, oldest first (at most `MAX_ROUNDS`)."""
        self.scoring: list[ProbeRound] = []
        """Rounds handed to the learner ranks, oldest first."""
        self.latest: dict[str, float] = {}
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.examples)

    @property
    def round(self) -> ProbeRound | None:
        """The newest round still sampling."""
        return self.rounds[-1] if self.rounds else None

    def _round_of(self, version: int) -> ProbeRound | None:
        return next((r for r in self.rounds if r.version == version), None)

    def start(self, version: int, engines: list[str]) -> None:
        """`version` was published (with a weight snapshot on the learner ranks): probe it on the engines whose turn
        it is (`engines_for_round`)."""
        if not self.enabled:
            return
        # A learner call queued before the publish has run by now (an actor runs its calls in order): take it.
        self.collect()
        while len(self.rounds) >= MAX_ROUNDS:  # the learner ranks no longer hold its weights
            old = self.rounds.pop(0)
            self.dropped += 1
            log.debug("probe of version %d dropped: versions %s were published before it came back", old.version,
                      [r.version for r in self.rounds] + [version])
        self.rounds.append(ProbeRound(version, set(engines_for_round(engines, self.engines_per_round, self.turns))))
        self.turns += 1

    def submit(self, pool: EnginePool) -> None:
        """Ask each engine that now serves a round's version to sample the probe prompts; an engine already past
        it (it skipped the version) or restarting is left out of that round."""
        for r in self.rounds:
            self._submit(r, pool)

    def _submit(self, r: ProbeRound, pool: EnginePool) -> None:
        if not r.waiting:
            return
        for name in sorted(r.waiting):
            slot = pool.slots[name]
            if slot.served > r.version or slot.status != "up":
                r.waiting.discard(name)
            elif slot.status == "up" and slot.served == r.version and slot.applying is None:
                r.waiting.discard(name)
                r.outstanding[name] = 0
                for i, example in enumerate(self.examples):
                    request = Request("probe", example, seed=PROBE_SEED + i, index=i, version=r.version)
                    if pool.submit(request, self.sampling(request.seed), engine=name):
                        r.outstanding[name] += 1
                if not r.outstanding[name]:
                    del r.outstanding[name]

    def on_completion(self, request: Any, engine: str, completion: Any) -> None:
        r = self._round_of(request.version)
        if r is None or engine not in r.outstanding:
            return
        r.outstanding[engine] -= 1
        # Only a completion sampled wholly at the probed version compares like with like.
        if completion.ok and len(completion.token_ids) and int(completion.versions.min()) == r.version == int(
                completion.versions.max()):
            r.completions.append(completion)
            if engine not in r.engines:
                r.engines.append(engine)
        if not r.outstanding[engine]:
            del r.outstanding[engine]

    def on_failure(self, request: Any, engine: str) -> None:
        """A probe request failed with its engine (never sent again: the engine restarts on another version)."""
        r = self._round_of(request.version)
        if r is not None and engine in r.outstanding:
            del r.outstanding[engine]

    def score(self, learners: LearnerGroup, pool: EnginePool, *, learners_busy: bool = False) -> None:
        """Hand each round's completions to the learner ranks once every engine has answered or dropped out.
        `learners_busy` (a training step in flight, or a batch waiting for one): only a round the next publish
        would drop (`due`); the others wait for the ranks' idle time. A rank runs its calls in turn: scoring queued
        behind a step, or ahead of the next, holds back the weights the engines wait for (module docstring)."""
        for r in [r for r in self.rounds if not r.outstanding and not r.waiting]:
            if learners_busy and not self.due(r):
                continue
            self.rounds.remove(r)
            if not r.completions:
                self.dropped += 1
                log.debug("probe of version %d dropped: no completion came back wholly at that version", r.version)
                continue
            seqs = [completion_sequence(c, 0.0) for c in r.completions]  # the probe trains on nothing
            r.learner_call = learners.submit("probe", seqs, r.version, what=f"the probe of version {r.version}")
            self.scoring.append(r)

    def due(self, r: ProbeRound) -> bool:
        """Whether the next publish would drop round `r` (the learner ranks then no longer hold its weights): it is
        the oldest of `MAX_ROUNDS` rounds kept."""
        return len(self.rounds) >= MAX_ROUNDS and self.rounds[0] is r

    def refs(self) -> list[Any]:
        return [ref for r in self.scoring for ref in r.learner_call.refs]

    def collect(self, timeout: float = 0.0) -> None:
        """Take the learner ranks' answers that are there, in the order they were asked."""
        while self.scoring:
            r = self.scoring[0]
            try:
                if not r.learner_call.poll(timeout):
                    return
                result = r.learner_call.results()[0]
            except LearnerFailedError as e:  # the driver stops the run where it next waits on the ranks (a step, a
                # checkpoint), naming the rank; the probe only gives this round up
                self.scoring.pop(0)
                log.warning("probe of version %d: the learner ranks did not answer (%s)", r.version,
                            str(e).strip().splitlines()[0][:200])
                self.dropped += 1
                continue
            self.scoring.pop(0)
            if result is None:  # the learner no longer holds that version's weights
                self.dropped += 1
                continue
            if self.latest and r.version < self.latest["version"]:
                continue  # a newer version's probe finished first: rows report the newest
            self.latest = {**result, "version": float(r.version), "engines": float(len(r.engines)),
                           "sequences": float(len(r.completions))}

    def row(self, replay: str) -> dict[str, float]:
        """The run record's `mismatch/*` keys: the newest finished probe (NaN before the first)."""
        nan = float("nan")
        p = self.latest
        on, off = p.get("kl_replay_on", nan), p.get("kl_replay_off", nan)
        return {"mismatch/kl": on if replay == "r3" else off, "mismatch/kl_replay_on": on,
                "mismatch/kl_replay_off": off, "mismatch/router_disagreement": p.get("router_disagreement", nan),
                "mismatch/probe_version": p.get("version", nan), "mismatch/probe_engines": p.get("engines", nan),
                "mismatch/probe_dropped": float(self.dropped)}
