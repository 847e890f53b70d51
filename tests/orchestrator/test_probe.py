"""The mismatch probe's bookkeeping (pure logic: an engine pool and learner handles stand in for the real ones,
which tests/orchestrator/test_loop.py runs it on)."""

from dataclasses import dataclass, field

import numpy as np

from moe_grpo.orchestrator.learner_group import LearnerCall, LearnerGroup
from moe_grpo.orchestrator.probe import PROBE_SEED, MismatchProbe
from moe_grpo.rollout.types import Completion


@dataclass
class Slot:
    name: str
    served: int = 0
    status: str = "up"
    applying: object = None


@dataclass
class Pool:
    slots: dict
    sent: list = field(default_factory=list)

    def submit(self, request, sampling, engine=None):
        self.sent.append((engine, request, sampling))
        return True


class Learner:
    """A learner rank's actor handle: `probe.remote` records what it was asked."""

    def __init__(self):
        self.calls = []
        self.probe = self

    def remote(self, seqs, version):
        self.calls.append((len(seqs), version))
        return f"ref-{version}"


def group(*learners):
    """The ranks as the probe reaches them: through a `LearnerGroup` (its submit is plain Python)."""
    return LearnerGroup(learners, [], timeout_s=60.0)


def completion(version, n=3):
    return Completion(np.array([1, 2, 3]), np.arange(n), np.zeros(n, np.float32), versions=np.full(n, version))


def test_each_engine_samples_the_fixed_prompts_once_it_serves_the_version_and_the_learner_scores_them():
    probe = MismatchProbe(["p0", "p1"], sampling=lambda seed: {"seed": seed}, engines_per_round=0)
    pool = Pool({"engine0": Slot("engine0", served=4), "engine1": Slot("engine1", served=4)})
    probe.start(5, list(pool.slots))
    probe.submit(pool)
    assert pool.sent == [], "no engine serves version 5 yet"
    pool.slots["engine0"].served = 5
    probe.submit(pool)
    assert [(e, r.kind, r.version, s["seed"]) for e, r, s in pool.sent] == [
        ("engine0", "probe", 5, PROBE_SEED), ("engine0", "probe", 5, PROBE_SEED + 1)]
    learners = [Learner(), Learner()]
    for _, request, _ in pool.sent:
        probe.on_completion(request, "engine0", completion(5))
    probe.score(group(*learners), pool)
    assert learners[0].calls == [], "engine1 may still serve version 5: wait for it"
    pool.slots["engine1"].served = 6  # it went straight past 5: left out of this round
    probe.submit(pool)
    probe.score(group(*learners), pool)
    assert [lr.calls for lr in learners] == [[(2, 5)], [(2, 5)]], "every rank scores the same sequences"
    assert probe.refs() == ["ref-5", "ref-5"] and probe.dropped == 0


def test_a_completion_sampled_partly_by_other_weights_is_left_out_and_a_round_two_versions_behind_is_dropped():
    probe = MismatchProbe(["p0"], sampling=lambda seed: {}, engines_per_round=0)
    pool = Pool({"engine0": Slot("engine0", served=2)})
    probe.start(2, ["engine0"])
    probe.submit(pool)
    request = pool.sent[0][1]
    mixed = completion(2)
    mixed.versions[-1] = 3  # the engine took version 3 mid-completion
    probe.on_completion(request, "engine0", mixed)
    learners = [Learner()]
    probe.score(group(*learners), pool)
    assert learners[0].calls == [] and probe.dropped == 1, "nothing comparable came back: the round is dropped"
    probe.start(3, ["engine0"])
    probe.start(4, ["engine0"])  # version 3 still sampling: it goes on beside 4
    assert probe.dropped == 1 and [r.version for r in probe.rounds] == [3, 4]
    probe.start(5, ["engine0"])  # the learner ranks keep MAX_ROUNDS versions' weights: 3's are gone
    assert probe.dropped == 2 and [r.version for r in probe.rounds] == [4, 5]


