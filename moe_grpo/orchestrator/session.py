"""A run's signals and its cleanup: what `train` installs before anything starts and runs however the run ends.

SIGTERM / SIGUSR1 (what SLURM sends before preemption) become the driver's checkpoint at the next step boundary
(`SignalRelay`). Once the run is ending, a signal cannot stop the cleanup: SLURM sends SIGTERM again at the time
limit, a user may press on; each is noted and the cleanup goes on to its last step (`Teardown`), since a cleanup cut
short leaves the run's processes, weight slots and private directory behind. Ray installs a SIGTERM handler of its
own that exits on the spot; the relay is installed over it and, at the end, gives back the handlers from before Ray.
Ray's shutdown also resets SIGTERM under Python's feet (`keep_handlers_through_ray_shutdown`).

`RunSession` holds what a run creates around the schedule (weight slots, trackers, Ray, the pools, the run record)
and releases it however the run ends (`close`); `checked_plan` and `run_rewards` are the start-up's other parts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import time
from concurrent import futures
from typing import TYPE_CHECKING, Any, Callable

from moe_grpo.checkpoint.hf_init import LearnerStartCheckpoint
from moe_grpo.orchestrator import pools as pool_setup  # the module: tests stand in for its start_ray
from moe_grpo.orchestrator.cluster_watch import GCS_LOST, GcsWatch
from moe_grpo.orchestrator.placement_plan import Plan, PlanRefused, build_plan, not_runnable_yet
from moe_grpo.orchestrator.pools import Pools
from moe_grpo.orchestrator.process_record import ProcessRecord
from moe_grpo.orchestrator.run_dirs import make_sync_root, release_private_dir
from moe_grpo.orchestrator.run_record import RunRecord
from moe_grpo.orchestrator.state import RunState
from moe_grpo.orchestrator.trackers import close_trackers, open_trackers
from moe_grpo.process_ties import remove_recorded_shm
from moe_grpo.processes import entries_phrase
from moe_grpo.reward.functions import RewardFunction, Rewards
from moe_grpo.validate import InputRefused

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig
    from moe_grpo.evaluation.config import EvaluateConfig
    from moe_grpo.orchestrator.driver import Driver

log = logging.getLogger("moe_grpo")


RAY_CHECKED = "2.60.0"
"""The Ray version `keep_handlers_through_ray_shutdown` was checked against."""


def keep_handlers_through_ray_shutdown() -> None:
    """Call before `ray.init`. The driver's core worker installs absl's failure-signal handler (a stack trace on a
    crash), and `ray.shutdown()` uninstalls it by setting SIGTERM, among others, to SIG_DFL at the C level, under
    Python's feet (Python still reports its own handler): a SIGTERM that lands during the rest of the shutdown (Ray's
    processes being stopped) or after it kills the driver mid-cleanup, exit -15 (seen with Ray 2.60.0). Ray's own
    switch for it (RAY_DISABLE_FAILURE_SIGNAL_HANDLER, which it reads once, when it is imported) is turned on here for
    this process only: Ray's worker processes keep theirs."""
    from ray._private import ray_constants

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


