"""Experiment trackers users already have (W&B, MLflow), fed what the run record writes.

Each tracker gets every row of metrics.jsonl (finite numbers only, at step
`row["step"]`) and the resolved config once at the start (W&B config /
MLflow params, flattened to `section.key`). `logger.*` turns them on; the
packages are optional extras, imported only when asked for. The tracker runs
are created before the pools start, so a missing package, a bad key or an
unreachable server fails the run at once, and ended as the run ended
(`STATUSES`: finished, failed, killed by a signal). Their ids go into the run
checkpoint: a resumed run goes on in the same tracker runs. A tracker that
fails mid-run (network, quota) is warned about once and the run goes on: the
run's own record (metrics.jsonl, TensorBoard) is what it cannot lose.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from moe_grpo.orchestrator.config import LoggerConfig, MlflowConfig, WandbConfig

log = logging.getLogger("moe_grpo")

MLFLOW_PARAM_VALUE_MAX = 6000
"""MLflow refuses longer parameter values (its `MAX_PARAM_VAL_LENGTH`); longer ones are cut to this."""
MLFLOW_PARAMS_PER_BATCH = 100
"""Parameters per `log_batch` call (MLflow's limit per request; the resolved config has a few hundred)."""
STATUSES = ("FINISHED", "FAILED", "KILLED")
"""How a run ended, in MLflow's words: it took its steps; it failed; a signal (SIGTERM, Ctrl-C) stopped it."""
WANDB_EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 128 + 15}
"""W&B takes how a run ended as its exit code (not 0: failed); a stopped run's is what a shell reports for SIGTERM."""


def check_installed(cfg: LoggerConfig) -> None:
    """Fail before anything starts if a tracker is asked for and its package is missing."""
    wanted = []
    if cfg.wandb.mode != "disabled":
        wanted.append(("wandb", "wandb", f"logger.wandb.mode={cfg.wandb.mode}"))
    if cfg.mlflow.tracking_uri:
        wanted.append(("mlflow", "mlflow", f"logger.mlflow.tracking_uri={cfg.mlflow.tracking_uri}"))
    for module, extra, why in wanted:
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"{why} needs the '{module}' package, which is not installed; "
                              f"install it with `pip install -e .[{extra}]` (from the repository root)")


def finite_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row as the numbers a tracker can take: finite floats, without the step (the x axis)."""
    out = {}
    for key, value in row.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> {'algo.group_size': 8, ...}; lists and tuples stay values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


class Guarded:
    """A tracker fed from a background thread, whose failures are logged once and then ignored.

    The thread keeps a slow or unreachable server (MLflow retries an HTTP call for minutes) from stalling training;
    rows keep their order. Trackers hold copies of the run record, so the run goes on without them."""

    def __init__(self, name: str, log_fn: Callable[[dict[str, float], int], None], close_fn: Callable[[str], None],
                 *, close_timeout_s: float = 120.0, key: str = "", run_id: str = "") -> None:
        """`close_fn(status)` ends the tracker's run (`status`: one of `STATUSES`); `key` and `run_id` name the
        tracker and its run, which a resumed run goes on in."""
        self.name = name
        self.key, self.run_id = key or name, run_id
        self._log = log_fn
        self._close = close_fn
        self.close_timeout_s = close_timeout_s  # how long close() waits for queued rows: the run ends regardless
        self.failures = 0
        self._queue: queue.Queue[tuple[Callable[..., None], tuple[Any, ...]] | None] = queue.Queue()
        # daemon: a tracker stuck on the network must not keep the finished process alive
        self._thread = threading.Thread(target=self._work, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def log(self, row: Mapping[str, Any]) -> None:
        metrics = finite_metrics(row)
        if metrics:
            self._queue.put((self._log, (metrics, int(row["step"]))))

    def close(self, status: str = "FINISHED") -> None:
        """End the tracker's run as `status` (one of `STATUSES`), after the rows queued before."""
        if status not in STATUSES:
            raise ValueError(f"tracker status {status!r}, expected one of {STATUSES}")
        self._queue.put((self._close, (status,)))
        self._queue.put(None)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning("%s tracker: rows still unsent after %.0fs at the end of the run; giving up on them "
                        "(metrics.jsonl has them all)", self.name, self.close_timeout_s)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - any tracker error (network, server, quota) must not stop training
                self.failures += 1
                if self.failures == 1:
                    log.warning("%s tracker failed (%s: %s); training goes on, metrics.jsonl and TensorBoard keep "
                                "the record; further %s errors are not reported", self.name, type(e).__name__, e,
                                self.name)


