"""The driver: runs the schedule, owns no model. `mode=sync` and `mode=async` share every line but two decisions.

    prompts -> engine pool (tokens, log-probs, per-token versions, routing traces)
            -> rewards, group-relative advantages -> RolloutBuffer (bounded, staleness-checked)
            -> learner actors (routing replayed, GRPO step) -> weight sync -> engines (version + 1)

One pass of the schedule: `admit` prompts, `collect` what came back, `start_step`
when a batch is ready, and when a step finishes `finish_step`, `publish`, `evaluate`,
`log`, `guard` (the collapse guard) and `checkpoint`. Everything a run needs to go
on lives in objects the `Driver` owns (`RunState`, `EnginePool`, `RolloutBuffer`,
the prompt source, `JumpWatch`), each with `state_dict()` / `load_state_dict()`;
a run checkpoint (run_checkpoint.py) saves them with the learner's state.

The two decisions a schedule makes:
- when new prompts may be sent: async whenever the buffer has room (engines
  never idle for the learner); sync only when nothing is training and the
  engines serve the newest weights;
- how a new version is published: async in the background, overlapped with the
  next step, engines taking it between forward passes; sync in the foreground,
  waiting until every engine serves it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import random
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_grpo.awake_clock import awake_now
from moe_grpo.orchestrator import run_checkpoint
from moe_grpo.orchestrator.buffer import RolloutBuffer
from moe_grpo.orchestrator.collapse_guard import rollback_due
from moe_grpo.orchestrator.engine_pool import EnginePool, EngineSlot, Request
from moe_grpo.orchestrator.groups import (Scoring, drop_failed, learner_sequences, prompt_seed, sampling_settings,
                                          score_group, shape_group)
from moe_grpo.orchestrator.learner_group import LearnerCall, LearnerGroup
from moe_grpo.orchestrator.pools import Pools
from moe_grpo.orchestrator.probe import MismatchProbe, probe_due
from moe_grpo.orchestrator.process_record import ProcessRecord
from moe_grpo.orchestrator.run_record import RunRecord, step_row
from moe_grpo.orchestrator.state import RunState
from moe_grpo.orchestrator.watch import JumpWatch
from moe_grpo.reward.functions import Rewards
from moe_grpo.reward.scoring import score_held_out, submit_group
from moe_grpo.sync.sync_metrics import combine_sync_metrics, newest_common_version

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig

log = logging.getLogger("moe_grpo")

SCORING_POLL_S = 0.02
"""While groups are being scored, the loop waits at most this long for engines or rewards before it looks again."""


class Stopped(Exception):
    """The run was asked to stop (SIGTERM) and has written its checkpoint."""


class Driver:
    """The schedule and the state it runs on."""

    def __init__(self, run: RunConfig, run_dir: str, pools: Pools, tokenizer: Any, source: Any, rewards: Rewards,
                 state: RunState) -> None:
        self.run, self.run_dir, self.pools = run, run_dir, pools
        self.learners: LearnerGroup = pools.learners
        self.learners.hint = self._checkpoint_hint  # every learner failure names the checkpoint to resume from
        self.tokenizer, self.source, self.rewards, self.state = tokenizer, source, rewards, state
        self.is_async = run.mode == "async"
        per_step = run.algo.prompts_per_step
        self.buffer = RolloutBuffer(per_step * (run.algo.max_staleness + 1) if self.is_async else per_step,
                                    run.algo.max_staleness)
        self.watch = JumpWatch(run.routing.jump_factor, run.routing.jump_window)
        self.engines = EnginePool([EngineSlot(name, i, handle, pid=pid)
                                   for i, ((name, handle), pid) in enumerate(zip(pools.engines, pools.engine_pids))],
                                  run.rollout, pools.make_engine, run.cluster.start_timeout_s)
        self.greedy = sampling_settings(run, tokenizer, greedy=True)
        self.probe = MismatchProbe(source.probe_set(run.routing.probe_prompts), engines_per_round=run.routing.probe_engines,
                                   sampling=lambda seed: dataclasses.replace(sampling_settings(run, tokenizer, seed=seed), n=1))
        self.record: RunRecord | None = None
        self.epoch = 0
        """Bumped by a rollback: requests sent before it are thrown away when they return."""
        self.training: LearnerCall | None = None
        """The training step in flight on the learner ranks."""
        self.train_batch: list[Any] = []
        self.eval_results: dict[int, Any] = {}
        self.scoring: list[Scoring] = []
        """Train groups back from the engines whose rewards are being computed (off this loop), in arrival order."""
        self.last_checkpoint: Path | None = None
        self.due: str | None = None
        """Why a checkpoint is owed at the next step boundary ('SIGTERM', 'SIGUSR1'), or None."""
        self.stop_after_checkpoint: str | None = None
        """The signal (SIGTERM) that asked the run to stop once its next checkpoint is written."""
        self.t_last = time.perf_counter()
        self.busy_last: dict[str, float] = {}
        self.tokens_at_last = 0
        self.process_record: ProcessRecord | None = None
        """The run's `ProcessRecord` (processes.json), brought up to date each step (`write_processes`)."""

    # ------------------------------------------------------------------ the schedule
    def run_schedule(self) -> None:
        """Take optimizer steps until `steps`; returns with every engine serving the last published version."""
        import ray

        self.t_last = time.perf_counter()
        self.tokens_at_last = self.state.generated_tokens
        while self.state.step < self.run.steps:
            if self.due and not self.training:
                self.checkpoint(self.due)
            self.probe.submit(self.engines)
            self.admit()
            self.start_step()
            ready, _ = ray.wait(self.engines.refs() + self._training_refs() + self.probe.refs(), num_returns=1,
                                timeout=SCORING_POLL_S if self.scoring else 1.0)
            self.collect(ready)
            self.take_scored()
            self.engines.check_hung()
            self.engines.settle(block=False)
            self.advance_probe()
            if self.step_done():
                metrics = self.finish_step()
                if not self.guard(metrics):  # a rollback publishes the restored weights instead
                    self.publish(metrics)
                self.evaluate_if_due()
                self.log(metrics)
                self.stop_if_skipping(metrics)
                if self.run.checkpoint.every and self.state.step % self.run.checkpoint.every == 0:
                    self.due = self.due or "every"
                if self.due:
                    self.checkpoint(self.due)
        self.engines.settle(block=True)

    def admit(self) -> None:
        """Send prompts: first those to send again (failed engine, resume), then new ones where there is room."""
        self.admit_retries()
        if not self.engines.up():
            return
        per_step = self.run.algo.prompts_per_step
        in_flight = self.engines.in_flight_count("train") + len(self.scoring)  # scoring groups are still on the way
        if self.is_async:
            # AReaL's admission rule: a group started now samples at version >= the engines' oldest, and is
            # trainable up to version (that + max_staleness), i.e. by the first (that + max_staleness + 1)
            # batches. Starting more than those batches hold would only produce groups dropped as stale.
            oldest = min((s.served for s in self.engines.up()), default=self.state.published)
            horizon = (oldest + self.run.algo.max_staleness + 1) * per_step
            room = min(self.buffer.room(in_flight), horizon - (self.state.admitted - self._wasted()))
        else:  # sync: a whole batch, only between steps, on the newest weights; refills what dynamic sampling
            # dropped or a failure lost (same weights: nothing trains until the batch is full)
            idle = not self.training and self.engines.all_current()
            room = per_step - len(self.buffer) - in_flight if idle else 0
        for example in self.source.take(max(room, 0)):
            request = Request("train", example, prompt_seed(self.run, self.state.admitted), epoch=self.epoch)
            self.state.admitted += 1
            self.engines.send(request, self._sampling(request))

    def finish_probes(self) -> None:
        """After the last step: wait for the probe rounds in progress: the summary reports the final weights' gap."""
        if self.probe.enabled:
            self.wait_for_probes(float("inf"), scored=True, why="after the last step")
            p = self.probe.row(self.run.routing.replay)
            log.info("mismatch probe, newest version probed (%s of %d): KL(engine || learner) %.3g on %s engine(s)",
                     p["mismatch/probe_version"], self.state.step, p["mismatch/kl"], p["mismatch/probe_engines"])

    def wait_for_probes(self, through: float, *, scored: bool, why: str) -> None:
        """Wait until no probe round of a version <= `through` is sampling (`scored`: nor being scored), handing
        finished rounds to the ranks at once; bounded by `rollout.request_timeout_s` + 30 s (then left out)."""
        def pending() -> list[int]:
            return [r.version for r in self.probe.rounds + self.probe.scoring * scored if r.version <= through]
        deadline = awake_now() + (limit := self.run.rollout.request_timeout_s + 30.0)  # a frozen job: no hang
        while pending() and awake_now() < deadline:
            self.probe.submit(self.engines)
            self.wait_on(self.engines.request_refs("probe") + self.engines.refs_of_loads() + self.probe.refs())
            self.advance_probe(learners_busy=False)
        if pending():
            log.warning("mismatch probe: versions %s not finished %.0f s %s", pending(), limit, why)

    def wait_on(self, refs: list[Any], timeout_s: float = 1.0) -> None:
        """Outside the schedule's pass (an evaluation, the final probe): wait up to `timeout_s` for one of `refs`,
        collect what came back, and let the pool repair hung engines and advance loads and restarts."""
        import ray

        self.collect(ray.wait(refs, num_returns=1, timeout=timeout_s)[0] if refs else [])
        self.engines.check_hung()
        self.engines.settle(block=False)

    def advance_probe(self, learners_busy: bool | None = None) -> None:
        """Move the mismatch probe on: failed requests, scoring by the learner ranks, their answer."""
        for request, engine in self.engines.take_failed_probes():
            self.probe.on_failure(request, engine)
        # Unless told: busy while a step trains or a batch waits for one (probe.py: scoring queued ahead of a step).
        busy = learners_busy if learners_busy is not None else self.training is not None or (
            self.state.step < self.run.steps and len(self.buffer) >= self.run.algo.prompts_per_step)
        self.probe.score(self.learners, self.engines, learners_busy=busy)
        self.probe.collect()

    def _sampling(self, request: Request) -> Any:
        return self.greedy if request.kind == "eval" else sampling_settings(self.run, self.tokenizer,
                                                                            seed=request.seed)

    def _wasted(self) -> int:
        """Admitted groups that will never be trained on (dropped stale, lost, discarded): their slots are free."""
        return self.buffer.dropped_stale + self.state.lost_groups + self.state.discarded_groups

    def collect(self, ready: list[Any]) -> None:
        """Score finished groups into the buffer; hand weight loads, restarts and failures to the engine pool."""
        for ref in ready:
            if ref in self._training_refs() or ref in self.probe.refs():
                continue
            out = self.engines.result(ref)
            if out is None:
                continue
            request, engine, completions = out
            if request.kind == "probe":
                self.probe.on_completion(request, engine, completions[0])
                continue
            if request.epoch != self.epoch:  # sampled by weights a rollback threw away
                self.state.discarded_groups += request.kind == "train"
                if request.kind == "eval":
                    self.engines.queue(dataclasses.replace(request, epoch=self.epoch))
                continue
            if request.kind == "eval":
                self.eval_results[request.index] = completions[0]
                continue
            self.state.generated_tokens += sum(len(c.token_ids) for c in completions)
            scoring = Scoring(request, engine, completions)
            if not drop_failed(self.run, completions, request.example, engine, self.state):  # nothing to score
                scoring.scores = submit_group(self.rewards, self.tokenizer, request.example, completions)
            self.scoring.append(scoring)

    def take_scored(self) -> None:
        """Groups whose rewards are in go to the buffer (shaped, DAPO); the rest keep scoring. A hung reward call
        holds its own group until `reward.timeout_s`, never this loop (its engine's requests keep being collected)."""
        if not self.scoring:
            return
        pending = [g.scores for g in self.scoring if g.scores is not None]
        if pending:  # most rewards take milliseconds: give them a moment before the loop moves on
            concurrent.futures.wait(pending, timeout=SCORING_POLL_S)
        still: list[Scoring] = []
        for g in self.scoring:
            if g.scores is not None and not g.scores.done():
                still.append(g)
                continue
            if g.request.epoch != self.epoch:  # sampled by weights a rollback threw away while it was scored
                self.state.discarded_groups += 1
                continue
            group = None if g.scores is None else score_group(self.run, g.request.example, g.completions,
                                                              self.state, g.engine, self.rewards,
                                                              g.scores.result())
            group = shape_group(self.run, group, self.state)
            if group is not None:
                self.buffer.put(group)
            else:
                self.state.lost_groups += 1
        self.scoring = still

    def take_finished(self) -> None:
        """What the engines have finished and the groups whose rewards are in, taken now (no waiting beyond
        SCORING_POLL_S): a checkpoint then saves those groups in its buffer rather than as requests in flight, which
        a resume samples again."""
        import ray

        refs = self.engines.refs()
        self.collect(ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else [])
        self.take_scored()

    def start_step(self) -> None:
        """Hand the learner ranks the next batch, if none is training and the buffer holds one."""
        if self.training:
            return
        if not self.is_async and len(self.buffer) >= self.run.algo.prompts_per_step and self.probe.enabled:
            # Sync: the probe of the batch's version is scored ahead of the step (the ranks idle until then), so the
            # step's row carries the probe of the weights it trained from (left to idle time: after the row).
            self.wait_for_probes(self.state.published, scored=False, why=f"before step {self.state.step + 1}")
        groups = self.buffer.take(self.run.algo.prompts_per_step, self.state.step)
        if groups is None:
            return
        self.train_batch = groups
        seqs = learner_sequences(groups)
        self.training = self.learners.submit("train", self.state.step, self.run.routing.replay,
                                             shares=self.learners.split(seqs), what=f"step {self.state.step + 1}")

    def _training_refs(self) -> list[Any]:
        return self.training.refs if self.training else []

    def step_done(self) -> bool:
        """Whether the training step in flight has finished on every rank; a dead or hung rank stops the run."""
        return self.training is not None and self.training.poll()

    def finish_step(self) -> dict[str, float]:
        """The finished step's metrics (rank 0's); a skipped step is counted, too many in a row stop the run."""
        results = self.training.results()
        self.training = None
        self.state.step += 1
        metrics = dict(results[0])
        metrics["train_seconds"] = max(r.get("train_seconds", 0.0) for r in results)
        if metrics.get("skipped"):
            self.state.steps_skipped += 1
            self.state.skipped_in_a_row += 1
            log.warning("step %d skipped (learner: %s)", self.state.step, metrics.get("error"))
        else:
            self.state.skipped_in_a_row = 0
        return metrics

    def stop_if_skipping(self, metrics: dict[str, float]) -> None:
        """`learner.max_skipped_in_a_row` non-finite steps in a row: the learner cannot be trained on; stop."""
        limit = self.run.learner.max_skipped_in_a_row
        if self.state.skipped_in_a_row >= limit:
            raise RuntimeError(f"{self.state.skipped_in_a_row} steps in a row (through step {self.state.step}) "
                               f"had a non-finite loss or gradient (learner.max_skipped_in_a_row={limit}); "
                               f"last: {metrics.get('error')}; {self._checkpoint_hint()}")

    def publish(self, metrics: dict[str, float]) -> None:
        """Every `sync_every` steps, and after the last step: the learner ranks publish the step's weights, the
        engines are offered them (the final evaluation and the exported policy are then the last step's weights)."""
        last = self.state.step == self.run.steps
        if not last and (metrics.get("skipped") or self.state.step % self.run.algo.sync_every):
            return
        self.push_version(self.state.step, background=self.is_async, probe=probe_due(self.run, self.state.step))

    def push_version(self, version: int, *, background: bool, probe: bool) -> None:
        """Publish `version`: the learner ranks write it (`probe`: each keeps a copy of the weights for the mismatch
        probe), the run records it as published, then `offer_version`. The one way a version goes out: a step's
        publish, the collapse guard's rollback, the final export; the start-up's goes out in the same two halves
        around the engines' start (`InitialWeights` has the ranks write it before there are engines, which start
        from its model directory; `train` then offers it)."""
        self.state.published = version
        self.learners.publish(version, background=background, snapshot=probe)
        self.offer_version(version, background=background, probe=probe)

    def offer_version(self, version: int, *, background: bool, probe: bool) -> None:
        """The engines' half of `push_version`: a probe round of `version` starts (`probe`), every engine is offered
        it; unless `background` (async: engines take it between forward passes, overlapped with the next step),
        wait until every engine serves it."""
        if probe:
            self.probe.start(version, list(self.engines.slots))
        self.engines.offer(version)
        if not background:
            self.engines.settle(block=True)

    def evaluate_if_due(self) -> None:
        every, step = self.run.eval_every, self.state.step
        if every and self.source.held_out and (step % every == 0 or step == self.run.steps):
            self.evaluate()

    def evaluate(self) -> None:
        """Greedy reward on the held-out set, spread over the engines (groups keep arriving meanwhile), of the
        newest published weights: it first waits until every engine serves them (in async mode a publish is only
        offered, and an engine still loading would score the version before; `python -m moe_grpo.evaluate` on
        the exported policy reproduces the final score only if the run's evaluation is of that version)."""
        self.engines.settle(block=True)
        examples = self.source.held_out
        self.eval_results = {}
        for i, example in enumerate(examples):
            request = Request("eval", example, index=i, epoch=self.epoch)
            self.engines.send(request, self.greedy)
        while len(self.eval_results) < len(examples):
            self.admit_retries()
            self.wait_on(self.engines.refs())
            self.take_scored()
        outs = [self.eval_results[i] for i in range(len(examples))]
        self.state.last_eval = score_held_out(self.rewards, self.tokenizer, examples, [o.token_ids for o in outs])
        self.state.last_eval_version = int(min(int(o.versions.min()) if len(o.versions) else 0 for o in outs))
        self.state.last_eval_step = self.state.step
        self.state.evals.append((self.state.step, self.state.last_eval))
        log.info("held-out reward at step %d (greedy, %d prompts): %.3f", self.state.step, len(examples),
                 self.state.last_eval)

    def admit_retries(self) -> None:
        self.engines.resend(self._sampling, self.epoch)

    def log(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's line of the run record."""
        now = time.perf_counter()
        interval = max(now - self.t_last, 1e-9)
        busy, abort_resubmits = 0.0, 0.0
        for name, stats in self.engines.stats(timeout_s=10).items():
            busy += max(0.0, stats["busy_seconds"] - self.busy_last.get(name, 0.0))
            self.busy_last[name] = stats["busy_seconds"]
            abort_resubmits += stats.get("resubmitted", 0.0)
        sync = combine_sync_metrics(newest_common_version(self.learners.call("sync_metrics", what="sync metrics")))
        self.advance_probe()
        row = step_row(self.state, metrics, self.train_batch, trained_version=self.state.step - 1,
                       interval=interval, train_seconds=metrics["train_seconds"],
                       infer_busy=busy / (interval * len(self.engines.slots)),
                       rollout_tokens=self.state.generated_tokens - self.tokens_at_last, sync=sync,
                       buffer=self.buffer, engines=self.engines, abort_resubmits=abort_resubmits)
        row["watch/jumps"] = float(self.watch.jumps)
        row.update(self.probe.row(self.run.routing.replay))
        self.record.log(row)
        self.write_processes()
        self.tokens_at_last = self.state.generated_tokens
        self.t_last = now
        return row

    def write_processes(self) -> None:
        """`processes.json` in the run directory (process_record.py): which process is which (rewritten when an
        engine restarts) and every process and /dev/shm entry the run has had, for whoever operates the run (and the
        fault tests, which signal them and check what the run left)."""
        if self.process_record is None:
            return
        if self.engines.take_changed():
            self.process_record.set_roles(self.learners.pids(),
                                          {n: s.pid for n, s in self.engines.slots.items()})
        self.process_record.update()

    # ------------------------------------------------------------------ the collapse guard
    def guard(self, metrics: dict[str, float]) -> bool:
        """The jump watch on the step just trained, before its weights are published; a rollback `rollback_due`
        decides on restores that checkpoint (the jumped weights are never published) and writes one of the restored
        state at this step's end. Returns whether it rolled back."""
        for message in self.watch.update({**metrics, "step": self.state.step}):
            log.warning(message)
        rollback = rollback_due(self.run, self.watch, self.state, metrics, self.run_dir, self._checkpoint_hint)
        if rollback is None:
            return False
        cfg, target = self.run.routing, rollback.target
        t0 = time.perf_counter()
        self.state.rollbacks += 1
        self.state.lr_scale *= cfg.rollback_lr_factor
        lr = self.run.learner.lr * self.state.lr_scale
        self.learners.call("load_run_state", str(target / "learner"), lr, what=f"rollback to {target.name}")
        saved = run_checkpoint.load_driver_state(target)
        jumps = self.watch.jumps
        self.watch.load_state_dict(saved["watch"])  # the running level from before the jump
        self.watch.jumps, self.watch.in_a_row = jumps, 0
        self.epoch += 1  # what is in flight was sampled by the weights being thrown away
        self.state.discarded_groups += self.buffer.clear()
        self.engines.drop_queued("train")
        # The restored weights go out as the current step's version (versions only grow), fresh prompts follow.
        self.push_version(self.state.step, background=False, probe=False)
        # `latest` names a checkpoint of the jump's steps: a resume from it would continue on the jumped weights.
        self.due = self.due or "rollback"
        log.warning("collapse guard: %s; restored %s, learning rate now %.3g (x%g), continuing with fresh prompts "
                    "(rollback %d of at most %d, %.1f s)", rollback.seen, target.name, lr,
                    cfg.rollback_lr_factor, self.state.rollbacks, cfg.max_rollbacks, time.perf_counter() - t0)
        return True

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The driver's part of a run checkpoint (the learner ranks write theirs alongside)."""
        engines = self.engines.state_dict()
        engines["requests"] = [r for r in engines["requests"] + [g.request for g in self.scoring]
                               if r.kind == "train" and r.epoch == self.epoch]  # scoring groups are sampled again
        return {"run_state": self.state.state_dict(), "buffer": self.buffer.state_dict(),
                "source": self.source.state_dict(), "engines": engines, "watch": self.watch.state_dict(),
                "rng": {"python": random.getstate(), "numpy": np.random.get_state()},
                "config": dataclasses.asdict(self.run), "lr_schedule": self.run.learner.schedule(self.run.steps)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.load_state_dict(saved["run_state"])
        self.buffer.load_state_dict(saved["buffer"])
        self.source.load_state_dict(saved["source"])
        self.watch.load_state_dict(saved["watch"])
        random.setstate(saved["rng"]["python"])
        np.random.set_state(saved["rng"]["numpy"])
        requests = [dataclasses.replace(r, epoch=0) for r in saved["engines"]["requests"]]
        self.engines.load_state_dict({**saved["engines"], "requests": requests})
        self.state.resume_resubmitted = len(requests)
        self.state.resume_buffered_groups = len(self.buffer)
        self.state.resumed_from = self.state.step
        self.state.published = self.state.step  # the resumed learner published its weights as this step's version

    def checkpoint(self, reason: str) -> Path:
        """Write a run checkpoint of the current step (no training step may be in flight)."""
        assert not self.training, "a checkpoint is taken between steps"
        t0 = time.perf_counter()
        self.take_finished()
        with run_checkpoint.writing(self.run_dir, self.state.step) as tmp:
            self.learners.call("save_run_state", str(tmp / "learner"), what=f"checkpoint of step {self.state.step}")
            meta = {"step": self.state.step, "reason": reason, "learner_ranks": len(self.learners),
                    "parallel": dataclasses.asdict(self.run.parallel), "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "jump_in_a_row": self.watch.in_a_row}  # > 0: inside a jump window, never a rollback target
            self.last_checkpoint = run_checkpoint.finish(tmp, self.state_dict(), meta, self.run.checkpoint.keep)
        log.info("checkpoint of step %d written to %s (%.1f s%s)", self.state.step, self.last_checkpoint,
                 time.perf_counter() - t0, "" if reason == "every" else f", on {reason}")
        self.due = None
        if self.stop_after_checkpoint:
            # The signal's name, not `reason`: a SIGTERM during a periodic checkpoint is "stopped by SIGTERM".
            raise Stopped(self.stop_after_checkpoint)
        return self.last_checkpoint

    def _checkpoint_hint(self) -> str:
        last = self.last_checkpoint
        return f"last checkpoint: {last} (resume=true continues from it)" if last else "no run checkpoint was written yet"

    # ------------------------------------------------------------------ signals
    def on_signal(self, signum: int | str) -> None:
        """SIGUSR1: checkpoint at the next step boundary, go on; SIGTERM, SIGHUP, SIGINT, GCS_LOST: then stop. Flags."""
        name = signum if isinstance(signum, str) else signal.Signals(signum).name
        if name != "SIGUSR1":  # the stop before the checkpoint it asks for: the GCS watch calls from its own thread
            self.stop_after_checkpoint, self.engines.stopping = name, True
        self.due = name
