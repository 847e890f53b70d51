"""Runs on one host do not share Ray clusters, temp dirs or run directories."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_grpo.orchestrator.config import ClusterConfig

HERE = Path(__file__).parent


def test_ray_address_auto_is_refused_with_what_to_pass():
    with pytest.raises(ValueError, match=r"cluster.ray_address='auto'.*another job's.*<head ip>:6379"):
        ClusterConfig(ray_address="auto")


@pytest.mark.slow
def test_a_stray_ray_current_cluster_file_changes_nothing_and_the_run_keeps_its_own_ray(tmp_path):
    shared = tmp_path / "shared"  # stands for the world-writable /tmp/ray of the host
    (shared / "ray").mkdir(parents=True)
    (shared / "ray" / "ray_current_cluster").write_text("10.255.255.1:6379\n")  # another job's, long gone
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "RAY_TMPDIR": str(shared), "RAY_ADDRESS": "10.255.255.1:6379",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(HERE / "ray_isolation.py"), str(run_dir)], env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    info = json.loads(lines[0][len("RESULT "):])
    assert info["nodes"] == 1 and info["mode"] == "0o700"
    # A one-host run's Ray is on loopback (ray_loopback.py): before, the GCS, raylet and workers' gRPC ports listened
    # on all interfaces, the runtime-env agent on the host's address, the autoscaler's metrics on 0.0.0.0:44217.
    assert info["node_addresses"] == ["127.0.0.1"]
    assert info["outside"] == [], f"reachable from other hosts: {info['outside']} (all: {info['listening']})"
    assert any("gcs_server" in line for line in info["listening"]), "the sample saw Ray's servers"
    assert info["session"].startswith(os.path.join(info["private"], "ray"))  # not the shared /tmp/ray
    assert info["worker_rpc"] == os.path.join(info["private"], "vllm")  # vLLM's sockets go there too
    # ... through the environment Ray's processes start with, not a runtime environment on the run's job: with one
    # (as before), the run's actors could not take the workers Ray starts with the cluster and each waited for a
    # worker process made for it (setup_worker, a Python start and Ray's import; a small run's actors began their
    # imports 10.6 s after the driver started with it, 6.4 s without, on 2 cores).
    assert info["job_runtime_env"] == {}, info["job_runtime_env"]
    assert not info["private_after"]  # removed when the run ends
    assert (run_dir / "ray_logs").is_dir() and not (run_dir / "ray_logs").is_symlink()  # the logs are kept
    assert sorted(p.name for p in (shared / "ray").iterdir()) == ["ray_current_cluster"]  # nothing written there


def _train(*args, cwd):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "moe_grpo.train", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_runs_started_at_once_get_separate_run_directories(tmp_path):
    procs = [_train("--cfg", "hydra", "--resolve", cwd=tmp_path) for _ in range(2)]  # the same second
    dirs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        dirs += [line.split("dir:", 1)[1].strip() for line in out.splitlines()
                 if line.strip().startswith("dir: outputs/")][:1]
    assert len(dirs) == 2 and dirs[0] != dirs[1], dirs
    assert all(d.startswith("outputs/") for d in dirs)


def test_a_run_pointed_at_another_runs_directory_is_refused_before_it_writes_anything(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted(os.listdir(taken)), sorted(os.listdir(tmp_path))
    p = _train("steps=1", f"hydra.run.dir={taken}", cwd=tmp_path)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 2, err[-2000:]
    assert f"hydra.run.dir={taken} already holds a run's record (metrics.jsonl)" in err and "resume=true" in err
    assert "Traceback" not in err
    assert (sorted(os.listdir(taken)), sorted(os.listdir(tmp_path))) == before  # no .hydra/, no config.yaml
    assert (taken / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_only_a_directory_with_a_record_is_refused_and_resume_takes_it(tmp_path):
    from moe_grpo.orchestrator.run_dirs import RunDirTaken, check_run_dir

    check_run_dir(str(tmp_path / "new"), resume=False)  # not there yet
    (tmp_path / "checkpoints").mkdir()
    check_run_dir(str(tmp_path), resume=False)  # empty: nothing to trample (a test's tmp_path, say)
    (tmp_path / "checkpoints" / "step_000002").mkdir()
    with pytest.raises(RunDirTaken, match=r"\(checkpoints\); continue that run with resume=true"):
        check_run_dir(str(tmp_path), resume=False)
    check_run_dir(str(tmp_path), resume=True)
