"""`python -m moe_grpo.train` on two Ray nodes on one machine, each standing for a host (its own CPUs, its own
MOE_GRPO_SYNC_ROOT, the variables `srun` sets on it; tools/ray_nodes.py): what a two-host SLURM job runs, without
the second host. Ray places the pools: give the head too few CPUs for all of them (the default: an engine and one
learner rank of 1 CPU each fit on it, the second rank goes to the other node) or the second node stays idle. Prints the run's closing line, then one JSON line read from its record (metrics.jsonl):

    .venv/bin/python tools/two_node_run.py --head-cpus 2 --worker-cpus 1 -- model=deepseek_moe \\
        cluster.engine_tensor_parallel=2 cluster.learner_ranks=2 parallel.expert_parallel=2 steps=100

The run directory is `--out` (a new directory under /tmp by default); the Ray nodes' logs go next to it.

`--kill-worker-at STEP` SIGKILLs one vLLM worker of engine0 once the run has logged STEP: with an engine of
`cluster.engine_tensor_parallel=2`, the worker of tensor-parallel rank 1 (not the one `processes.json` names), so the
engine loses one worker of two, as when a device of a multi-device engine fails. The JSON line then carries the
killed pid and the step it died at; the run's record says what the run made of it (`faults/engine_restarts`,
`faults/requests_resubmitted`, `faults/requests_lost`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

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
            "requests_resubmitted": last.get("faults/requests_resubmitted"),
            "requests_lost": last.get("faults/requests_lost"),
            "weight_sync": sync_lines[0] if sync_lines else None}


def last_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = f.read().splitlines()
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0  # not written yet, or a line half written


def second_worker(run_dir: str) -> int:
    """engine0's worker other than the one processes.json names: its sibling under the engine core, started from
    the same command line (vLLM forks its workers from the engine core: rollout/worker_start.py)."""
    import psutil

    with open(os.path.join(run_dir, "processes.json")) as f:
        named = psutil.Process(int(json.load(f)["engines"]["engine0"]))
    siblings = [p for p in named.parent().children() if p.pid != named.pid and p.cmdline() == named.cmdline()]
    if len(siblings) != 1:
        raise RuntimeError(f"expected one more worker beside vLLM process {named.pid} under its engine core "
                           f"{named.parent().pid}, found {[p.pid for p in siblings]} (is cluster.engine_tensor_parallel=2?)")
    return siblings[0].pid


def kill_worker_at(step: int, run_dir: str, done: threading.Event, killed: dict[str, object]) -> None:
    """Waits until the run has logged `step`, then SIGKILLs engine0's second worker (see the module's docstring)."""
    while not done.is_set() and last_step(run_dir) < step:
        time.sleep(0.2)
    if done.is_set():
        return
    pid = second_worker(run_dir)
    os.kill(pid, 9)
    killed.update(killed_worker=pid, killed_after_step=last_step(run_dir))
    print(f"two_node_run: SIGKILLed vLLM worker {pid} of engine0 after step {killed['killed_after_step']}",
          file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-cpus", type=int, default=2, help="CPUs the head node offers Ray (engines go here)")
    parser.add_argument("--worker-cpus", type=int, default=1, help="CPUs the second node offers Ray")
    parser.add_argument("--out", default=None, help="run directory (default: a new one under /tmp)")
    parser.add_argument("--kill-worker-at", type=int, default=None, metavar="STEP",
                        help="SIGKILL engine0's second vLLM worker once the run has logged this step")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of `python -m moe_grpo.train`")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="two_node_run-")
    os.makedirs(out, exist_ok=True)
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
        done, killed = threading.Event(), {}
        killer = threading.Thread(target=kill_worker_at, args=(args.kill_worker_at, run_dir, done, killed),
                                  daemon=True) if args.kill_worker_at is not None else None
        if killer is not None:
            killer.start()
        code = subprocess.run(cmd, env=env).returncode
        done.set()
    figures = {"exit_code": code, "run_dir": run_dir, **killed}
    if os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        figures.update(record_figures(run_dir))
    print(json.dumps(figures))
    return code


if __name__ == "__main__":
    sys.exit(main())
