"""A whole run: what starts before the schedule and in which order, the schedule (`Driver`), its end (the final
checkpoint, the policy's export, the final probe) and the summary. `train` is what `python -m moe_grpo.train` and
the whole-run tests call; what the run creates around the schedule is released however it ends (`RunSession`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moe_grpo.data.tokenizer import load_tokenizer
from moe_grpo.orchestrator import run_checkpoint
from moe_grpo.orchestrator.cluster_watch import GCS_LOST, ClusterLost, ClusterUnreachable
from moe_grpo.orchestrator.driver import Driver, Stopped
from moe_grpo.orchestrator.engine_pool import EngineFailedError
from moe_grpo.orchestrator.groups import NothingToTrainError
from moe_grpo.orchestrator.initial_weights import InitialWeights
from moe_grpo.orchestrator.learner_group import LearnerFailedError
from moe_grpo.orchestrator.probe import probe_due
from moe_grpo.orchestrator.process_record import ProcessRecord, release_previous
from moe_grpo.orchestrator.resume import resume_point
from moe_grpo.orchestrator.run_prompts import engine_context, prompt_source
from moe_grpo.orchestrator.run_dirs import driving, low_disk_note
from moe_grpo.orchestrator.run_record import RecordWriteError, RunRecord
from moe_grpo.orchestrator.run_summary import RunSummary
from moe_grpo.orchestrator.session import RunSession, check_reward_paths, checked_plan, run_rewards
from moe_grpo.orchestrator.state import RunState
from moe_grpo.orchestrator.trackers import check_installed
from moe_grpo.processes import entries_phrase
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.validate import refused_inputs

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig

log = logging.getLogger("moe_grpo")

PART_FAILURES = (NothingToTrainError, LearnerFailedError, EngineFailedError, EngineError, RecordWriteError,
                 ClusterLost, ClusterUnreachable)
"""What stops a run because a part failed past what it repairs: a learner rank (dead, raising, hung), an engine that
cannot start or failed more than `rollout.max_restarts` times, a reward or the engines failing on everything, the run
record that cannot be written, the Ray cluster's GCS gone or not there to join. Each names the part and the cause;
`python -m moe_grpo.train` ends on it in one line (exit 1)."""


def train(run: RunConfig, run_dir: str | Path, *, learner_cls: type | None = None,
          config_yaml: str | None = None) -> dict[str, Any]:
    """Run `run.steps` optimizer steps (from the newest checkpoint with `run.resume`); returns the run's summary
    (`RunSummary.as_dict()`). What the run creates around the schedule is released however it ends (`RunSession`).

    `learner_cls`: a `LearnerWorker` subclass to run instead (tests inject slow or failing learners).
    `config_yaml`: the resolved config, written to `run_dir/config.yaml` once the run is accepted (a refused
    `resume=true` leaves the file of the run it refused to continue as it was)."""
    check_installed(run.logger)  # a missing tracker package fails now, not after the pools took minutes to start
    run_dir = str(Path(run_dir).resolve())
    with driving(run_dir):  # a second driver on this directory is refused, not run beside this one
        return _train(run, run_dir, learner_cls, config_yaml)


def _train(run: RunConfig, run_dir: str, learner_cls: type | None, config_yaml: str | None) -> dict[str, Any]:
    t_start, started_at = time.perf_counter(), time.time()  # started_at: the run's processes are those started after
    with refused_inputs():  # a missing or unusable file, a prompt too long, a reward that does not import
        tokenizer = load_tokenizer(run.model, run.init.hf)
        source = prompt_source(run, tokenizer, np.random.default_rng(run.seed), run_dir)  # bad rows reported here
        # The engines' context, decided once from the prompts (a run that cannot fit them stops here, not mid-run).
        context = engine_context(run, source)
        check_reward_paths(run)
    run = dataclasses.replace(run, rollout=dataclasses.replace(run.rollout, max_model_len=context))
    run, plan = checked_plan(run)  # which node runs what, checked and printed before anything starts
    state = RunState(bad_rows=source.bad_rows)
    resume_from, saved = resume_point(run, run_dir, state, source)
    if config_yaml is not None:
        Path(run_dir, "config.yaml").write_text(config_yaml)
    release_leftovers(run_dir)
    rewards = run_rewards(run)
    session = RunSession(run, run_dir, rewards, since=started_at)
    stopped = None
    try:
        start_checkpoint = session.start_conversion()  # init.hf: converted while Ray and the pools start
        session.open_trackers(state)
        session.start_ray()
        pools = session.start_pools(InitialWeights(run, run_dir, tokenizer, source, state, resume_from,
                                                   start_checkpoint), learner_cls, plan)
        driver = Driver(run, run_dir, pools, tokenizer, source, rewards, state)
        session.attach(driver)
        start_schedule(driver, saved, resume_from, session.processes)
        driver.record = session.record = RunRecord(run_dir, run.steps,
                                                   resume_step=state.step if resume_from is not None else None,
                                                   trackers=session.trackers)
        stopped = run_to_end(driver)
        session.outcome = "KILLED" if stopped else "FINISHED"
        if stopped == GCS_LOST:
            raise ClusterLost(f"{session.gcs_watch.why}; checkpoint {driver.last_checkpoint}: resume=true continues "
                              "from it once the cluster is back")
    except KeyboardInterrupt:  # SIGTERM during start-up, Ctrl-C then, or a second Ctrl-C
        session.outcome = "KILLED"
        if session.signals.stopped_start:  # a scheduler's stop, not a Ctrl-C: exit as any SIGTERM stop does
            raise SignalledTogether(f"stopped by {session.signals.stopped_start} during start-up, before step "
                                    f"{state.step + 1}: nothing new to checkpoint; run the same command again",
                                    session.signals.stopped_start) from None
        driver = session.driver
        where = f"after step {state.step}" if driver is not None and driver.record is not None else "during start-up"
        hint = driver._checkpoint_hint() if driver is not None else "no run checkpoint was written yet"
        raise SignalledTogether(f"interrupted by Ctrl-C {where}, without a checkpoint; {hint}", "SIGINT") from None
    except Exception as e:
        driver = session.driver
        died = isinstance(e, EngineFailedError) or getattr(e, "died", False)  # a process, not an error in one
        signalled = driver is not None and driver.stop_after_checkpoint not in (None, GCS_LOST)
        if session.gcs_lost() and not isinstance(e, ClusterLost) and (driver is None or died) and not signalled:
            session.outcome = "KILLED"
            hint = driver._checkpoint_hint() if driver is not None else "no run checkpoint was written yet"
            raise ClusterLost(f"{session.gcs_watch.why}, and the run's processes with it before a checkpoint "
                              f"({type(e).__name__}: {e}); {hint}") from e
        if driver is not None and driver.stop_after_checkpoint and died:  # of the same signal, as a rule
            session.outcome = "KILLED"
            hint = "" if driver._checkpoint_hint() in str(e) else f"; {driver._checkpoint_hint()}"
            advice = {"SIGHUP": "Start the run under nohup, tmux or screen, so that a closed terminal does not reach "
                                "it",
                      "SIGINT": "A Ctrl-C reaches every process of the terminal's group: a Ray cluster started from "
                                f"that terminal shares it; kill -INT {os.getpid()} reaches the driver alone"}.get(
                driver.stop_after_checkpoint, "Send it to the driver alone for a checkpoint first (#SBATCH "
                f"--signal=B:TERM@120, scancel --batch --signal=TERM, kill {os.getpid()})")
            raise SignalledTogether(
                f"stopped by {driver.stop_after_checkpoint}, which reached the run's own processes too and ended them "
                f"before the checkpoint ({type(e).__name__}: {e}){hint}. {advice}",
                driver.stop_after_checkpoint) from e
        if isinstance(e, (EngineFailedError, RecordWriteError)):
            hint = driver._checkpoint_hint() if driver else "no run checkpoint was written"
            raise type(e)(f"{e}; {hint}{low_disk_note(run_dir)}") from e
        if isinstance(e, LearnerFailedError) and (note := low_disk_note(run_dir)):  # a checkpoint's write failing
            raise LearnerFailedError(f"{e}{note}", died=e.died) from e
        raise
    finally:
        session.close()
    return RunSummary.of(state, driver.engines, driver.last_checkpoint, run_dir=run_dir,
                         seconds=time.perf_counter() - t_start, stopped=stopped, sync=session.sync_report,
                         mismatch=driver.probe.row(run.routing.replay)).as_dict()


def start_schedule(driver: Driver, saved: dict[str, Any] | None, resume_from: Path | None,
                   processes: ProcessRecord) -> None:
    """Before the first pass: the resumed state loaded (`saved`), the engines offered the start-up's version (the
    learner ranks wrote it in `InitialWeights`), and a fresh run's held-out reward at step 0."""
    run, state = driver.run, driver.state
    driver.last_checkpoint = resume_from
    driver.process_record = processes
    driver.write_processes()
    if saved is not None:
        driver.load_state_dict(saved)
        log.info("resume: %d buffered group(s) restored, %d prompt(s) that were in flight sent again",
                 state.resume_buffered_groups, state.resume_resubmitted)
    driver.offer_version(state.published, background=False, probe=probe_due(run, state.published))
    if run.eval_every and not driver.source.held_out:
        log.info("no held-out set (data.eval_path is not set): no evaluation")
    if run.eval_every and driver.source.held_out and resume_from is None:
        driver.evaluate()