class SignalRelay:
    """SIGTERM / SIGHUP / SIGUSR1 -> the driver's checkpoint at the next step boundary (SIGTERM and SIGHUP: then it
    stops). Before the schedule runs there is nothing to checkpoint: SIGTERM or SIGHUP then stops the start-up at once
    (cleanly). While the run cleans up (`hold`), a signal is only noted. SIGHUP is what a driver gets when the ssh
    session or terminal it was started from closes: by default it killed the driver at once, its processes, vLLM's
    ring buffers and its weight slots left behind (a user's trial, 2026-11-28)."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGINT)
    STOPPING = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    """The signals after which the run stops (once its checkpoint is written). A second Ctrl-C stops it at once,
    without one: before 2026-11-28 the first did (a 50-line KeyboardInterrupt traceback, and every step since the
    last periodic checkpoint lost: a user's trial, 11 steps with checkpoint.every=50)."""
    HELD = SIGNALS
    """Signals held during the cleanup (a second Ctrl-C must not cut the cleanup of the first short)."""

    def __init__(self) -> None:
        self.driver: Any = None
        self.original = {signum: signal.getsignal(signum) for signum in self.HELD}
        """The handlers before the run (and before Ray's): what `restore` gives back."""
        self.holding = False
        self.held: list[str] = []
        """Signals that arrived while the run cleaned up, by name."""
        self.stopped_start: str | None = None
        """The signal (SIGTERM) that stopped the start-up, before the schedule ran; None otherwise. Ray turns the
        KeyboardInterrupt it raises into one of its own, without the message, on the way out."""

    def install(self) -> None:
        for signum in self.SIGNALS:
            if signum in (signal.SIGHUP, signal.SIGINT) and self.original.get(signum) == signal.SIG_IGN:
                continue  # started under nohup, or in the background by a script: as it asked, left alone
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        if self.holding:  # only a note: a handler must not take locks (the log's) the interrupted code may hold
            self.held.append(signal.Signals(signum).name)
        elif self.driver is not None and self.driver.record is not None:
            if signum == signal.SIGINT and self.driver.stop_after_checkpoint == "SIGINT":
                raise KeyboardInterrupt  # the second Ctrl-C: now, without the checkpoint
            self.driver.on_signal(signum)
            if signum == signal.SIGINT:  # os.write: no lock (print's, the log's) the interrupted code may hold
                done = self.driver.state.step >= self.driver.run.steps  # the final checkpoint, export, probe
                os.write(2, b"\n[moe_grpo] Ctrl-C: " + (b"the steps are done; finishing the run's end (Ctrl-C "
                                                         b"again abandons it)\n" if done else
                                                         b"stopping after a checkpoint at the end of this step "
                                                         b"(Ctrl-C again stops at once, without one)\n"))
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        elif signum in self.STOPPING:
            self.stopped_start = signal.Signals(signum).name
            raise KeyboardInterrupt(f"{self.stopped_start} during start-up")

    def hold(self) -> None:
        """From now until `restore`, signals are noted and nothing else (installed here too: the run may be ending
        before `install` was reached)."""
        self.holding = True
        for signum in self.HELD:
            signal.signal(signum, self.handle)

    def restore(self) -> None:
        for signum, handler in self.original.items():
            signal.signal(signum, handler)


class Teardown:
    """The run's cleanup: named steps run in order, each whatever the ones before did (a step that fails is logged,
    and the rest still run), with signals held (`SignalRelay.hold`) from the first step until the last is done."""

    def __init__(self, signals: SignalRelay, after_each: Callable[[], None] | None = None) -> None:
        """`after_each`: called after every step (the process record is brought up to date there)."""
        self.signals = signals
        self.after_each = after_each
        self.steps: list[tuple[str, Callable[[], Any]]] = []
        self.done: list[str] = []
        self.failed: list[str] = []
        self.seconds: dict[str, float] = {}
        """Each step's time, its process record's update included (the log's last line names the slow ones)."""

    def add(self, name: str, step: Callable[[], Any]) -> None:
        self.steps.append((name, step))

    def run(self) -> None:
        self.signals.hold()
        t0 = time.perf_counter()
        try:
            for name, step in self.steps:
                t_step = time.perf_counter()
                try:
                    step()
                    self.done.append(name)
                except Exception as e:  # noqa: BLE001 - one release failing must not keep the others from running
                    self.failed.append(name)
                    log.warning("cleanup: %s failed (%s: %s); the rest of the cleanup goes on", name,
                                type(e).__name__, e)
                self.signals.hold()  # again: a step may have reset a handler at the C level (ray.shutdown does)
                if self.after_each is not None:
                    try:
                        self.after_each()
                    except Exception as e:  # noqa: BLE001 - a record of the cleanup must not stop it
                        log.warning("cleanup: the process record after %s could not be written (%s)", name, e)
                self.seconds[name] = time.perf_counter() - t_step
        finally:
            held = self.signals.held
            if held:
                counts = {name: held.count(name) for name in dict.fromkeys(held)}
                log.warning("cleanup: %s arrived during it and did not cut it short",
                            ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items()))
            slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:3]
            log.info("cleanup done in %.1f s (%s)", time.perf_counter() - t0,
                     ", ".join(f"{name} {s:.1f} s" for name, s in slowest if s >= 0.05) or "no step took 0.1 s")
            self.signals.restore()


def _tell_gcs_lost(driver: Driver) -> None:
    """The GCS stopped answering: stop after a checkpoint, unless a signal already stops the run. A SIGTERM to every
    process of a run on its own cluster ends its GCS too: that stop is the signal's (exit 143), and its GCS going
    5 s later is not news (it stopped such a run as a lost cluster, exit 1, when the learner's death took longer)."""
    if not driver.stop_after_checkpoint:
        driver.on_signal(GCS_LOST)


