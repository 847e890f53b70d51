"""The placement plan, built from the command line's config and fake SLURM environments: what a user reads before
anything starts (nodes, engines, learner ranks with their Megatron coordinates, bytes per host, memory), and the
plans it refuses with their reasons."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_grpo.config import CONF_DIR, defaults_tree, from_hydra
from moe_grpo.orchestrator.memory_estimate import GIB
from moe_grpo.orchestrator.placement_plan import (Layout, PlanRefused, build_plan, coordinates, not_runnable_yet,
                                                  pin_bundles)

ROOT = Path(__file__).resolve().parents[2]


def run_config(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return from_hydra(compose(config_name="config", overrides=overrides))


def slurm_env(nodelist, nodes, gpus=8, cpus=128):
    return {"SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(nodes), "SLURM_GPUS_ON_NODE": str(gpus),
            "SLURM_CPUS_ON_NODE": str(cpus)}


# A GPU learner as one would run a real-size model: bf16 weights (fp32 main parameters in Adam), Megatron's
# distributed optimizer, full recompute, one sequence of 4096 positions per micro-batch.
GPU_TRAINING = ["cluster=slurm", "megatron.params_dtype=bfloat16", "megatron.distributed_optimizer=true",
                "megatron.recompute=true", "rollout.dtype=bfloat16", "rollout.max_model_len=4096",
                "learner.micro_batch_size=1"]
# The mismatch probe off: its two copies of the weights (16.4 GiB a rank) do not fit beside Adam here
# (test_the_mismatch_probe_and_cuda_ipc_slots_count_in_a_ranks_memory).
QWEN_2x8 = ["model=qwen3_moe_30b_a3b", *GPU_TRAINING, "cluster.num_engines=4", "cluster.engine_tensor_parallel=2",
            "parallel.tensor_parallel=2", "parallel.expert_parallel=4", "routing.probe_prompts=0"]
DSV3 = ["model=deepseek_v3", *GPU_TRAINING, "cluster.engine_tensor_parallel=8"]


def plan_for(overrides, environ, **kwargs):
    plan = build_plan(run_config(overrides), environ, run_command=None, **kwargs)
    print(plan.render())  # `pytest -s` shows what a user would read
    return plan


def test_qwen3_30b_on_two_nodes_of_eight_gpus_fits_and_says_where_everything_runs():
    plan = plan_for(QWEN_2x8, slurm_env("gpu[01-02]", 2))
    text = plan.render()
    assert plan.ok, text
    assert "placement plan (cluster=slurm): 2 nodes x 8 GPUs of 80 GiB, 128 CPUs each" in text
    # Learner ranks on the first node (next to the driver), in Megatron's order: TP fastest, then DP; EP within DP.
    assert ("training pool: 1 node (gpu01): 8 learner ranks, 1 GPU each, Megatron TP=2 PP=1 DP=4 EP=4 "
            "(expert DP 1)") in text
    assert ("  gpu01: r0[tp0 pp0 dp0 ep0] r1[tp1 pp0 dp0 ep0] r2[tp0 pp0 dp1 ep1] r3[tp1 pp0 dp1 ep1] "
            "r4[tp0 pp0 dp2 ep2] r5[tp1 pp0 dp2 ep2] r6[tp0 pp0 dp3 ep3] r7[tp1 pp0 dp3 ep3]") in text
    assert "inference pool: 1 node (gpu02): 4 engines x TP=2, 2 GPUs each" in text
    assert "  gpu02: engine0, engine1, engine2, engine3 (8 of 8 GPUs)" in text
    # Each engine host receives the whole model once per version, in the learner's dtype: 30,532,122,624 x 2 bytes.
    assert plan.sync_bytes == 30_532_122_624 * 2
    assert ("weight sync: 61.06 GB per version (30.53B parameters x 2 bytes, bfloat16) into each engine host: "
            "gpu02 61.06 GB; 61.06 GB per version over the network to 1 host without a learner rank") in text
    mem = plan.rank_memory
    assert 60 * GIB < mem.total < mem.capacity == 76 * GIB  # a tight fit on 80-GiB GPUs, said in numbers
    assert f"memory per rank: {mem.terms()} = {mem.total / GIB:.1f} GiB of 76.0 GiB usable" in text
    assert "memory per engine GPU: weights 28.4 GiB of 68.0 GiB usable (39.6 GiB left for the KV cache)" in text
    assert text.endswith("plan: OK")
    probed = plan_for([o for o in QWEN_2x8 if o != "routing.probe_prompts=0"], slurm_env("gpu[01-02]", 2))
    assert probed.problems[0].startswith("a learner rank needs 86.5 GiB")  # the probe's copies do not fit
    # What the run is started with: each bundle pinned to its node, the world and GPUs per actor filled in.
    assert plan.bundle_nodes() == ["gpu02"] * 4 + ["gpu01"] * 8
    cluster = plan.cluster_for_run(run_config(QWEN_2x8).cluster)
    assert (cluster.nodes, cluster.learner_ranks, cluster.engine_gpus, cluster.learner_gpus) == (
        ("gpu01", "gpu02"), 8, 2.0, 1.0)
    # ...which this build runs: engines with TP=2 are started with tensor_parallel_size=2 (issue 32; before, the
    # driver refused them at start), and engines on a host without learner ranks get the weights by the relay.
    assert [e.tensor_parallel for e in plan.engines] == [2] * 4
    assert not_runnable_yet(plan) == []


def test_the_same_model_without_recompute_or_tp_does_not_fit_and_the_plan_says_by_how_much():
    overrides = [o for o in QWEN_2x8 if o != "megatron.recompute=true"] + ["parallel.tensor_parallel=1",
                                                                          "parallel.expert_parallel=8"]
    plan = plan_for(overrides, slurm_env("gpu[01-02]", 2))
    (reason,) = plan.problems
    mem = plan.rank_memory
    assert mem.total > mem.capacity
    assert reason.startswith(f"a learner rank needs {mem.total / GIB:.1f} GiB (weights 9.6 GiB + grads 19.2 GiB + "
                             "Adam 42.7 GiB + activations")
    assert "but a GPU has 76.0 GiB usable (cluster.gpu_memory_gib=80 less 4 GiB)" in reason
    assert "megatron.recompute=true" in reason and "distributed_optimizer" not in reason  # only what is not set yet


def test_deepseek_v3_on_four_nodes_of_eight_h100s_is_refused_with_the_numbers():
    """671B parameters: the weights, fp32 gradients and Adam state alone are 11 TiB, ~150 80-GiB GPUs perfectly
    sharded, and one bf16 copy is 156 GiB per GPU of an 8-GPU engine. Neither pool fits 4 x 8 H100s; the plan still
    shows where everything would run."""
    plan = plan_for([*DSV3, "cluster.num_engines=2", "parallel.expert_parallel=16"], slurm_env("gpu[01-04]", 4))
    text = plan.render()
    assert "training pool: 2 nodes (gpu01 gpu02): 16 learner ranks, 1 GPU each, Megatron TP=1 PP=1 DP=16 EP=16" in text
    assert "  gpu02: r8[tp0 pp0 dp8 ep8] r9[tp0 pp0 dp9 ep9]" in text
    assert "inference pool: 2 nodes (gpu03 gpu04): 2 engines x TP=8, 8 GPUs each" in text
    assert "  gpu03: engine0 (8 of 8 GPUs)" in text and "  gpu04: engine1 (8 of 8 GPUs)" in text
    assert ("into each engine host: gpu03 1342.05 GB, gpu04 1342.05 GB; 2684.11 GB per version over the network "
            "to 2 hosts") in text
    assert "plan: REFUSED (2 reasons)" in text
    training, engine = plan.problems
    assert "a learner rank needs 1017.4 GiB" in training and "mismatch probe 216.0 GiB" in training
    assert "the model's weights, gradients and Adam state alone are 10.99 TiB, at least 149 such GPUs" in training
    assert "(the training pool has 16)" in training
    assert engine.startswith("an engine GPU needs 156.2 GiB for its share of the weights (671.03B parameters x 2 "
                             "bytes bfloat16 / TP 8) but vLLM may use 68.0 GiB of a 80-GiB GPU")
    # An engine of TP=8 already holds a whole 8-GPU node: the refusal names the pipeline stages that would fit
    # (156.2 GiB / 68.0 GiB usable: 3 stages, spanning nodes), not more tensor parallelism.
    assert engine.endswith("more pipeline stages (cluster.engine_pipeline_parallel >= 3 at TP=8: stages beyond a node "
                           "span nodes through vLLM's Ray executor, whole stages per node) or larger GPUs "
                           "(cluster.gpu_memory_gib)"), engine


def test_deepseek_v3_fits_nine_nodes_of_288_gb_gpus_and_not_of_141_gb_ones():
    """The variant that fits: 8 training nodes (TP=8 x EP=8) + 1 engine node, on GPUs of 288 GB (268 GiB). On H200s
    (141 GiB) both pools are short, by the numbers printed."""
    overrides = [*DSV3, "parallel.tensor_parallel=8", "parallel.expert_parallel=8"]
    big = plan_for([*overrides, "cluster.gpu_memory_gib=268"], slurm_env("b[01-09]", 9))
    text = big.render()
    assert big.ok, text
    assert "training pool: 8 nodes (b01 b02 b03 b04 b05 b06 b07 b08): 64 learner ranks" in text
    assert "TP=8 PP=1 DP=8 EP=8 (expert DP 1)" in text
    assert "  b08: r56[tp0 pp0 dp7 ep7] r57[tp1 pp0 dp7 ep7]" in text
    assert "inference pool: 1 node (b09): 1 engine x TP=8" in text and "  b09: engine0 (8 of 8 GPUs)" in text
    assert 150 * GIB < big.rank_memory.total < big.rank_memory.capacity
    h200 = plan_for([*overrides, "cluster.gpu_memory_gib=141"], slurm_env("b[01-09]", 9))
    assert len(h200.problems) == 2
    assert "a learner rank needs" in h200.problems[0] and "137.0 GiB usable" in h200.problems[0]
    assert "156.2 GiB" in h200.problems[1] and "122.9 GiB" in h200.problems[1]


QWEN_ENV = slurm_env("gpu[01-02]", 2)
DSV3_ENV = slurm_env("gpu[01-04]", 4)


@pytest.mark.parametrize("overrides, environ, reason", [
    # more GPUs than the nodes have
    ([*QWEN_2x8, "cluster.num_engines=8", "cluster.inference_nodes=1"], QWEN_ENV,
     "8 engine(s) x 2 GPUs need 16 GPUs; the inference pool (1 node(s) x 8 GPUs) holds 4 engine(s)"),
    ([*QWEN_2x8, "cluster.num_engines=8"], QWEN_ENV,
     "no node left for the training pool: 2 node(s), 2 of them for 8 engine(s)"),
    ([*QWEN_2x8, "cluster.learner_ranks=16"], QWEN_ENV,
     "16 learner rank(s) x 1 GPUs need 16 GPUs; the training pool's 1 node(s) x 8 GPUs have room for 8"),
    ([*QWEN_2x8, "cluster.inference_nodes=2", "cluster.training_nodes=1"], QWEN_ENV,
     "the pools want 1 training + 2 inference node(s) but the job has 2: gpu01 gpu02"),
    # a learner world Megatron cannot split, or one that leaves GPUs idle
    ([*QWEN_2x8, "parallel.pipeline_parallel=3"], QWEN_ENV,
     "Megatron needs the learner world (8 rank(s)) to be a multiple of TP x PP = 2 x 3 = 6"),
    ([*QWEN_2x8, "parallel.tensor_parallel=1", "parallel.expert_parallel=16"], QWEN_ENV,
     "Megatron needs TP x EP x PP = 1 x 16 x 1 = 16 to divide the learner world (8 rank(s)): EP=16 does not divide "
     "DP=8"),
    ([*QWEN_2x8, "cluster.learner_ranks=4"], QWEN_ENV,
     "the learner world (4 rank(s)) leaves 4 of the training pool's 8 GPUs idle"),
    # an engine wider than a node
    ([*QWEN_2x8, "cluster.num_engines=1", "cluster.engine_tensor_parallel=16"], QWEN_ENV,
     "an engine's tensor parallelism (cluster.engine_tensor_parallel=16) does not fit a node of 8 GPUs"),
    # the model's shape
    ([*DSV3, "cluster.num_engines=1", "parallel.expert_parallel=24"], DSV3_ENV,
     "parallel.expert_parallel=24 does not divide the model's 256 experts (deepseek_v3)"),
    ([*DSV3, "cluster.num_engines=1", "parallel.pipeline_parallel=2"], DSV3_ENV,
     "parallel.pipeline_parallel=2 does not divide the model's 61 layers"),
    ([*QWEN_2x8, "parallel.tensor_parallel=8", "parallel.expert_parallel=1"], QWEN_ENV,
     "parallel.tensor_parallel=8 does not divide the model's 32 attention heads / 4 key-value groups"),
    # no job to plan for
    (QWEN_2x8, {}, "cluster=slurm but SLURM_JOB_NODELIST is not set"),
    ([*QWEN_2x8, "cluster.engine_gpus=1"], QWEN_ENV,
     "cluster.engine_gpus=1 but an engine of cluster.engine_tensor_parallel=2 holds 2 GPU(s)"),
])
def test_impossible_plans_are_refused_with_the_reason(overrides, environ, reason):
    plan = plan_for(overrides, environ)
    assert not plan.ok
    assert any(reason in p for p in plan.problems), plan.problems
    assert reason in plan.render() and "plan: REFUSED" in plan.render()


def test_the_mismatch_probe_and_cuda_ipc_slots_count_in_a_ranks_memory():
    """What a default run keeps beside the weights, gradients and Adam: the mismatch probe's two copies of each
    rank's weights (on unless routing.probe_prompts=0 or routing.probe_every=0), and with sync.transport=cuda_ipc
    `sync.slots` whole bf16 models in rank 0's GPU memory. Would have caught: the estimate left both out, so this
    plan on 24-GiB GPUs said "13.4 of 20.0 GiB, plan: OK" with cuda_ipc, where rank 0 needs 22.9 GiB."""
    one_node = ["model=qwen3_moe_1b_64e", *GPU_TRAINING, "cluster.num_engines=2", "parallel.expert_parallel=2",
                "cluster.gpu_memory_gib=24"]
    env = slurm_env("gpu07", 1)
    off = plan_for([*one_node, "routing.probe_prompts=0"], env)
    assert off.ok and off.rank_memory.probe == 0
    assert "mismatch probe off (routing.probe_prompts=0 or routing.probe_every=0): no copies" in off.render()
    assert plan_for([*one_node, "routing.probe_every=0"], env).rank_memory.total == off.rank_memory.total
    probed = plan_for(one_node, env)  # the default: the probe on
    mem = probed.rank_memory
    assert abs(mem.probe - 2 * mem.weights) <= 2 and mem.total == off.rank_memory.total + mem.probe
    assert ("weights 1.8 GiB + grads 3.6 GiB + Adam 2.9 GiB + activations 4.9 GiB + mismatch probe 3.6 GiB = "
            "17.0 GiB of 20.0 GiB usable") in probed.render()
    assert "mismatch probe: 2 copies of the weights" in probed.render() and probed.ok
    ipc = plan_for([*one_node, "sync.transport=cuda_ipc"], env)
    assert ipc.rank_memory.sync_slots == 2 * ipc.sync_bytes  # sync.slots=2 versions of 1.58B x 2 bytes
    (reason,) = ipc.problems
    assert reason.startswith("a learner rank needs 22.9 GiB (weights 1.8 GiB + grads 3.6 GiB + Adam 2.9 GiB + "
                             "activations 4.9 GiB + mismatch probe 3.6 GiB + cuda_ipc slots 5.9 GiB on rank 0 on "
                             "pipeline stage 0) but a GPU has 20.0 GiB usable")
    assert reason.endswith("routing.probe_prompts=0 (no mismatch probe: 3.6 GiB less), or sync.transport=shm "
                           "(weights through host memory: 5.9 GiB less on rank 0)")
    one_slot = plan_for([*one_node, "sync.transport=cuda_ipc", "sync.slots=1", "routing.probe_prompts=0"], env)
    assert one_slot.ok and one_slot.rank_memory.sync_slots == one_slot.sync_bytes


def test_the_estimates_probe_copies_are_the_learners():
    """memory_estimate mirrors the learner's MAX_SNAPSHOTS (a dry run must not import torch to read it)."""
    from moe_grpo.learner.megatron_learner import MAX_SNAPSHOTS
    from moe_grpo.orchestrator.memory_estimate import PROBE_SNAPSHOTS

    assert PROBE_SNAPSHOTS == MAX_SNAPSHOTS


