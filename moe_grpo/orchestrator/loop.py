"""The driver: runs the schedule, owns no model. `mode=sync` and `mode=async` share every line but two decisions.

    prompts -> engine actors (tokens, log-probs, per-token versions, routing traces)
            -> rewards, group-relative advantages -> RolloutBuffer (bounded, staleness-checked)
            -> learner actors (routing replayed, GRPO step) -> weight sync -> engines (version + 1)

The two decisions a schedule makes:
- when new prompts may be sent: async whenever the buffer has room (engines
  never idle for the learner); sync only when nothing is training and the
  engines serve the newest weights;
- how a new version is published: async in the background, overlapped with the
  next step, engines taking it between forward passes; sync in the foreground,
  waiting until every engine serves it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("moe_grpo")


@dataclass
class _Pending:
    engine: str
    example: Any
    submitted: float


@dataclass
class _State:
    step: int = 0
    generated_tokens: int = 0
    reward_failed: int = 0
    bad_rows: int = 0
    requests_lost: int = 0
    steps_skipped: int = 0
    sync_failures: int = 0
    last_eval: float = float("nan")
    last_eval_step: int = -1
    last_eval_version: int = -1
    evals: list[tuple[int, float]] = field(default_factory=list)
    dropped_uniform: int = 0
    """Groups dynamic sampling dropped because all their rewards were equal."""
    uniform_in_a_row: int = 0


def _sampling(run: Any, tokenizer: Any, greedy: bool = False) -> Any:
    from moe_grpo.rollout.types import SamplingSettings

    stops = tuple(tokenizer.stop_ids)
    if greedy:
        return SamplingSettings(n=1, temperature=0.0, max_tokens=run.rollout.max_tokens, stop_token_ids=stops)
    return SamplingSettings(n=run.algo.group_size, temperature=run.rollout.temperature, top_p=run.rollout.top_p,
                            max_tokens=run.rollout.max_tokens, stop_token_ids=stops)


def _learner_sequences(groups: list[Any]) -> list[Any]:
    from moe_grpo.learner.batch import LearnerSequence

    return [LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids),
                            routing=c.routing, advantage=float(a), old_logprobs=c.logprobs, versions=c.versions)
            for g in groups for c, a in zip(g.completions, g.advantages)]


def _score_group(run: Any, tokenizer: Any, example: Any, completions: list[Any], state: _State, engine: str,
                 rewards: Any) -> Any:
    """Rewards and advantages of one group, or None when it cannot be trained on (counted)."""
    from moe_grpo.algo.advantages import group_relative_advantages
    from moe_grpo.orchestrator.buffer import Group
    from moe_grpo.reward.scoring import score_group

    bad = [c for c in completions if not c.ok or len(c.token_ids) == 0]
    if bad:
        state.requests_lost += len(bad)
        log.warning("%s: %d completion(s) of prompt %r failed (%s); group dropped", engine, len(bad), example.prompt,
                    bad[0].error or bad[0].finish_reason)
        return None
    # Samples whose reward raised, timed out or was NaN are counted and left out; the rest of the group trains.
    kept, scores, failed = score_group(rewards, tokenizer, example, completions)
    state.reward_failed += failed
    if len(kept) < 2:  # a group-relative advantage needs at least two samples
        return None
    adv = group_relative_advantages(scores[None, :], normalize_std=run.algo.normalize_std)[0]
    return Group(example, [completions[i] for i in kept], scores.astype(np.float32), adv, engine)


DYNAMIC_SAMPLING_PATIENCE = 10
"""Dynamic sampling drops at most this many batches' worth of all-equal groups in a row; after that it lets them
through (zero advantage, so they only dilute the step) with a warning, instead of sampling forever once a task is
solved or hopeless."""


def _shape_group(run: Any, group: Any, state: _State) -> Any:
    """DAPO's reward-side pieces on a scored group, or None when dynamic sampling drops it (counted).

    Overlong shaping changes the advantages only: `group.rewards` stay the task's, so `reward/mean` means the
    same under every loss. Dynamic sampling drops a group whose (shaped) rewards are all equal."""
    from moe_grpo.algo.advantages import group_relative_advantages
    from moe_grpo.algo.shaping import carries_signal, overlong_penalty

    if group is None:
        return None
    shaped = group.rewards.astype(np.float64)
    buffer = run.algo.overlong_buffer_tokens(run.rollout.max_tokens)
    if buffer:
        lengths = np.array([len(c.token_ids) for c in group.completions])
        shaped = shaped + overlong_penalty(lengths, max_tokens=run.rollout.max_tokens, buffer=buffer,
                                           penalty=run.algo.overlong_penalty)
        group.advantages = group_relative_advantages(shaped[None, :], normalize_std=run.algo.normalize_std)[0]
    if run.algo.dynamic_sampling and not carries_signal(shaped):
        if state.uniform_in_a_row < DYNAMIC_SAMPLING_PATIENCE * run.algo.prompts_per_step:
            state.uniform_in_a_row += 1
            state.dropped_uniform += 1
            return None
        if state.uniform_in_a_row == DYNAMIC_SAMPLING_PATIENCE * run.algo.prompts_per_step:
            log.warning("dynamic sampling: %d groups in a row had all-equal rewards; letting such groups through "
                        "(zero advantage) until one with signal arrives", state.uniform_in_a_row)
            state.uniform_in_a_row += 1
        return group
    state.uniform_in_a_row = 0
    return group


def _evaluate(run: Any, pools: Any, examples: list[Any], tokenizer: Any, rewards: Any) -> tuple[float, int]:
    """Mean greedy reward on the held-out set, spread over the engines; and the version that scored it."""
    import ray

    from moe_grpo.reward.scoring import score_held_out

    greedy = _sampling(run, tokenizer, greedy=True)
    refs = [pools.engines[i % len(pools.engines)][1].generate.remote(list(e.prompt_ids), greedy)
            for i, e in enumerate(examples)]
    outs = ray.get(refs, timeout=run.rollout.request_timeout_s)
    mean = score_held_out(rewards, tokenizer, examples, [o[0].token_ids for o in outs])
    version = int(min(int(o[0].versions.min()) if len(o[0].versions) else 0 for o in outs))
    return mean, version


def _warm_start(run: Any, pools: Any, tokenizer: Any, source: Any) -> list[float]:
    import ray

    from moe_grpo.data.tasks import supervised_sequences
    from moe_grpo.learner.batch import LearnerSequence

    batches = []
    for _ in range(run.warm_start_steps):
        pairs = supervised_sequences(source.take(run.algo.prompts_per_step), tokenizer)
        batches.append([LearnerSequence(np.asarray(t), prompt_len=p, advantage=1.0) for t, p in pairs])
    if not batches:
        return []
    shares = [[b[i["dp"]::i["dp_size"]] for b in batches] for i in pools.infos]
    return ray.get([a.warm_start.remote(s) for a, s in zip(pools.learners, shares)])[0]


def train(run: Any, run_dir: str | Path, *, learner_cls: type | None = None) -> dict[str, Any]:
    """Run `run.steps` optimizer steps; returns a summary (eval at start and end, time).

    `learner_cls`: a `LearnerWorker` subclass to run instead (tests use a deliberately slow one)."""
    import ray

    from moe_grpo.checkpoint import hf_init
    from moe_grpo.data.prompts import prompt_source
    from moe_grpo.data.tokenizer import load_tokenizer
    from moe_grpo.orchestrator.pools import start_pools, start_ray, stop_pools
    from moe_grpo.orchestrator.run_record import RunRecord
    from moe_grpo.sync.transport import SharedMemoryTransport, default_root

    t_start = time.perf_counter()
    run_dir = str(Path(run_dir).resolve())
    tokenizer = load_tokenizer(run.model, run.init.hf)
    rng = np.random.default_rng(run.seed)
    source = prompt_source(run, tokenizer, rng, run_dir)  # bad rows are reported here, before anything starts
    rewards = _rewards(run)
    run = hf_init.prepare(run, run_dir)  # init.hf: the learner's converted checkpoint (cached next to the run)
    sync_root = os.path.join(default_root(), f"run-{os.getpid()}-{int(time.time())}")
    SharedMemoryTransport(sync_root)  # created (private) before any actor opens it
    pools = None
    state = _State(bad_rows=source.bad_rows)
    record = None
    try:
        start_ray(run.cluster, run_dir)
        warm: list[float] = []

        def initial_weights(learners: list[Any]) -> str:
            nonlocal warm
            from moe_grpo.orchestrator.pools import Pools

            infos = ray.get([a.info.remote() for a in learners])
            t0 = time.perf_counter()
            warm = _warm_start(run, Pools([], learners, infos, None), tokenizer, source)
            if warm:
                log.info("warm start: %d supervised steps in %.1fs, answer NLL %.3f -> %.3f", len(warm),
                         time.perf_counter() - t0, warm[0], warm[-1])
            ray.get([a.publish.remote(0, False) for a in learners])
            if run.init.hf and not warm:  # the engines start from the checkpoint itself
                return str(hf_init.engine_dir(run.init.hf, run.model, os.path.join(run_dir, "model_v0")))
            return ray.get(learners[0].export_version.remote(0, os.path.join(run_dir, "model_v0")))

        t0 = time.perf_counter()
        pools = start_pools(run, run_dir, sync_root, initial_weights, learner_cls)
        log.info("pools up in %.0fs: %d engine(s), %d learner rank(s) (%.2fM parameters on rank 0)",
                 time.perf_counter() - t0, len(pools.engines), len(pools.learners), pools.infos[0]["parameters"] / 1e6)
        held_out = source.held_out
        if run.eval_every and not held_out:
            log.info("no held-out set (data.eval_path is not set): no evaluation")
        if run.eval_every and held_out:
            state.last_eval, state.last_eval_version = _evaluate(run, pools, held_out, tokenizer, rewards)
            state.last_eval_step = 0
            state.evals.append((0, state.last_eval))
            log.info("held-out reward at step 0 (greedy, %d prompts): %.3f", len(held_out), state.last_eval)
        record = RunRecord(run_dir, run.steps)
        published = _loop(run, pools, record, state, tokenizer, held_out, source, rewards)
        policy_dir = export_policy(run, pools, state.step, published, run_dir)
        log.info("final policy (version %d) exported to %s", state.step, policy_dir)
    finally:
        rewards.close()
        if record is not None:
            png = record.close()
            if png:
                log.info("plots: %s", png)
        stop_pools(pools)
        import shutil

        shutil.rmtree(sync_root, ignore_errors=True)
    summary = {"steps": state.step, "eval_start": state.evals[0][1] if state.evals else float("nan"),
               "eval_end": state.evals[-1][1] if state.evals else float("nan"), "evals": state.evals,
               "warm_start_loss": warm, "seconds": time.perf_counter() - t_start, "run_dir": run_dir,
               "policy_dir": os.path.join(run_dir, "policy"), "reward_failed": state.reward_failed,
               "bad_rows": state.bad_rows,
               "faults": {"requests_lost": state.requests_lost, "steps_skipped": state.steps_skipped,
                          "sync_failures": state.sync_failures}}
    return summary


def _rewards(run: Any) -> Any:
    from moe_grpo.reward.functions import Rewards

    return Rewards(*run.reward.resolved(run.task.name), timeout_s=run.reward.timeout_s)


def export_policy(run: Any, pools: Any, step: int, published: int, run_dir: str) -> str:
    """The final weights as an HF directory vLLM serves (`run_dir/policy`, with the checkpoint's tokenizer)."""
    import ray

    if published != step:  # the last steps were not published (sync_every, or a skipped step)
        ray.get([a.publish.remote(step, False) for a in pools.learners])
    return ray.get(pools.learners[0].export_version.remote(step, os.path.join(run_dir, "policy")))


def _loop(run: Any, pools: Any, record: Any, state: _State, tokenizer: Any, held_out: list[Any], source: Any,
          rewards: Any) -> int:
    """Run the schedule; returns the last version published."""
    import ray

    from moe_grpo.orchestrator.buffer import RolloutBuffer
    from moe_grpo.orchestrator.watch import JumpWatch

    is_async = run.mode == "async"
    watch = JumpWatch(run.routing.jump_factor, run.routing.jump_window)
    per_step = run.algo.prompts_per_step
    buffer = RolloutBuffer(per_step * (run.algo.max_staleness + 1) if is_async else per_step, run.algo.max_staleness)
    sampling = _sampling(run, tokenizer)
    engines = dict(pools.engines)
    in_flight: dict[Any, _Pending] = {}
    load = {name: 0 for name in engines}
    applying: dict[str, tuple[int, Any]] = {}  # engine -> (version, ref) of a weight load in progress
    served = {name: 0 for name in engines}
    train_refs: list[Any] = []
    train_batch: list[Any] = []
    t_last = time.perf_counter()
    busy_last = {name: 0.0 for name in engines}
    tokens_at_last = 0
    published = 0
    admitted = 0
    lost_groups = 0

    def engines_current() -> bool:
        return all(v == published for v in served.values())

    def admit() -> None:
        nonlocal admitted
        if is_async:
            # AReaL's admission rule: a group started now samples at version >= the engines' oldest, and is
            # trainable up to version (that + max_staleness), i.e. by the first (that + max_staleness + 1)
            # batches. Starting more than those batches hold would only produce groups dropped as stale.
            horizon = (min(served.values()) + run.algo.max_staleness + 1) * per_step
            room = min(buffer.room(len(in_flight)), horizon - (admitted - wasted()))
        else:  # sync: a whole batch, only between steps, on the newest weights; refills what dynamic sampling
            # dropped or a failure lost (same weights: nothing trains until the batch is full)
            room = per_step - len(buffer) if (not train_refs and not in_flight and engines_current()) else 0
        for example in source.take(max(room, 0)):
            name = min(load, key=load.get)
            ref = engines[name].generate.remote(list(example.prompt_ids), sampling)
            in_flight[ref] = _Pending(name, example, time.perf_counter())
            load[name] += 1
            admitted += 1

    def wasted() -> int:
        """Admitted groups that will never be trained on (dropped stale, or lost): their slots are free again."""
        return buffer.dropped_stale + lost_groups

    def push(version: int) -> None:
        """Offer `version` to every engine not still loading an older one; sync mode waits for all."""
        for name, handle in engines.items():
            if name in applying:
                continue
            applying[name] = (version, handle.apply_version.remote(version, run.rollout.request_timeout_s))
        if not is_async:
            settle(block=True)

    def settle(block: bool) -> None:
        for name, (version, ref) in list(applying.items()):
            ready, _ = ray.wait([ref], timeout=run.rollout.request_timeout_s if block else 0)
            if not ready:
                if block:
                    raise RuntimeError(f"{name}: loading version {version} did not finish within "
                                       f"{run.rollout.request_timeout_s:.0f} s")
                continue
            del applying[name]
            try:
                ray.get(ref)
                served[name] = version
            except Exception as e:  # noqa: BLE001 - the engine keeps its version and gets the next one
                state.sync_failures += 1
                log.warning("%s did not take version %d: %s", name, version, e)

    while state.step < run.steps:
        admit()
        if not train_refs:
            trained_version = state.step  # the learner's weights: one version per optimizer step
            groups = buffer.take(per_step, trained_version)
            if groups is not None:
                train_batch = groups
                seqs = _learner_sequences(groups)
                train_refs = [a.train.remote(seqs[i["dp"]::i["dp_size"]], trained_version, run.routing.replay)
                              for a, i in zip(pools.learners, pools.infos)]
        # Wake on whatever finishes first: a group, the training step, or an engine taking a version
        # (which opens admission for the next groups).
        loads = [ref for _, ref in applying.values()]
        ready, _ = ray.wait(list(in_flight) + train_refs + loads, num_returns=1, timeout=1.0)
        for ref in ready:
            if ref in in_flight:
                pending = in_flight.pop(ref)
                load[pending.engine] -= 1
                try:
                    completions = ray.get(ref)
                except Exception as e:
                    raise RuntimeError(f"{pending.engine} failed mid-rollout: {e}") from e
                state.generated_tokens += sum(len(c.token_ids) for c in completions)
                group = _score_group(run, tokenizer, pending.example, completions, state, pending.engine, rewards)
                group = _shape_group(run, group, state)
                if group is not None:
                    buffer.put(group)
                else:
                    lost_groups += 1
        now = time.perf_counter()
        for ref, pending in in_flight.items():
            if now - pending.submitted > run.rollout.request_timeout_s + 30:
                raise RuntimeError(f"{pending.engine}: a rollout has not returned after "
                                   f"{now - pending.submitted:.0f} s (rollout.request_timeout_s="
                                   f"{run.rollout.request_timeout_s:.0f}); the engine actor is hung")
        settle(block=False)
        if train_refs and all(r in ready or ray.wait([r], timeout=0)[0] for r in train_refs):
            results = ray.get(train_refs)
            train_refs = []
            state.step += 1
            metrics = results[0]
            if metrics.get("skipped"):
                state.steps_skipped += 1
                log.warning("step %d skipped: %s", state.step, metrics.get("error"))
            elif state.step % run.algo.sync_every == 0:
                published = state.step
                ray.get([a.publish.remote(published, is_async) for a in pools.learners])
                push(published)
            if run.eval_every and held_out and (state.step % run.eval_every == 0 or state.step == run.steps):
                state.last_eval, state.last_eval_version = _evaluate(run, pools, held_out, tokenizer, rewards)
                state.last_eval_step = state.step
                state.evals.append((state.step, state.last_eval))
            now = time.perf_counter()
            interval = max(now - t_last, 1e-9)
            stats = {name: ray.get(h.stats.remote()) for name, h in engines.items()}
            busy = sum(s["busy_seconds"] - busy_last[n] for n, s in stats.items())
            busy_last = {n: s["busy_seconds"] for n, s in stats.items()}
            sync = ray.get(pools.learners[0].sync_metrics.remote())
            row = _row(run, state, metrics, train_batch, trained_version=state.step - 1, interval=interval,
                       train_seconds=max(r.get("train_seconds", 0.0) for r in results),
                       infer_busy=busy / (interval * len(engines)),
                       rollout_tokens=state.generated_tokens - tokens_at_last, sync=sync, buffer=buffer, stats=stats)
            for message in watch.update(row):
                log.warning(message)
            row["watch/jumps"] = float(watch.jumps)
            record.log(row)
            tokens_at_last = state.generated_tokens
            t_last = now
    settle(block=True)
    return published


def _row(run: Any, state: _State, metrics: dict[str, float], groups: list[Any], *, trained_version: int,
         interval: float, train_seconds: float, infer_busy: float, rollout_tokens: int, sync: dict[str, float],
         buffer: Any, stats: dict[str, dict[str, float]]) -> dict[str, float]:
    rewards = np.concatenate([g.rewards for g in groups])
    stale = np.concatenate([trained_version - c.versions for g in groups for c in g.completions])
    train_tokens = sum(len(c.prompt_ids) + len(c.token_ids) - 1 for g in groups for c in g.completions)
    nan = float("nan")
    return {
        "step": state.step,
        "policy_version": state.step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "mismatch/kl": metrics.get("mismatch/kl", nan),
        "mismatch/router_disagreement": metrics.get("mismatch/router_disagreement", nan),
        "replay/applied": metrics.get("replay/applied", nan),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "throughput/rollout_tokens_per_s": rollout_tokens / interval,
        "throughput/train_tokens_per_s": train_tokens / max(train_seconds, 1e-9),
        "util/train_busy": min(1.0, train_seconds / interval),
        "util/infer_busy": min(1.0, infer_busy),
        "sync/seconds": sync.get("sync/seconds", 0.0),
        "sync/bytes": sync.get("sync/bytes", 0.0),
        "eval/reward/mean": state.last_eval,
        "eval/step": float(state.last_eval_step),
        "eval/policy_version": float(state.last_eval_version),
        "reward/failed": float(state.reward_failed),
        "data/bad_rows": float(state.bad_rows),
        "loss": metrics.get("loss", nan),
        "nll": metrics.get("nll", nan),
        "grad_norm": metrics.get("grad_norm", nan),
        "clip_fraction": metrics.get("clip_fraction", nan),
        "ratio_mean": metrics.get("ratio_mean", nan),
        "correction/truncated_fraction": metrics.get("correction/truncated_fraction", nan),
        "correction/masked_fraction": metrics.get("correction/masked_fraction", nan),
        "kl/reference": metrics.get("kl/reference", nan),
        "dynamic_sampling/dropped_groups": float(state.dropped_uniform),
        "response_length/mean": float(np.mean([len(c.token_ids) for g in groups for c in g.completions])),
        "buffer/groups": float(len(buffer)),
        "buffer/dropped_stale": float(buffer.dropped_stale),
        "faults/engine_restarts": float(sum(s.get("restarts", 0.0) for s in stats.values())),
        "faults/requests_lost": float(state.requests_lost),
        "faults/steps_skipped": float(state.steps_skipped),
        "faults/sync_failures": float(state.sync_failures),
        "rollout/resubmitted": float(sum(s.get("resubmitted", 0.0) for s in stats.values())),
        "time/step_seconds": interval,
        "time/train_seconds": train_seconds,
    }