class RunSession:
    """What a run creates around its schedule, started in order and released by `close` however the run ends.

    Made before anything starts: the run's weight buffers on this host (private and held by this process,
    run_dirs.py, before any actor opens them; what SIGKILLed runs left under the root is swept first), the signal
    relay (before Ray: it gives back the handlers from before Ray's) and the process record."""

    def __init__(self, run: RunConfig, run_dir: str, rewards: Rewards, *, since: float) -> None:
        from moe_grpo.sync.layout import host_root  # brings torch in: the dry run and --help import this module

        self.run, self.run_dir, self.rewards = run, run_dir, rewards
        self.sync_name, self.sync_root = make_sync_root(host_root(run.sync.root))
        self.signals = SignalRelay()
        self.processes = ProcessRecord(run_dir, sync_root=self.sync_root, since=since)
        self.trackers: list[Any] = []
        self.ray_was_up, self.ray_own = True, False  # until start_ray: nothing of Ray is the run's to end
        self.private_dir: str | None = None
        self.gcs_watch: GcsWatch | None = None
        """The Ray cluster's GCS watched from `start_ray` on (cluster_watch.py); a loss stops the driver."""
        self.start_checkpoint: LearnerStartCheckpoint | None = None
        """init.hf's conversion for the learner ranks (`start_conversion`), stopped by `close` if still running."""
        self.pools: Pools | None = None
        self.driver: Driver | None = None
        self.record: RunRecord | None = None
        self._drawing: futures.Future | None = None
        """The record's PNG being drawn (`_close_record`)."""
        self.sync_report: dict[str, Any] = {}
        """What each sync host under the relay received, filled in by `close` (the run's summary)."""
        self.outcome = "FAILED"
        """How the trackers' runs end: FINISHED, KILLED or FAILED."""

    def open_trackers(self, state: RunState) -> None:
        """Before the pools: a bad key or an unreachable server fails the run now, not minutes in. A resumed run goes
        on in its checkpoint's tracker runs; their ids go into every checkpoint from here."""
        self.processes.update()
        self.trackers = open_trackers(self.run.logger, self.run_dir, dataclasses.asdict(self.run),
                                      resume=state.tracker_runs)
        state.tracker_runs = {t.key: t.run_id for t in self.trackers}

    def start_conversion(self) -> LearnerStartCheckpoint:
        """The learner ranks' initial checkpoint: init.hf converted (or found in the cache) on a thread while Ray and
        the pools start (checkpoint/hf_init.py)."""
        self.start_checkpoint = LearnerStartCheckpoint(self.run.init, self.run_dir)
        return self.start_checkpoint

    def start_ray(self) -> None:
        import ray

        keep_handlers_through_ray_shutdown()  # before Ray: its shutdown would reset SIGTERM under Python's feet
        self.ray_was_up = ray.is_initialized()  # the caller's connection: left to the caller
        self.private_dir = pool_setup.start_ray(self.run.cluster, self.run_dir)
        self.ray_own = self.private_dir is not None  # a cluster of the run's own: its shutdown ends everything
        self.gcs_watch = GcsWatch(ray.get_runtime_context().gcs_address, self.run.cluster.gcs_lost_after_s)
        self.gcs_watch.start()
        self.signals.install()  # after Ray, whose own SIGTERM handler would exit without cleaning up
        self.processes.update()

    def start_pools(self, initial_weights: Callable[[Any], str], learner_cls: type | None, plan: Plan) -> Pools:
        """The learner ranks and engines (pools.py); `initial_weights(learners)` gives the engines' model directory."""
        t0 = time.perf_counter()
        self.pools = pools = pool_setup.start_pools(self.run, self.run_dir, self.sync_name, initial_weights,
                                                    learner_cls,
                                                    bundle_nodes=plan.bundle_nodes() if plan.pinned else None,
                                                    engine_worker_nodes=plan.engine_worker_nodes() if plan.pinned
                                                    else None)
        log.info("pools up in %.0fs: %d engine(s), %d learner rank(s) (%.2fM parameters on rank 0)",
                 time.perf_counter() - t0, len(pools.engines), len(pools.learners),
                 pools.learners.infos[0].parameters / 1e6)
        return pools

    def attach(self, driver: Driver) -> None:
        """The schedule's driver: signals reach it from here, and `close` releases its engines."""
        self.driver = self.signals.driver = driver
        if self.gcs_watch is not None:
            self.gcs_watch.on_lost = lambda why: _tell_gcs_lost(driver)
            if self.gcs_watch.lost_at is not None:  # lost during the start-up: a checkpoint before any step
                _tell_gcs_lost(driver)

    def close(self) -> None:
        """Each step runs whatever the ones before did, with signals held: a second SIGTERM cannot cut it short."""
        teardown = Teardown(self.signals, after_each=lambda: self.processes.update(full=True))
        gcs_lost = self.gcs_lost()
        if self.gcs_watch is not None:
            teardown.add("the GCS watch", self.gcs_watch.stop)
        if self.start_checkpoint is not None:  # a conversion still running when the start failed or was stopped
            teardown.add("the checkpoint conversion", self.start_checkpoint.close)
        teardown.add("the reward workers", self.rewards.close)
        teardown.add("the run record", self._close_record)  # its PNG drawn beside the steps below
        teardown.add("the trackers", lambda: close_trackers(self.trackers, self.outcome))
        # The relay agents' cleanup runs inside this step, once the engines are shut down and before Ray goes: the
        # engines' /dev/shm records on the agents' hosts lie in the buffers the agents remove.
        teardown.add("the pools and the sync hosts", lambda: pool_setup.stop_pools(
            self.pools, list(self.driver.engines.handles().values()) if self.driver is not None else None,
            release=not self.ray_own and not gcs_lost, disconnect=not self.ray_was_up,
            after_engines=self._stop_sync_hosts))
        if gcs_lost and self.ray_own:  # Ray cannot end what it started any more (all of it on this host): killed
            teardown.add("the run's processes Ray left", self._kill_left)
        teardown.add("what killed processes left in /dev/shm", self._release_shm)
        teardown.add("the private directory", lambda: release_private_dir(self.private_dir, self.run_dir))
        teardown.add("the weight slots", lambda: shutil.rmtree(self.sync_root, ignore_errors=True))
        teardown.add("the plot", self._plotted)
        teardown.run()

    def gcs_lost(self) -> bool:
        """Whether the GCS watch reported the cluster's GCS gone (nothing that needs it is asked of Ray then: removing
        the run's placement group would wait on it until Ray ends the process)."""
        return self.gcs_watch is not None and self.gcs_watch.lost_at is not None

    def _kill_left(self) -> None:
        self.processes.update(full=True)
        killed = self.processes.kill_alive()
        if killed:
            log.warning("cleanup: killed %d process(es) of the run that Ray, its GCS gone, could not end: %s",
                        len(killed), ", ".join(map(str, killed)))

    def _release_shm(self) -> None:
        """The /dev/shm entries the run's processes created and did not remove (engines killed, not shut down)."""
        removed = sorted(set(self.processes.release_shm()) | set(remove_recorded_shm(self.sync_root)))
        if removed:
            log.warning("cleanup: removed %s the run's processes left (killed rather than shut down)",
                        entries_phrase(removed))

    def _close_record(self) -> None:
        """The record's files closed, its PNG drawn on a thread (~1 s of matplotlib on 2 cores, done while the
        steps after this one mostly wait on Ray's and vLLM's processes to end); `_plotted` waits for it."""
        if self.record is not None:
            self.record.close_files()
            drawer = futures.ThreadPoolExecutor(1, thread_name_prefix="moe_grpo-plot")
            self._drawing = drawer.submit(self.record.draw)
            drawer.shutdown(wait=False)  # its thread ends once the PNG is drawn

    def _plotted(self) -> None:
        if self._drawing is not None:
            png = self._drawing.result()
            if png:
                log.info("plots: %s", png)

    def _stop_sync_hosts(self) -> None:
        """Each host's buffers under the relay removed (with what its dead engines left in /dev/shm); what each
        received goes into `sync_report`."""
        from moe_grpo.orchestrator.sync_hosts import relay_report, stop_sync_hosts  # brings torch in

        if self.pools is not None:
            self.sync_report.update(relay_report(self.pools.sync, self.pools.sync_agents or []))
            removed = stop_sync_hosts(self.pools.sync_agents or [], engines_stopped=True)
            if removed:
                log.warning("cleanup: removed %s that engines on the sync hosts left", entries_phrase(removed))