def test_a_round_still_sampling_when_the_next_version_is_published_is_scored_at_its_version():
    """What a short async run with served adapters did (traced 2026-11-26): steps of ~0.3 s, a probe's sampling
    ~0.4 s, so version v+1 was published while v's probe was in flight; its completions came back wholly at v (each
    request stays on the adapter it started on) and were thrown away with the round. Would have caught: every probe
    of an adapter version dropped in 2 of 3 such runs."""
    probe = MismatchProbe(["p0", "p1"], sampling=lambda seed: {}, engines_per_round=0)
    pool = Pool({"engine0": Slot("engine0", served=1)})
    probe.start(1, ["engine0"])
    probe.submit(pool)
    first = [r for _, r, _ in pool.sent]
    probe.start(2, ["engine0"])  # published before version 1's probe came back
    pool.slots["engine0"].served = 2
    probe.submit(pool)
    second = [r for _, r, _ in pool.sent[2:]]
    assert [r.version for r in second] == [2, 2]
    learners = [Learner()]
    for request in first:
        probe.on_completion(request, "engine0", completion(1))
    probe.score(group(*learners), pool)
    assert learners[0].calls == [(2, 1)], "version 1's round, whose completions all came back at 1, is scored"
    for request in second:
        probe.on_completion(request, "engine0", completion(2))
    probe.score(group(*learners), pool)
    assert learners[0].calls == [(2, 1), (2, 2)] and probe.dropped == 0


def test_rows_report_the_newest_version_probed_when_an_older_round_finishes_later(monkeypatch):
    """Rounds now overlap, so an older version's answer can come back after a newer one's: `mismatch/probe_version`
    must not go backwards."""
    import ray

    from moe_grpo.orchestrator.probe import ProbeRound

    probe = MismatchProbe(["p0"], sampling=lambda seed: {}, engines_per_round=0)
    probe.latest = {"kl_replay_on": 1e-14, "kl_replay_off": 1e-3, "router_disagreement": 0.0, "version": 6.0}
    probe.scoring.append(ProbeRound(5, set(), learner_call=LearnerCall(group(Learner()), "the probe of version 5",
                                                                        ["ref-5"], float("inf"), "none")))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref: {"kl_replay_on": 2e-14, "kl_replay_off": 2e-3,
                                                 "router_disagreement": 0.0})
    probe.collect()
    assert probe.latest["version"] == 6.0 and probe.row("r3")["mismatch/kl"] == 1e-14 and probe.scoring == []


def test_a_failed_probe_request_ends_that_engines_part_and_rows_carry_nan_before_the_first_result():
    probe = MismatchProbe(["p0"], sampling=lambda seed: {}, engines_per_round=0)
    assert all(v != v for k, v in probe.row("r3").items() if k != "mismatch/probe_dropped")
    pool = Pool({"engine0": Slot("engine0", served=1), "engine1": Slot("engine1", served=1)})
    probe.start(1, list(pool.slots))
    probe.submit(pool)
    (_, r0, _), (_, r1, _) = pool.sent
    probe.on_failure(r0, "engine0")
    probe.on_completion(r1, "engine1", completion(1))
    learners = [Learner()]
    probe.score(group(*learners), pool)
    assert learners[0].calls == [(1, 1)]
    probe.latest = {"kl_replay_on": 1e-9, "kl_replay_off": 2e-3, "router_disagreement": 0.1, "version": 1.0}
    assert probe.row("r3")["mismatch/kl"] == 1e-9 and probe.row("off")["mismatch/kl"] == 2e-3


def test_the_probe_keeps_as_many_rounds_as_the_learner_keeps_versions_weights():
    """A round the learner ranks hold no weights for could only be dropped when it came back."""
    import pytest

    pytest.importorskip("megatron.core")
    from moe_grpo.learner.megatron_learner import MAX_SNAPSHOTS
    from moe_grpo.orchestrator.probe import MAX_ROUNDS

    assert MAX_ROUNDS == MAX_SNAPSHOTS


