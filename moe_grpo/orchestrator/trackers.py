"""Experiment trackers users already have (W&B, MLflow), fed what the run record writes.

Each tracker gets every row of metrics.jsonl (finite numbers only, at step
`row["step"]`) and the resolved config once at the start (W&B config /
MLflow params, flattened to `section.key`). `logger.*` turns them on; the
packages are optional extras, imported only when asked for, and checked
before the pools start so a missing one fails the run at once. A tracker that
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

    def __init__(self, name: str, log_fn: Callable[[dict[str, float], int], None], close_fn: Callable[[], None],
                 *, close_timeout_s: float = 120.0) -> None:
        self.name = name
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

    def close(self) -> None:
        self._queue.put((self._close, ()))
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


def open_trackers(cfg: LoggerConfig, run_dir: str | Path, config: Mapping[str, Any]) -> list[Guarded]:
    """The trackers `cfg` turns on, started with the resolved `config` (a nested mapping); empty when none is."""
    check_installed(cfg)
    trackers = []
    if cfg.wandb.mode != "disabled":
        trackers.append(wandb_tracker(cfg.wandb, run_dir, config))
    if cfg.mlflow.tracking_uri:
        trackers.append(mlflow_tracker(cfg.mlflow, run_dir, config))
    return trackers


def wandb_tracker(cfg: WandbConfig, run_dir: str | Path, config: Mapping[str, Any]) -> Guarded:
    """A W&B run in `<run_dir>/wandb/` (offline runs stay there for `wandb sync`)."""
    import wandb

    run = wandb.init(project=cfg.project, name=cfg.name or None, entity=cfg.entity or None, mode=cfg.mode,
                     dir=str(run_dir), config=dict(config),
                     # console capture would wrap the driver's stdout/stderr (progress bar, Ray's output): off; the
                     # run directory already holds the logs.
                     settings=wandb.Settings(console="off"))
    # run.dir is the run's files/ folder; its parent is what `wandb sync` takes
    log.info("W&B run %s (%s) in %s", run.name or run.id, cfg.mode, Path(run.dir).parent)

    def log_row(metrics: dict[str, float], step: int) -> None:
        run.log(metrics, step=step)

    return Guarded("W&B", log_row, run.finish)


def mlflow_tracker(cfg: MlflowConfig, run_dir: str | Path, config: Mapping[str, Any]) -> Guarded:
    """An MLflow run in experiment `cfg.experiment` at `cfg.tracking_uri`, through the client API (no global active
    run that code around the trainer could trip over)."""
    if cfg.tracking_uri.startswith("file:") or "://" not in cfg.tracking_uri:
        # MLflow 3 refuses the file store (in maintenance mode) unless told otherwise; the user named one, so allow it.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.experiment)
    experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(cfg.experiment)
    run = client.create_run(experiment_id, run_name=cfg.run_name or None,
                            tags={"moe_grpo.run_dir": str(Path(run_dir).resolve())})
    run_id = run.info.run_id
    params = [Param(k, str(v)[:MLFLOW_PARAM_VALUE_MAX]) for k, v in sorted(flatten(config).items())]
    for i in range(0, len(params), MLFLOW_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i:i + MLFLOW_PARAMS_PER_BATCH])
    log.info("MLflow run %s (%s) in experiment %r at %s", run.info.run_name, run_id, cfg.experiment, cfg.tracking_uri)

    def log_row(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        # one request per row: a row holds ~60 metrics, MLflow takes up to 1000 per batch
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close() -> None:
        client.set_terminated(run_id, status="FINISHED")

    return Guarded("MLflow", log_row, close)
