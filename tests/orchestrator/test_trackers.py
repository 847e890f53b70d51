"""W&B and MLflow get what metrics.jsonl gets (finite values, at each row's step) and the resolved config; read back
through their own files and clients. Fast: no engines, no learners."""

import dataclasses
import glob
import json
import logging
import math
import struct
import time

import pytest

from moe_grpo.config import from_hydra, load_model_spec
from moe_grpo.orchestrator import trackers
from moe_grpo.orchestrator.config import LoggerConfig, MlflowConfig, WandbConfig
from moe_grpo.orchestrator.run_record import REQUIRED_KEYS, RunRecord
from test_config import compose  # noqa: E402 - tests/ is on sys.path (rootdir conftest)

NAN = float("nan")


def run_config(**logger):
    from moe_grpo.config import RunConfig

    return RunConfig(model=load_model_spec("deepseek_moe"), logger=LoggerConfig(**logger))


def rows(n=3):
    """Run-record rows as the driver writes them: every required key, some NaN (not measured yet)."""
    out = []
    for step in range(1, n + 1):
        row = {k: 0.0 for k in REQUIRED_KEYS}
        row.update({"step": step, "policy_version": step, "reward/mean": 0.25 * step, "loss": -0.5 / step,
                    "mismatch/kl": NAN if step == 1 else 1e-3 * step, "kl/reference": NAN})
        out.append(row)
    return out


def write_record(tmp_path, run, status="FINISHED", resume=None, steps=(1, 2, 3)):
    """What `train` does with the trackers: open them (going on in `resume`'s runs), feed them the record's rows,
    end them as the run ended. Returns the rows written and the tracker runs' ids (what the checkpoint saves)."""
    opened = trackers.open_trackers(run.logger, tmp_path / "run", dataclasses.asdict(run), resume=resume)
    record = RunRecord(tmp_path / "run", total_steps=3, progress=False, trackers=opened,
                       resume_step=steps[0] - 1 if resume else None)
    written = [r for r in rows(max(steps)) if r["step"] in steps]
    for row in written:
        record.log(row)
    record.close()
    trackers.close_trackers(opened, status)
    return written, {t.key: t.run_id for t in opened}


def require(module):
    """The extras are part of `.[test]`: without them these tests skip, except under CI (tests/ci_env.py), where
    they fail."""
    from ci_env import in_ci

    if in_ci():
        __import__(module)
    else:
        pytest.importorskip(module, reason=f"pip install -e .[{module}]")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    require("wandb")
    for key, value in {"WANDB_DIR": tmp_path, "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_CONFIG_DIR":
                       tmp_path / "config", "WANDB_DATA_DIR": tmp_path / "data", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def wandb_records(path):
    """The protobuf records of a W&B run file (`run-<id>.wandb`): W&B's LevelDB-style log of 32 KiB blocks, each
    record a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and part of a `Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path} does not start with W&B's header: {data[:7]!r}"
    pos, block, part = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            yield record


def finished_wandb_records(path, timeout_s=30.0):
    """A W&B run file's records once it holds its exit record. W&B's service writes the file through a buffer it
    flushes when the run's stream closes, which is just after `finish()` returns: read at once, the file may hold
    only its header (seen in CI: no `run` record) or miss its last records (seen under load: one exit code of two).
    A training process ends after `finish()`, and W&B's exit hook waits for the service, so a run's files are whole
    by then; the tests read them in the same process."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, (
            f"{path} has no exit record {timeout_s:.0f} s after finish(): "
            f"{[r.WhichOneof('record_type') for r in records]}")
        time.sleep(0.2)


def test_logger_section_composes_from_the_command_line():
    run = from_hydra(compose(["logger.wandb.mode=offline", "logger.wandb.project=x", "logger.wandb.name=r1",
                              "logger.mlflow.tracking_uri=file:///tmp/mlruns", "logger.mlflow.experiment=e"]))
    assert run.logger == LoggerConfig(wandb=WandbConfig(mode="offline", project="x", name="r1"),
                                      mlflow=MlflowConfig(tracking_uri="file:///tmp/mlruns", experiment="e"))
    default = from_hydra(compose([])).logger
    assert default.wandb.mode == "disabled" and default.mlflow.tracking_uri == ""  # TensorBoard only by default


