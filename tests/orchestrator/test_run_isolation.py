"""Runs on one host do not share Ray clusters, temp dirs or run directories."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_grpo.orchestrator.config import ClusterConfig
from moe_grpo.orchestrator.pools import start_ray

HERE = Path(__file__).parent


def test_ray_address_auto_is_refused_with_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match=r"cluster.ray_address='auto'.*another job's.*<head ip>:6379"):
        start_ray(ClusterConfig(ray_address="auto"), str(tmp_path))


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
    assert info["session"].startswith(os.path.join(info["private"], "ray"))  # not the shared /tmp/ray
    assert info["worker_rpc"] == os.path.join(info["private"], "vllm")  # vLLM's sockets go there too
    assert not info["private_after"]  # removed when the run ends
    assert (run_dir / "ray_logs").is_dir() and not (run_dir / "ray_logs").is_symlink()  # the logs are kept
    assert sorted(p.name for p in (shared / "ray").iterdir()) == ["ray_current_cluster"]  # nothing written there