def open_trackers(cfg: LoggerConfig, run_dir: str | Path, config: Mapping[str, Any],
                  resume: Mapping[str, str] | None = None) -> list[Guarded]:
    """The trackers `cfg` turns on, started with the resolved `config` (a nested mapping); empty when none is.
    `resume`: tracker key ('wandb', 'mlflow') -> the id of the run to go on in (saved in the run checkpoint).
    If one fails to start, those already started are ended FAILED."""
    check_installed(cfg)
    resume = resume or {}
    trackers: list[Guarded] = []
    try:
        if cfg.wandb.mode != "disabled":
            trackers.append(wandb_tracker(cfg.wandb, run_dir, config, resume.get("wandb")))
        if cfg.mlflow.tracking_uri:
            trackers.append(mlflow_tracker(cfg.mlflow, run_dir, config, resume.get("mlflow")))
    except BaseException:
        close_trackers(trackers, "FAILED")
        raise
    return trackers


def close_trackers(trackers: list[Guarded], status: str) -> None:
    """End each tracker's run as `status` (one of `STATUSES`)."""
    for tracker in trackers:
        tracker.close(status)


def wandb_tracker(cfg: WandbConfig, run_dir: str | Path, config: Mapping[str, Any],
                  run_id: str | None = None) -> Guarded:
    """A W&B run in `<run_dir>/wandb/` (offline runs stay there for `wandb sync`, which puts a resumed run's parts
    into one run); `run_id`: go on in that run (its config updated to the resumed run's)."""
    import wandb

    run = wandb.init(project=cfg.project, name=cfg.name or None, entity=cfg.entity or None, mode=cfg.mode,
                     dir=str(run_dir), config=dict(config), id=run_id or None, resume="allow" if run_id else None,
                     # console capture would wrap the driver's stdout/stderr (progress bar, Ray's output): off; the
                     # run directory already holds the logs.
                     settings=wandb.Settings(console="off"))
    # run.dir is the run's files/ folder; its parent is what `wandb sync` takes
    log.info("W&B run %s (%s%s) in %s", run.name or run.id, cfg.mode, ", resumed" if run_id else "",
             Path(run.dir).parent)

    def log_row(metrics: dict[str, float], step: int) -> None:
        run.log(metrics, step=step)

    def close(status: str) -> None:
        run.finish(exit_code=WANDB_EXIT_CODES[status])

    return Guarded("W&B", log_row, close, key="wandb", run_id=run.id)


def mlflow_tracker(cfg: MlflowConfig, run_dir: str | Path, config: Mapping[str, Any],
                   run_id: str | None = None) -> Guarded:
    """An MLflow run in experiment `cfg.experiment` at `cfg.tracking_uri`, through the client API (no global active
    run that code around the trainer could trip over). `run_id`: go on in that run (RUNNING again; parameters it does
    not have yet are added, and those the resumed run changed keep their first value: MLflow refuses a change)."""
    if cfg.tracking_uri.startswith("file:") or "://" not in cfg.tracking_uri:
        # MLflow 3 refuses the file store (in maintenance mode) unless told otherwise; the user named one, so allow it.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    params = {k: str(v)[:MLFLOW_PARAM_VALUE_MAX] for k, v in sorted(flatten(config).items())}
    resumed = bool(run_id)
    if run_id:
        run = client.get_run(run_id)  # a run the tracking server no longer has fails here, naming the id
        client.update_run(run_id, status="RUNNING")
        kept = run.data.params
        changed = sorted(k for k, v in params.items() if k in kept and kept[k] != v)
        params = {k: v for k, v in params.items() if k not in kept}
        if changed:
            log.info("MLflow run %s resumed; parameters changed since it began keep their first value there: %s",
                     run_id, ", ".join(changed))
    else:
        experiment = client.get_experiment_by_name(cfg.experiment)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(cfg.experiment)
        run = client.create_run(experiment_id, run_name=cfg.run_name or None,
                                tags={"moe_grpo.run_dir": str(Path(run_dir).resolve())})
        run_id = run.info.run_id
    batch = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(batch), MLFLOW_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=batch[i:i + MLFLOW_PARAMS_PER_BATCH])
    log.info("MLflow run %s (%s%s) in experiment %r at %s", run.info.run_name, run_id, ", resumed" if resumed else "",
             cfg.experiment, cfg.tracking_uri)

    def log_row(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        # one request per row: a row holds ~60 metrics, MLflow takes up to 1000 per batch
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(status: str) -> None:
        client.set_terminated(run_id, status=status)

    return Guarded("MLflow", log_row, close, key="mlflow", run_id=run_id)