def checked_plan(run: RunConfig) -> tuple[RunConfig, Plan]:
    """Log the placement plan (orchestrator/placement_plan.py); return it and `run` with what it decided (a slurm
    plan's nodes, learner ranks and GPUs per actor). Raises PlanRefused with every reason for a plan that cannot
    run."""
    plan = build_plan(run, seq_len=run.rollout.max_model_len)
    log.info("%s", plan.render())
    if not plan.ok:
        raise PlanRefused(plan.refusal())
    limits = not_runnable_yet(plan)
    if limits:
        raise PlanRefused("this build cannot run the plan yet: " + "; ".join(limits))
    return dataclasses.replace(run, cluster=plan.cluster_for_run(run.cluster)), plan


def check_reward_paths(run: RunConfig | EvaluateConfig) -> None:
    """Import each reward function (`reward.fn`) and nothing more: a path that does not import, or names no
    function, fails here by name, before any process starts."""
    for path in run.reward.resolved(run.task.name)[0]:
        try:
            RewardFunction.load(path)
        except TypeError as e:  # the path names something that is no function: an input, not a bug
            raise InputRefused(str(e)) from e
    log.info("reward: %s", run.reward.describe(run.task.name))


def run_rewards(run: RunConfig) -> Rewards:
    """The run's reward functions and their workers (closed by `RunSession.close`)."""
    return Rewards(*run.reward.resolved(run.task.name), timeout_s=run.reward.timeout_s, workers=run.reward.workers)