def test_a_one_node_job_shares_its_node_engines_first_and_is_runnable_in_this_build():
    plan = plan_for(["model=qwen3_moe_1b_64e", *GPU_TRAINING, "cluster.num_engines=2", "parallel.expert_parallel=2"],
                    slurm_env("gpu07", 1))
    text = plan.render()
    assert plan.ok, text
    assert ("training pool: 1 node (gpu07): 6 learner ranks, 1 GPU each, Megatron TP=1 PP=1 DP=6 EP=2 "
            "(expert DP 3)") in text
    assert "inference pool: 1 node (gpu07): 2 engines x TP=1, 1 GPU each" in text
    assert "  gpu07: engine0, engine1 (2 of 8 GPUs)" in text
    assert "gpu07 3.17 GB (shared memory: learner ranks run there); nothing over the network" in text
    assert not_runnable_yet(plan) == []
    assert plan.bundle_nodes() == ["gpu07"] * 8
    crowded = plan_for(["model=qwen3_moe_1b_64e", *GPU_TRAINING, "cluster.num_engines=2", "cluster.learner_ranks=8"],
                       slurm_env("gpu07", 1))
    assert ("8 learner rank(s) x 1 GPUs need 8 GPUs; gpu07's 8 GPUs less the engines' 2 have room for 6"
            in crowded.problems)