@pytest.mark.parametrize("override, needle", [
    ("logger.wandb.mode=sometimes", "logger.wandb.mode='sometimes', expected 'disabled', 'online' or 'offline'"),
    ("+logger.mlflow.uri=file:///x", "unknown key(s) ['uri'] in logger.mlflow"),
])
def test_bad_logger_values_fail_with_the_key(override, needle):
    with pytest.raises(ValueError) as e:
        from_hydra(compose([override]))
    assert needle in str(e.value)


def test_a_missing_extra_fails_at_start_with_the_install_line(monkeypatch):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    with pytest.raises(ImportError) as e:
        trackers.check_installed(LoggerConfig(mlflow=MlflowConfig(tracking_uri="file:///tmp/mlruns")))
    assert "pip install -e .[mlflow]" in str(e.value) and "logger.mlflow.tracking_uri" in str(e.value)
    trackers.check_installed(LoggerConfig())  # nothing asked for: nothing needed


def test_wandb_offline_run_holds_every_row_and_the_config(tmp_path, wandb_offline):
    run = run_config(wandb=WandbConfig(mode="offline", project="moe-test", name="offline-check"))
    written, _ = write_record(tmp_path, run)
    files = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, f"expected one offline W&B run under {tmp_path / 'run' / 'wandb'}, found {files}"
    history, config, meta = {}, {}, None
    for record in finished_wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            # a key comes as `key` or as `nested_key` (a path of one element for our flat keys), by the SDK's choice
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = items
        elif kind == "run":
            meta = record.run
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    assert meta is not None and meta.project == "moe-test" and meta.display_name == "offline-check"
    assert config["algo"]["group_size"] == run.algo.group_size and config["steps"] == run.steps
    assert sorted(history) == [1, 2, 3]
    for row in written:
        logged = history[row["step"]]
        expected = {k: v for k, v in row.items() if k != "step" and math.isfinite(v)}
        assert {k: logged[k] for k in expected} == pytest.approx(expected)
        assert "kl/reference" not in logged  # NaN: not measured, not sent
    assert "mismatch/kl" not in history[1] and history[2]["mismatch/kl"] == pytest.approx(2e-3)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 3  # the run's own record is unchanged


def test_mlflow_file_store_records_metrics_and_params(tmp_path):
    require("mlflow")
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    run = run_config(mlflow=MlflowConfig(tracking_uri=uri, experiment="moe-test", run_name="file-store"))
    written, _ = write_record(tmp_path, run)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("moe-test")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "file-store" and found.info.status == "FINISHED"
    run_id = found.info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == \
        [(r["step"], r["reward/mean"]) for r in written]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "mismatch/kl")] == [(2, 2e-3), (3, 3e-3)]
    assert client.get_metric_history(run_id, "kl/reference") == []  # NaN on every row
    assert len(found.data.metrics) == len([k for k in written[-1] if k != "step" and math.isfinite(written[-1][k])])
    params = found.data.params
    assert params["algo.group_size"] == str(run.algo.group_size) and params["logger.mlflow.run_name"] == "file-store"
    assert params["model.num_experts"] == str(run.model.num_experts)
    assert found.data.tags["moe_grpo.run_dir"] == str((tmp_path / "run").resolve())


