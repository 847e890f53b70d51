"""`python -m moe_grpo.train` on two Ray nodes on one machine, each standing for a host (its own CPUs, its own
MOE_GRPO_SYNC_ROOT, the variables `srun` sets on it; tools/ray_nodes.py): what a two-host SLURM job runs, without
the second host. Ray places the pools: give the head too few CPUs for all of them (the default: an engine and one
learner rank of 1 CPU each fit on it, the second rank goes to the other node) or the second node stays idle. Prints the run's closing line, then one JSON line read from its record (metrics.jsonl):

    .venv/bin/python tools/two_node_run.py --head-cpus 2 --worker-cpus 1 -- model=deepseek_moe \\
        cluster.engine_tensor_parallel=2 cluster.learner_ranks=2 parallel.expert_parallel=2 steps=100

The run directory is `--out` (a new directory under /tmp by default); the Ray nodes' logs go next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

from ray_nodes import local_ray_nodes, slurm_env


def record_figures(run_dir: str) -> dict[str, object]:
    """What the run recorded: steps, held-out reward first and last, the probe's KL over every probed version."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = sorted({(r["eval/step"], r["eval/reward/mean"]) for r in rows if r.get("eval/reward/mean") is not None})
    probed = {int(r["mismatch/probe_version"]): r["mismatch/kl"] for r in rows
              if r.get("mismatch/probe_version") is not None and not math.isnan(r["mismatch/probe_version"])}
    last = rows[-1] if rows else {}
    log_path = os.path.join(run_dir, "train.log")
    sync_lines = [line.strip() for line in open(log_path) if line.startswith("weight sync:")] \
        if os.path.isfile(log_path) else []
    return {"steps": len(rows), "eval_first": evals[0] if evals else None, "eval_last": evals[-1] if evals else None,
            "probe_versions": len(probed), "probe_kl_max": max(probed.values(), default=None),
            "sync_bytes_last": last.get("sync/bytes"), "engine_restarts": last.get("faults/engine_restarts"),
            "sync_failures": last.get("faults/sync_failures"),
            "weight_sync": sync_lines[0] if sync_lines else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-cpus", type=int, default=2, help="CPUs the head node offers Ray (engines go here)")
    parser.add_argument("--worker-cpus", type=int, default=1, help="CPUs the second node offers Ray")
    parser.add_argument("--out", default=None, help="run directory (default: a new one under /tmp)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of `python -m moe_grpo.train`")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="two_node_run-")
    run_dir = os.path.join(out, "run")
    roots = [os.path.join(out, f"shm_node{i}") for i in range(2)]
    nodes = [{"num_cpus": args.head_cpus, "env": {**slurm_env(0, 2), "MOE_GRPO_SYNC_ROOT": roots[0]}},
             {"num_cpus": args.worker_cpus, "env": {**slurm_env(1, 2), "MOE_GRPO_SYNC_ROOT": roots[1]}}]
    with local_ray_nodes(nodes, out) as address:
        # The driver runs where the batch script does: on the first node.
        env = {**os.environ, **slurm_env(0, 2), "MOE_GRPO_SYNC_ROOT": roots[0]}
        cmd = [sys.executable, "-m", "moe_grpo.train", *args.overrides, f"cluster.ray_address={address}",
               f"hydra.run.dir={run_dir}"]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        code = subprocess.run(cmd, env=env).returncode
    figures = {"exit_code": code, "run_dir": run_dir}
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        figures.update(record_figures(run_dir))
    print(json.dumps(figures))
    return code


if __name__ == "__main__":
    sys.exit(main())