def test_the_default_local_run_is_planned_as_before_on_this_host():
    run = run_config([])
    plan = build_plan(run, {}, seq_len=32)
    text = plan.render()
    assert plan.ok and not plan.pinned, text
    assert plan.cluster_for_run(run.cluster) is run.cluster  # nothing about a local run changes
    assert plan.bundle_nodes() == [None, None]
    assert "placement plan (cluster=local): 1 node" in text and "nodes from this host" in text
    assert "1 learner rank, Megatron TP=1 PP=1 DP=1 EP=1" in text and "1 engine x TP=1" in text
    assert "through shared memory on the learner's host" in text
    assert not_runnable_yet(plan) == []


def test_a_local_run_asking_for_more_gpus_than_the_host_has_is_refused():
    run = run_config(["cluster.learner_gpus=1", "cluster.engine_gpus=1", "parallel.expert_parallel=2",
                      "cluster.cpus_per_node=16"])
    plan = build_plan(run, {"CUDA_VISIBLE_DEVICES": "0,1"}, seq_len=32)
    assert plan.problems == (f"1 engine(s) x 1 GPU + 2 learner rank(s) x 1 GPU need 3 GPUs; {plan.facts.nodes[0]} "
                             "has 2",)


def test_a_local_run_asking_for_more_cpus_than_the_host_has_is_refused_and_one_that_joins_a_cluster_is_not():
    """Would have caught: an engine of tensor parallelism 2 and a 2-rank learner on a 2-core host (3 CPUs reserved)
    printed "plan: OK", then Ray waited for the CPUs with nothing on the console until cluster.start_timeout_s."""
    crowded = ["cluster.engine_tensor_parallel=2", "cluster.learner_ranks=2", "parallel.expert_parallel=2",
               "cluster.cpus_per_node=2"]
    plan = build_plan(run_config(crowded), {}, seq_len=32)
    assert plan.problems == ("1 engine(s) x cluster.engine_cpus=1 + 2 learner rank(s) x cluster.learner_cpus=1 "
                             f"reserve 3 CPUs; {plan.facts.nodes[0]} has 2: lower them (a fraction shares a core) or "
                             "join a larger Ray cluster (cluster.ray_address)",)
    assert build_plan(run_config(crowded + ["cluster.learner_cpus=0.5"]), {}, seq_len=32).ok
    assert build_plan(run_config(crowded + ["cluster.ray_address=127.0.0.1:6379"]), {}, seq_len=32).ok