def test_a_failing_tracker_is_reported_once_and_the_run_goes_on(tmp_path, caplog):
    calls = []

    def flaky(metrics, step):
        calls.append(step)
        if step >= 2:
            raise ConnectionError("tracking server unreachable")

    flaky_tracker = trackers.Guarded("Flaky", flaky, lambda status: None)
    record = RunRecord(tmp_path, total_steps=4, progress=False, trackers=[flaky_tracker])
    with caplog.at_level(logging.WARNING, logger="moe_grpo"):
        for row in rows(4):
            record.log(row)
        record.close()
        trackers.close_trackers([flaky_tracker], "FINISHED")
    assert calls == [1, 2, 3, 4]  # it was tried on every row
    warnings = [r.getMessage() for r in caplog.records if "Flaky tracker failed" in r.getMessage()]
    assert len(warnings) == 1 and "ConnectionError: tracking server unreachable" in warnings[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4


def test_a_stuck_tracker_does_not_hold_up_training_or_the_end_of_the_run(tmp_path, caplog):
    def stuck(metrics, step):
        time.sleep(30)

    tracker = trackers.Guarded("Stuck", stuck, lambda status: None, close_timeout_s=0.5)
    record = RunRecord(tmp_path, total_steps=3, progress=False, trackers=[tracker])
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="moe_grpo"):
        for row in rows(3):
            record.log(row)
        record.close()
        trackers.close_trackers([tracker], "FINISHED")
    assert time.perf_counter() - t0 < 10
    assert any("Stuck tracker: rows still unsent" in r.getMessage() for r in caplog.records)


def mlflow_run(tmp_path, **kw):
    require("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    return uri, run_config(mlflow=MlflowConfig(tracking_uri=uri, experiment="moe-test", **kw))


@pytest.mark.parametrize("status", ["FAILED", "KILLED"])
def test_mlflow_marks_a_failed_or_stopped_run_as_it_ended(tmp_path, status):
    """Every run was marked FINISHED, a failed or SIGTERMed one too."""
    from mlflow.tracking import MlflowClient

    uri, run = mlflow_run(tmp_path)
    _, ids = write_record(tmp_path, run, status=status)
    assert MlflowClient(tracking_uri=uri).get_run(ids["mlflow"]).info.status == status


def test_a_resumed_run_goes_on_in_the_same_mlflow_run(tmp_path):
    """Each resume opened a new tracker run, so a preempted run's curve was split over several. Stopped after step 2
    (KILLED), resumed from its checkpoint of step 1 with the saved id: one run, RUNNING again then FINISHED, holding
    every step (the redone step 2 twice: MLflow keeps both values), its first parameters kept."""
    from mlflow.tracking import MlflowClient

    uri, run = mlflow_run(tmp_path, run_name="preempted")
    _, ids = write_record(tmp_path, run, status="KILLED", steps=(1, 2))
    resumed = dataclasses.replace(run, resume=True, steps=run.steps + 1)
    _, again = write_record(tmp_path, resumed, resume=ids, steps=(2, 3))
    assert again == ids
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("moe-test").experiment_id])
    assert found.info.run_id == ids["mlflow"] and found.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(found.info.run_id, "reward/mean")] == [1, 2, 2, 3]
    assert found.data.params["resume"] == "False" and found.data.params["steps"] == str(run.steps)


