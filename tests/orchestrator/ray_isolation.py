"""Run as a script by test_run_isolation.py: starts the run's Ray as the driver does, in a clean process."""

import json
import os
import sys


def main(run_dir: str) -> None:
    import ray

    from moe_grpo.orchestrator.config import ClusterConfig
    from moe_grpo.orchestrator.pools import start_ray, stop_pools
    from moe_grpo.orchestrator.run_dirs import release_private_dir

    from listeners import Listeners

    private = start_ray(ClusterConfig(), run_dir)
    seen = ray.get(ray.remote(lambda: os.environ.get("VLLM_RPC_BASE_PATH")).remote())
    listening = Listeners()
    listening.sample()  # Ray's GCS, raylet, agents, monitor, this driver's and a worker's servers are all up now
    info = {"private": private, "mode": oct(os.stat(private).st_mode & 0o777), "worker_rpc": seen,
            "session": ray._private.worker._global_node.get_session_dir_path(),  # noqa: SLF001
            "job_runtime_env": dict(ray.get_runtime_context().runtime_env),
            "nodes": len(ray.nodes()), "node_addresses": [n["NodeManagerAddress"] for n in ray.nodes()],
            "listening": sorted(f"{ip} ({name})" for ip, name in listening.ports),
            "outside": listening.reachable_from_outside()}
    stop_pools(None)
    release_private_dir(private, run_dir)
    info["private_after"] = os.path.exists(private)
    print("RESULT " + json.dumps(info))


if __name__ == "__main__":
    main(sys.argv[1])