def test_learners_on_cpu_at_tp_x_ep_are_refused_with_the_alltoall_dispatcher_and_planned_with_allgather():
    """Would have caught: `cluster.learner_ranks=4 parallel.tensor_parallel=2 parallel.expert_parallel=2` on CPU
    printed "plan: OK", then every rank refused the alltoall dispatcher while building its learner and the run
    stopped 20 s in (a trial, 2026-11-28). Ranks with a GPU (NCCL) are not refused."""
    tp_ep = ["cluster.learner_ranks=4", "cluster.learner_cpus=0.25", "cluster.engine_cpus=0.5",
             "parallel.tensor_parallel=2", "parallel.expert_parallel=2", "cluster.cpus_per_node=2"]
    assert build_plan(run_config(tp_ep), {}, seq_len=32).problems == (
        "parallel.tensor_parallel=2 x parallel.expert_parallel=2 on CPU (gloo) needs the allgather token dispatcher "
        "(gloo's all_gather refuses the alltoall dispatcher's uneven sizes; allgather gives the same results): set "
        "megatron.token_dispatcher=allgather",)
    assert build_plan(run_config(tp_ep + ["megatron.token_dispatcher=allgather"]), {}, seq_len=32).ok
    on_gpus = tp_ep + ["cluster.learner_gpus=1", "cluster.engine_gpus=1"]
    assert build_plan(run_config(on_gpus), {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"}, seq_len=32).ok


def test_a_run_joining_a_cluster_does_not_promise_shared_memory():
    """The plan cannot see a joined cluster's nodes: it printed 'through shared memory on the learner's host' for a
    run whose second learner rank Ray placed on another node, which then relayed every version."""
    text = build_plan(run_config(["cluster.ray_address=127.0.0.1:6379"]), {}, seq_len=32).render()
    assert "on the learner's host" not in text and "relayed to the others" in text, text


@pytest.mark.parametrize("tp, pp, dp, ep", [(2, 2, 4, 2), (1, 2, 4, 4), (4, 1, 2, 2), (2, 3, 2, 1), (1, 1, 8, 8)])
def test_coordinates_are_megatrons(tp, pp, dp, ep):
    """Each rank's (tp, pp, dp, ep, expert dp) as megatron-core 0.16.1's RankGenerator groups them with its default
    order tp-cp-ep-dp-pp (expert tensor parallel = TP)."""
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    world = tp * pp * dp
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=order)

    def index_in(generator, token, rank):
        (group,) = [g for g in generator.get_ranks(token) if rank in g]
        return group.index(rank)

    layout = Layout(world, tp, pp, dp, ep)
    for rank in range(world):
        assert coordinates(rank, layout) == (index_in(dense, "tp", rank), index_in(dense, "pp", rank),
                                             index_in(dense, "dp", rank), index_in(expert, "ep", rank),
                                             index_in(expert, "dp", rank)), rank


def test_bundles_are_pinned_to_the_ray_node_of_each_planned_host():
    ray_nodes = [{"NodeManagerHostname": "gpu01.cluster.local", "NodeManagerAddress": "10.0.0.1", "Alive": True},
                 {"NodeManagerHostname": "gpu02", "NodeManagerAddress": "10.0.0.2", "Alive": True},
                 {"NodeManagerHostname": "gpu03", "NodeManagerAddress": "10.0.0.3", "Alive": False}]
    bundles = pin_bundles([{"CPU": 1.0, "GPU": 2.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0}],
                          ["gpu02", "gpu01", None], ray_nodes)
    assert bundles == [{"CPU": 1.0, "GPU": 2.0, "node:10.0.0.2": 0.001},
                       {"CPU": 1.0, "GPU": 1.0, "node:10.0.0.1": 0.001}, {"CPU": 1.0}]
    with pytest.raises(RuntimeError, match=r"places work on gpu03, which has not joined the Ray cluster \(joined: "
                                           r"gpu01, gpu02\)"):
        pin_bundles([{"CPU": 1.0}], ["gpu03"], ray_nodes)


def test_the_driver_refuses_a_plan_before_anything_starts():
    from moe_grpo.orchestrator.session import checked_plan

    with pytest.raises(PlanRefused, match="parallel.pipeline_parallel=5 does not divide the model's 3 layers"):
        checked_plan(run_config(["parallel.pipeline_parallel=5"]))
    # Engines with tensor parallelism are no longer refused at start (issue 32): the plan's engines carry TP=2.
    run, plan = checked_plan(run_config([*QWEN_2x8, "cluster.nodes=[gpu01,gpu02]", "cluster.gpus_per_node=8"]))
    assert plan.ok and {e.tensor_parallel for e in plan.engines} == {2} and run.cluster.engine_gpus == 2.0
    run, plan = checked_plan(run_config([]))
    assert plan.ok and run.cluster == run_config([]).cluster


def _train(args, env, cwd, *python_flags):
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, *python_flags, "-m", "moe_grpo.train", *args], cwd=cwd, capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env})
    return out, time.perf_counter() - t0