def release_leftovers(run_dir: str) -> None:
    """Before this run's record replaces it: what the previous run in this directory left (process_record.py)."""
    removed, alive = release_previous(run_dir)
    if removed:
        log.warning("removed %s the previous run in this directory left (killed before it could clean up)",
                    entries_phrase(removed))
    if alive:
        log.warning("processes of the previous run in this directory are still alive: %s", "; ".join(alive))


class SignalledTogether(RuntimeError):
    """A SIGTERM (or SIGHUP) stopped the run without its checkpoint: it reached the driver and the run's other
    processes at once (`scancel` without `--batch`, a time limit without `--signal`, `timeout`, a kill of the process
    group, a closed terminal) and they died before the driver's checkpoint; or it came during the start-up, when there
    is nothing to checkpoint."""

    def __init__(self, message: str, signal_name: str = "SIGTERM") -> None:
        super().__init__(message)
        self.signal_name = signal_name
        """The signal's name: the exit status is 128 + its number, as a shell reports it."""


def run_to_end(driver: Driver) -> str | None:
    """The schedule, the final checkpoint and the policy's export. Returns the signal that stopped the run once its
    checkpoint was written (a SIGTERM that lands after the last step stops it at the final checkpoint, the export
    left to the resumed run), or None when the run finished."""
    try:
        driver.run_schedule()
        last, step = driver.last_checkpoint, driver.state.step
        if driver.run.checkpoint.at_end and (last is None or last.name != run_checkpoint.step_name(step)):
            driver.checkpoint("end")
    except Stopped as e:
        return str(e)
    policy_dir = export_policy(driver)
    log.info("final policy (version %d) exported to %s", driver.state.step, policy_dir)
    driver.finish_probes()
    return None


def export_policy(driver: Driver) -> str:
    """The final weights as an HF directory vLLM serves (`run_dir/policy`, with the checkpoint's tokenizer)."""
    step = driver.state.step
    if driver.state.published != step:  # the last steps were not published (sync_every, or a skipped step)
        driver.push_version(step, background=False, probe=False)
    return driver.learners.call("export_version", step, os.path.join(driver.run_dir, "policy"),
                                what="exporting the policy", ranks=1)[0]
