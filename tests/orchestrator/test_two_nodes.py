"""A run on a real two-node Ray cluster on one machine: each node a `ray start` process with its own resources and
its own shared-memory root (standing for its own host), SLURM's variables set as `srun` sets them. The engine is on
one node, the 2-rank learner split across both, the weights cross between them through the relay."""

import json
import os
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools"))  # ray_nodes


@pytest.fixture
def two_nodes(tmp_path):
    """A head node (3 CPUs: the engine's 2 and one learner rank's) and a second node (1 CPU: the other rank), each
    with its own MOE_GRPO_SYNC_ROOT and the SLURM variables of its `srun` task."""
    from ray_nodes import local_ray_nodes, slurm_env

    roots = {"head": str(tmp_path / "shm_head"), "worker": str(tmp_path / "shm_worker")}
    path = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    nodes = [{"num_cpus": 3, "env": {**path, **slurm_env(0, 2), "MOE_GRPO_SYNC_ROOT": roots["head"]}},
             {"num_cpus": 1, "env": {**path, **slurm_env(1, 2), "MOE_GRPO_SYNC_ROOT": roots["worker"]}}]
    with local_ray_nodes(nodes, str(tmp_path)) as address:
        yield address, roots


def test_a_learner_split_across_two_nodes_trains_and_every_host_gets_each_version_once(two_nodes, tmp_path,
                                                                                     monkeypatch):
    from test_loop import rows_of, small_run

    from moe_grpo.orchestrator.training_run import train
    from moe_grpo.orchestrator.learner_actor import LearnerWorker

    from ray_nodes import slurm_env

    address, roots = two_nodes
    for k, v in slurm_env(0, 2).items():  # the driver runs in the batch script, on the first node
        monkeypatch.setenv(k, v)
    gaps = tmp_path / "gaps.jsonl"

    class Checking(LearnerWorker):
        """Before each step, the learner's log-probs of the batch (the weights the engine sampled it with, in
        mode=sync) against the engine's; and where this rank runs."""

        def train(self, seqs, policy_version, replay):
            lps = self.learner.logprobs(list(seqs), replay=True)
            gap = max(float(np.abs(lp[s.prompt_len - 1:] - s.old_logprobs).max()) for s, lp in zip(seqs, lps))
            import ray

            with open(gaps, "a") as f:
                f.write(json.dumps({"rank": self.rank, "version": policy_version, "gap": gap,
                                    "node": ray.get_runtime_context().get_node_id(),
                                    "local_rank": os.environ["LOCAL_RANK"]}) + "\n")
            return super().train(seqs, policy_version, replay)

    run = small_run(mode="sync", steps=3, warm_start_steps=0, eval_every=0, **{
        "cluster.ray_address": address, "cluster.engine_cpus": 2.0, "parallel.expert_parallel": 2,
        "routing.probe_prompts": 0, "sync.relay_timeout_s": 120.0})
    summary = train(run, tmp_path / "run", learner_cls=Checking)

    sync = summary["sync"]
    assert sync["transport"] == "relay", "auto picks the relay on two Ray nodes"
    assert sorted(sync["rank_hosts"]) in ([-1, 0], [0, 1]), sync  # the learner spans both nodes
    assert not sync["errors"], sync
    # Every version (0 = the initial weights, 1..3 the steps) arrived once, whole, on every host it was relayed to.
    received = [versions for host in sync["received"].values() for versions in host.values()]
    assert received and all(v == [0, 1, 2, 3] for v in received), sync
    rows = [json.loads(line) for line in gaps.read_text().splitlines()]
    print("two nodes:", json.dumps({"sync": sync, "max_gap": max(r["gap"] for r in rows),
                                    "seconds": round(summary["seconds"], 1)}))
    assert sorted({(r["rank"], r["version"]) for r in rows}) == [(r, v) for r in (0, 1) for v in (0, 1, 2)]
    assert max(r["gap"] for r in rows) < 1e-4, rows
    assert len({r["node"] for r in rows}) == 2 and {r["local_rank"] for r in rows} == {"0"}, "one rank per node"
    metrics = rows_of(tmp_path / "run")
    assert [r["step"] for r in metrics] == [1, 2, 3] and all(r["staleness/max"] == 0 for r in metrics)
    for root in roots.values():  # each host's buffers of the run are gone
        assert not os.path.isdir(root) or not [p for p in os.listdir(root) if p.startswith("run-")]