def test_a_dry_run_prints_the_plan_and_exits_before_ray_starts(tmp_path):
    env = {**slurm_env("gpu[01-02]", 2), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out, seconds = _train([*QWEN_2x8, "cluster.dry_run=true"], env, tmp_path, "-X", "importtime")
    assert out.returncode == 0, out.stderr
    import re

    assert not re.search(r"\|\s+(torch|ray|vllm|megatron)$", out.stderr, re.MULTILINE), "a dry run imported them"
    assert "training pool: 1 node (gpu01): 8 learner ranks" in out.stdout
    assert "inference pool: 1 node (gpu02): 4 engines x TP=2, 2 GPUs each" in out.stdout
    assert out.stdout.rstrip().endswith("plan: OK"), "no note that the run would stop at start (TP=2 engines run)"
    assert "stops at start" not in out.stdout
    assert not list(tmp_path.iterdir()), "a dry run writes no run directory"
    assert seconds < 30, f"a dry run took {seconds:.1f} s"
    refused, _ = _train([*QWEN_2x8, "cluster.dry_run=true", "cluster.learner_ranks=16"], env, tmp_path)
    assert refused.returncode == 2
    assert "plan: REFUSED (1 reason)" in refused.stdout
    assert refused.stderr.startswith("[moe_grpo] the placement plan is refused: 16 learner rank(s) x 1 GPUs need 16 "
                                     "GPUs; the training pool's 1 node(s) x 8 GPUs have room for 8")
    assert "Traceback" not in refused.stderr


def test_a_slurm_plan_prints_a_checkpoints_write_time_beside_the_signals_warning_and_warns_when_it_does_not_fit():
    """Would have caught: nothing compared the time to write a checkpoint with `--signal`'s warning (120 s in
    train.sbatch): Qwen3-30B-A3B's 427 GB (bf16 weights + Adam's fp32 main parameters and moments) at 0.5 GB/s
    take 14 min, so at the time limit the job was killed mid-write and lost every step since the checkpoint
    before, with no word before the run."""
    env = {**QWEN_ENV, "MOE_GRPO_SIGNAL_S": "120"}
    slow = plan_for(QWEN_2x8, env, write_gbps=0.5)
    text = slow.render()
    assert slow.checkpoint.total == 30_532_122_624 * (2 + 12)
    assert ("checkpoint: 427.4 GB (weights 61.1 GB + Adam 366.4 GB, the whole model) ~ 14 min at 0.50 GB/s "
            "(given); SLURM's warning comes 120 s before the time limit (--signal): DOES NOT FIT") in text
    (warning,) = [n for n in slow.notes if n.startswith("WARNING")]
    assert "takes ~14 min at 0.50 GB/s, longer than the 120 s between SLURM's warning signal" in warning
    assert "#SBATCH --signal=B:TERM@1380" in warning
    assert slow.ok, "a warning, not a refusal: the run itself can go"
    fast = plan_for(QWEN_2x8, env, write_gbps=5.0)
    assert "~ 85 s at 5.00 GB/s (given); SLURM's warning comes 120 s before the time limit (--signal): fits, 35 s " \
           "left" in fast.render()
    assert not [n for n in fast.notes if n.startswith("WARNING")]


def test_the_write_rate_is_measured_where_the_checkpoints_go_only_when_the_warning_time_is_known(tmp_path):
    from moe_grpo.orchestrator.checkpoint_time import measure_write_gbps

    asked = []
    plan = plan_for(QWEN_2x8, {**QWEN_ENV, "MOE_GRPO_SIGNAL_S": "600"}, checkpoint_dir=str(tmp_path),
                    measure_write=lambda d: asked.append(d) or 1.0)
    assert asked == [str(tmp_path)]
    assert f"at 1.00 GB/s (one writer, measured in {tmp_path})" in plan.render()
    unknown = plan_for(QWEN_2x8, QWEN_ENV, measure_write=lambda d: asked.append(d) or 1.0)
    assert len(asked) == 1, "no warning time: nothing measured"
    assert ("checkpoint: 427.4 GB (weights 61.1 GB + Adam 366.4 GB, the whole model); write time not measured "
            "(MOE_GRPO_SIGNAL_S unset: --signal's time unknown)") in unknown.render()
    bad = plan_for(QWEN_2x8, {**QWEN_ENV, "MOE_GRPO_SIGNAL_S": "2m"}, measure_write=None)
    assert any("MOE_GRPO_SIGNAL_S='2m': expected the positive seconds" in n for n in bad.notes)
    assert plan_for(["model=qwen3_moe_1b_64e"], {}).checkpoint is None  # a local run: no SLURM time limit
    gbps = measure_write_gbps(str(tmp_path), 16 << 20)
    assert gbps > 0.001 and list(tmp_path.iterdir()) == [], "the measurement leaves nothing behind"


def test_a_version_is_sized_in_the_engines_dtype():
    """Would have caught: the weight-sync line, `sync_bytes` and the cuda_ipc slots sized in the learner's parameter
    dtype (float32 on CPU) while bf16 engines receive versions in bf16 - twice the bytes a user reads."""
    bf16 = build_plan(run_config(["rollout.dtype=bfloat16"]), {}, seq_len=32)
    assert ("weight sync: 1.74 MB per version (871,296 parameters x 2 bytes, bfloat16) through shared memory on the "
            "learner's host") in bf16.render()
    assert bf16.sync_bytes == 871_296 * 2
    fp32 = build_plan(run_config([]), {}, seq_len=32)
    assert "weight sync: 3.49 MB per version (871,296 parameters x 4 bytes, float32)" in fp32.render()
    # LoRA versions stay float32 whatever the engines serve (sync/dtypes.py says why).
    lora = build_plan(run_config(["rollout.dtype=bfloat16", "lora.rank=4"]), {}, seq_len=32)
    assert lora.sync_dtype == "float32"
    # A LoRA run sends its base once, then the adapters only: the line said "3.49 MB per version" for 0.23 MB
    # versions (2026-11-28). 233,472 B per adapter version at r = 4 (docs/guides/lora.md, measured by the sync).
    assert lora.adapter_bytes == 233_472 and lora.sync_bytes == 3_485_184 + 233_472
    assert ("weight sync: 3.72 MB for the first version (871,296 parameters and the adapters x 4 bytes, float32), "
            "then 0.23 MB per version (the LoRA adapters only)") in lora.render()
    slurm = plan_for(["model=qwen3_moe_30b_a3b", *GPU_TRAINING, "cluster.engine_tensor_parallel=2",
                      "parallel.tensor_parallel=2", "parallel.expert_parallel=4", "routing.probe_prompts=0",
                      "lora.rank=16", "lora.alpha=32", "lora.targets=[attention]"], slurm_env("gpu[01-02]", 2))
    per_version = slurm.adapter_bytes
    assert per_version < slurm.sync_bytes / 100
    assert f"{per_version / 1e9:.2f} GB per version over the network to 1 host" in slurm.render() or \
        f"{per_version / 1e6:.2f} MB per version over the network to 1 host" in slurm.render(), slurm.render()
    # An fp32 GPU learner feeding bf16 engines through cuda_ipc keeps sync.slots versions of 2 bytes per parameter.
    ipc = plan_for(["model=qwen3_moe_1b_64e", "cluster=slurm", "rollout.dtype=bfloat16", "sync.transport=cuda_ipc",
                    "cluster.num_engines=2", "routing.probe_prompts=0"], slurm_env("gpu07", 1))
    assert ipc.rank_memory.sync_slots == 2 * ipc.total_params * 2 == 2 * ipc.sync_bytes
    assert "2 whole-model slots (1.58B parameters x 2 bytes each, bfloat16) on rank 0" in ipc.render()