def test_a_resumed_run_goes_on_in_the_same_wandb_run(tmp_path, wandb_offline):
    """The same for W&B (offline: each process writes its part under the same run id, `wandb sync` joins them), each
    part ended with how it ended (143: stopped by SIGTERM)."""
    run = run_config(wandb=WandbConfig(mode="offline", project="moe-test"))
    _, ids = write_record(tmp_path, run, status="KILLED", steps=(1, 2))
    # W&B names an offline part by the second it started in (the parts are ordered by name below); a part started in
    # the same second gets a suffixed name that may sort first. A real resume starts minutes later.
    time.sleep(1.1)
    _, again = write_record(tmp_path, dataclasses.replace(run, resume=True), resume=ids, steps=(2, 3))
    assert again == ids
    parts = sorted(glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(parts) == 2 and all(p.endswith(f"run-{ids['wandb']}.wandb") for p in parts), parts
    exits = [r.exit.exit_code for part in parts for r in finished_wandb_records(part)
             if r.WhichOneof("record_type") == "exit"]
    assert exits == [143, 0]


def test_trackers_start_before_the_pools_and_end_as_the_run_ended(tmp_path, monkeypatch):
    """The tracker runs were created with the run record, after the pools and the first evaluation were up: an
    MLflow store that cannot be written failed the run minutes in. Now it fails before Ray starts; and a run that
    fails (here: Ray cannot start) or is stopped (SIGTERM during start-up) ends its tracker run FAILED / KILLED."""
    from mlflow.tracking import MlflowClient

    from moe_grpo.orchestrator import pools
    from moe_grpo.orchestrator.training_run import SignalledTogether, train

    started = []

    def start_ray(cluster, run_dir):
        started.append(run_dir)
        raise started_error.pop(0)

    monkeypatch.setattr(pools, "start_ray", start_ray)
    base = dict(steps=2, warm_start_steps=0, eval_every=0, **{"sync.root": str(tmp_path / "sync")})
    bad = from_hydra(compose([f"{k}={v}" for k, v in base.items()] + ["model=deepseek_moe",
                             "logger.mlflow.tracking_uri=file:///proc/no-such-store/mlruns"]))
    started_error = [AssertionError("the pools started")]
    with pytest.raises(Exception) as e:
        train(bad, tmp_path / "bad")
    assert started == [] and "the pools started" not in str(e.value), e.value

    require("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    good = [f"{k}={v}" for k, v in base.items()] + ["model=deepseek_moe", f"logger.mlflow.tracking_uri={uri}"]
    client = MlflowClient(tracking_uri=uri)
    for error, status in ((RuntimeError("no cluster"), "FAILED"), (KeyboardInterrupt("SIGTERM during start-up"), "KILLED")):
        started_error = [error]
        # a stop during the start-up leaves `train` in one line (a Ctrl-C's, exit 130), not as KeyboardInterrupt
        with pytest.raises(SignalledTogether if isinstance(error, KeyboardInterrupt) else type(error)):
            train(from_hydra(compose(good)), tmp_path / status)
        (found,) = client.search_runs([client.get_experiment_by_name("moe_grpo").experiment_id],
                                      filter_string=f"tags.`moe_grpo.run_dir` = '{tmp_path / status}'")
        assert found.info.status == status


def test_train_resumed_from_a_checkpoint_goes_on_in_its_tracker_run(tmp_path, monkeypatch):
    """`train` with resume=true opens the tracker run whose id the checkpoint's run state holds (not a new one), and
    ends it as this process ended (here: Ray cannot start, FAILED)."""
    require("mlflow")
    from mlflow.tracking import MlflowClient

    from moe_grpo.orchestrator import pools, run_checkpoint
    from moe_grpo.orchestrator.training_run import train
    from moe_grpo.orchestrator.state import RunState

    def start_ray(cluster, run_dir):
        raise RuntimeError("no cluster")

    monkeypatch.setattr(pools, "start_ray", start_ray)
    uri = (tmp_path / "mlruns").as_uri()
    overrides = ["model=deepseek_moe", "steps=2", "warm_start_steps=0", "eval_every=0",
                 f"sync.root={tmp_path / 'sync'}", f"logger.mlflow.tracking_uri={uri}"]
    first = from_hydra(compose(overrides))
    run_dir = tmp_path / "run"
    (opened,) = trackers.open_trackers(first.logger, run_dir, dataclasses.asdict(first))
    trackers.close_trackers([opened], "KILLED")  # the interrupted process, stopped after its checkpoint of step 1
    saved = {"run_state": RunState(step=1, tracker_runs={"mlflow": opened.run_id}).state_dict(),
             "config": dataclasses.asdict(first), "lr_schedule": first.learner.schedule(first.steps)}
    run_checkpoint.finish(run_checkpoint.begin(run_dir, 1), saved, {"step": 1}, keep=2)

    with pytest.raises(RuntimeError, match="no cluster"):
        train(from_hydra(compose(overrides + ["resume=true"])), run_dir)
    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs([client.get_experiment_by_name("moe_grpo").experiment_id])
    assert found.info.run_id == opened.run_id and found.info.status == "FAILED"
