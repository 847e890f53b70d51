"""Several Ray nodes on one machine, each standing for a host of its own (for tests and benchmarks of multi-host
paths): every node is a `ray start --block` in a process group of its own, with its own CPUs and its own
environment - its own MOE_GRPO_SYNC_ROOT (its "shared memory") and, if given, the variables `srun` sets on it.
Leaving the context ends exactly those process groups (never `ray stop`, which would stop every Ray on the host).

    with local_ray_nodes([{"num_cpus": 3, "env": {...}}, {"num_cpus": 1, "env": {...}}], log_dir) as address:
        ...  # cluster.ray_address=address
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator


def slurm_env(node: int, nodes: int, cpus: int = 2) -> dict[str, str]:
    """What `srun --nodes=<nodes> --ntasks-per-node=1` puts in the environment of its task on node `node`."""
    names = f"node[0-{nodes - 1}]"
    return {"SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NAME": "moe_grpo", "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": names, "SLURM_NODELIST": names,
            "SLURM_NTASKS": str(nodes), "SLURM_NPROCS": str(nodes), "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_TASKS_PER_NODE": f"1(x{nodes})", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_STEP_NODELIST": names, "SLURM_NODEID": str(node),
            "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_GTIDS": str(node),
            "SLURMD_NODENAME": f"node{node}", "SLURM_CPUS_ON_NODE": str(cpus), "SLURM_SUBMIT_DIR": os.getcwd()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):  # SIGTERM, then SIGKILL after 5 s (a node drains for 30 s otherwise)
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(5)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@contextlib.contextmanager
def local_ray_nodes(nodes: list[dict], log_dir: str, timeout_s: float = 120.0) -> Iterator[str]:
    """Start a head (nodes[0]) and the other nodes ({"num_cpus": n, "env": {...}} each); yields the address."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    port = _free_port()
    address = f"127.0.0.1:{port}"
    # Ray 2.60 turns token authentication on for a new cluster (the user's ~/.ray/auth_token): `ray status`, the
    # nodes joining and this process's ray.init(address=...) must send it. An explicit address never turns it on
    # by itself, and Ray caches its config at import, so this process turns it on the way a new local
    # ray.init() does (RAY_AUTH_MODE=token, config refreshed; Ray 2.60's own helper).
    if os.environ.get("RAY_AUTH_MODE") != "token":
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    base = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1"}
    procs: list[subprocess.Popen] = []

    def start(i: int, args: list[str]) -> None:
        node = nodes[i]
        with open(os.path.join(log_dir, f"ray_node{i}.log"), "w") as log:
            procs.append(subprocess.Popen(
                [ray, "start", "--block", "--disable-usage-stats",
                 f"--num-cpus={node['num_cpus']}", *args], env={**base, **node.get("env", {})},
                start_new_session=True, stdout=log, stderr=subprocess.STDOUT))

    try:
        start(0, ["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false"])
        deadline = time.monotonic() + timeout_s
        while subprocess.run([ray, "status", f"--address={address}"], capture_output=True, env=base).returncode:
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"the Ray head did not start within {timeout_s:.0f} s (log: {log_dir}/ray_node0.log)")
            time.sleep(2)
        for i in range(1, len(nodes)):
            start(i, [f"--address={address}"])
        import ray as rayapi

        rayapi.init(address=address, logging_level="ERROR")
        try:
            while len([n for n in rayapi.nodes() if n["Alive"]]) < len(nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {len([n for n in rayapi.nodes() if n['Alive']])} of {len(nodes)} Ray "
                                       f"nodes up within {timeout_s:.0f} s (logs: {log_dir}/ray_node*.log)")
                time.sleep(1)
        finally:
            rayapi.shutdown()
        yield address
    finally:
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)
