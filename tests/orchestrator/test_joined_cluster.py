"""A run on a Ray cluster it did not start (the test session's, tests/ray_session.py) ends exactly what it created."""

import glob
import os
import sys
import time

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def test_a_run_on_a_joined_cluster_releases_its_actors_and_leaves_the_callers_ray_connected(session_ray_address,
                                                                                          tmp_path):
    """The caller is connected to the cluster before `train` (as a notebook or a sweep driver is) and the run joins it
    (`cluster.ray_address`). Would have caught: the run's end calling `ray.shutdown()` on a connection it did not
    make (the caller's, here; the cluster itself when the caller started it), and its engine and learner actors and
    their placement group left on the cluster it joined (its CPUs held: the next run there cannot reserve them; the
    engine's and learner's processes alive), which only the end of the caller's job would have ended."""
    import ray
    import ray_session

    from test_loop import small_run

    from moe_grpo.orchestrator.training_run import train
    from moe_grpo.orchestrator.pools import join_ray
    from moe_grpo.orchestrator.process_record import left_behind

    join_ray(session_ray_address)
    try:
        total = ray.cluster_resources()["CPU"]
        run = small_run(steps=1, warm_start_steps=0, eval_every=0, **{"cluster.ray_address": session_ray_address,
                                                                     "routing.probe_prompts": 0})
        summary = train(run, tmp_path / "run")
        assert summary["steps"] == 1
        assert ray.is_initialized(), "train ended the caller's connection to Ray"
        groups = ray.util.placement_group_table()
        assert groups and {g["state"] for g in groups.values()} == {"REMOVED"}, groups
        deadline = time.monotonic() + 30  # Ray hands a removed group's CPUs back a moment later (seen under load)
        while ray.available_resources().get("CPU") != total and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("CPU") == total, (ray.available_resources(), total)
        record = __import__("json").loads((tmp_path / "run" / "processes.json").read_text())
        assert record["learners"] and record["engines"], record
        deadline = time.monotonic() + 30  # Ray reaps a killed actor's process a little after it is marked dead
        while (left := left_behind(record)) != {"processes": [], "shm": []} and time.monotonic() < deadline:
            time.sleep(1)
        assert left == {"processes": [], "shm": []}, left
        # Ended quietly: no learner or engine worker aborted on a failed Ray check as it was killed (a call sent to
        # an actor being killed did that, printing a C++ stack trace at the end of every run on a joined cluster).
        logs = os.path.join(os.path.dirname(ray_session.current().log_path), "ray_logs")
        pids = [*record["learners"], *record["engines"].values()]
        crashed = [path for pid in pids for path in glob.glob(os.path.join(logs, f"*-{pid}.err"))
                   if "Check failed" in open(path, errors="replace").read()]
        assert not crashed, crashed
        # The cluster serves the caller still, and a job that joined it by address gets the cluster's private
        # directory for vLLM's sockets (not the shared temp dir): what the run's engines got.
        rpc = ray.get(ray.remote(lambda: os.environ.get("VLLM_RPC_BASE_PATH")).remote(), timeout=60)
        assert rpc == os.path.join(ray_session.current().private_dir, "vllm"), rpc
    finally:
        ray.shutdown()