def test_each_probed_version_is_sampled_by_one_engine_in_turn_and_every_engine_comes_round(monkeypatch):
    """`routing.probe_engines=1` (the default): a version's probe costs one engine's time however many engines the
    run has, and each engine's weights are still checked every N probed versions. Would have caught: every engine
    sampling every probed version (N times the engine time), or a rotation that never reaches some engine."""
    import ray

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    monkeypatch.setattr(ray, "get", lambda ref: {"kl_replay_on": 0.0, "kl_replay_off": 0.0,
                                                 "router_disagreement": 0.0})
    names = ["engine0", "engine1", "engine2"]
    probe = MismatchProbe(["p0"], sampling=lambda seed: {}, engines_per_round=1)
    pool = Pool({n: Slot(n) for n in names})
    chosen = []
    for version in range(1, 7):
        for slot in pool.slots.values():
            slot.served = version
        probe.start(version, names)
        before = len(pool.sent)
        probe.submit(pool)
        chosen.append([e for e, _, _ in pool.sent[before:]])
        for engine, request, _ in pool.sent[before:]:
            probe.on_completion(request, engine, completion(version))
        probe.score(group(Learner()), pool)
    assert chosen == [["engine0"], ["engine1"], ["engine2"], ["engine0"], ["engine1"], ["engine2"]]
    probe.collect()
    assert probe.dropped == 0 and probe.rounds == [] and probe.row("r3")["mismatch/probe_engines"] == 1.0


def test_engines_for_round_takes_engines_round_robin_or_all_of_them():
    """The rotation on its own: k engines per round move on by k; 0 or k >= N is every engine."""
    from moe_grpo.orchestrator.probe import engines_for_round

    names = ["a", "b", "c"]
    assert [engines_for_round(names, 2, turn) for turn in range(3)] == [["a", "b"], ["c", "a"], ["b", "c"]]
    assert engines_for_round(names, 0, 5) == names and engines_for_round(names, 4, 1) == names
    assert engines_for_round(["solo"], 1, 7) == ["solo"]


def test_a_finished_round_waits_for_the_learner_ranks_to_finish_their_training_step():
    """A learner rank runs its calls in turn, and the driver waits on each step's publish: scoring queued behind a
    training step ran before that publish, so every probed version held the next weights back by the probe's
    forwards (async steps 12% longer with the probe on, tools/bench_async.py, 2026-11-26). Would have caught: a
    probe handed to the learner ranks while they train."""
    probe = MismatchProbe(["p0"], sampling=lambda seed: {}, engines_per_round=1)
    pool = Pool({"engine0": Slot("engine0", served=3)})
    probe.start(3, ["engine0"])
    probe.submit(pool)
    probe.on_completion(pool.sent[0][1], "engine0", completion(3))
    learner = Learner()
    probe.score(group(learner), pool, learners_busy=True)
    assert learner.calls == [] and [r.version for r in probe.rounds] == [3], "kept until the step is done"
    probe.score(group(learner), pool, learners_busy=False)
    assert learner.calls == [(1, 3)] and probe.rounds == [] and probe.dropped == 0


def test_a_round_the_next_publish_would_drop_goes_to_the_busy_learner_ranks():
    """A training-bound run's ranks are never idle between steps: waiting for idle time would drop every round at
    the next publish and the run would report no probe. Would have caught: `mismatch/*` NaN for a whole run."""
    probe = MismatchProbe(["p0"], sampling=lambda seed: {}, engines_per_round=1)
    pool = Pool({"engine0": Slot("engine0", served=3)})
    probe.start(3, ["engine0"])
    probe.submit(pool)
    probe.on_completion(pool.sent[0][1], "engine0", completion(3))
    probe.start(4, ["engine0"])  # version 5's publish would drop version 3's round
    learner = Learner()
    probe.score(group(learner), pool, learners_busy=True)
    assert learner.calls == [(1, 3)] and [r.version for r in probe.rounds] == [4] and probe.dropped == 0
