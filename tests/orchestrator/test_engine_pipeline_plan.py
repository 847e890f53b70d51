"""`cluster.engine_pipeline_parallel` in the placement plan and the memory estimate (issue 32, PP): an engine of
TP x PP GPUs on one node, or beyond a node its stages over whole nodes (vLLM's Ray executor, one bundle per
worker), weights / (TP x PP) per engine GPU, and the refusals naming the numbers.

Before the key existed, `cluster.engine_pipeline_parallel=2` was not a config key (Hydra refused it) and an engine
GPU was always sized at weights / TP. Before stages could span nodes, every engine wider than a node was refused
("an engine's pipeline stages run within one node (stages across nodes, vLLM's Ray executor, are not built)")."""

import pytest

from test_placement_plan import GPU_TRAINING, QWEN_2x8, plan_for, run_config, slurm_env

QWEN_ENV = slurm_env("gpu[01-02]", 2)


def test_an_engine_of_two_stages_holds_tp_x_pp_gpus_of_its_node_each_with_half_a_stage_of_weights():
    """Qwen3-30B-A3B (61.06 GB in bf16): 2 engines of TP=2 x PP=2 = 4 GPUs each fill the inference node, each GPU
    holding a quarter of the weights (14.2 GiB, half of the TP=2 engine's 28.4 GiB)."""
    plan = plan_for([*QWEN_2x8, "cluster.num_engines=2", "cluster.engine_pipeline_parallel=2"], QWEN_ENV)
    text = plan.render()
    assert plan.ok, text
    assert "inference pool: 1 node (gpu02): 2 engines x TP=2 PP=2, 4 GPUs each" in text
    assert "  gpu02: engine0, engine1 (8 of 8 GPUs)" in text
    assert "memory per engine GPU: weights 14.2 GiB of 68.0 GiB usable" in text
    assert [(e.tensor_parallel, e.pipeline_parallel, e.gpus) for e in plan.engines] == [(2, 2, 4.0)] * 2
    assert plan.cluster_for_run(run_config([*QWEN_2x8, "cluster.num_engines=2",
                                            "cluster.engine_pipeline_parallel=2"]).cluster).engine_gpus == 4.0


def test_deepseek_v3_engine_refusal_counts_its_pipeline_stages():
    """One bf16 copy of DeepSeek-V3 over TP=4 x PP=2 GPUs is 156.2 GiB a GPU: refused, the division said."""
    plan = plan_for(["model=deepseek_v3", *GPU_TRAINING, "cluster.num_engines=1", "cluster.engine_tensor_parallel=4",
                     "cluster.engine_pipeline_parallel=2", "parallel.expert_parallel=16"],
                    slurm_env("gpu[01-04]", 4))
    engine = [p for p in plan.problems if p.startswith("an engine GPU needs")]
    assert engine and engine[0].startswith("an engine GPU needs 156.2 GiB for its share of the weights (671.03B "
                                           "parameters x 2 bytes bfloat16 / TP 4 x PP 2) but vLLM may use 68.0 GiB"), \
        plan.problems


@pytest.mark.parametrize("overrides,reason", [
    (["cluster.num_engines=1", "cluster.engine_tensor_parallel=16"],
     "an engine's tensor parallelism (cluster.engine_tensor_parallel=16) does not fit a node of 8 GPUs: a stage's "
     "tensor-parallel workers run within one node"),
    (["cluster.num_engines=1", "cluster.engine_tensor_parallel=3", "cluster.engine_pipeline_parallel=4"],
     "an engine of cluster.engine_tensor_parallel=3 x cluster.engine_pipeline_parallel=4 = 12 GPUs spans nodes of 8 "
     "GPUs, but TP=3 does not divide a node's 8 GPUs"),
    (["cluster.num_engines=1", "cluster.engine_tensor_parallel=4", "cluster.engine_pipeline_parallel=3"],
     "an engine of cluster.engine_tensor_parallel=4 x cluster.engine_pipeline_parallel=3 = 12 GPUs spans nodes of 8 "
     "GPUs (2 stage(s) of TP=4 each), but PP=3 is not a multiple of 2: its last node would be part-filled"),
    (["cluster.num_engines=1", "cluster.engine_tensor_parallel=1", "cluster.engine_pipeline_parallel=64"],
     "cluster.engine_pipeline_parallel=64 stages for the model's 48 decoder layers"),
    (["cluster.engine_pipeline_parallel=2", "cluster.engine_gpus=2"],
     "cluster.engine_gpus=2 but an engine of cluster.engine_tensor_parallel=2 x cluster.engine_pipeline_parallel=2 "
     "holds 4 GPU(s)"),
    (["cluster.num_engines=2", "cluster.engine_pipeline_parallel=2", "lora.rank=4", "lora.alpha=8",
      "sync.lora_apply=serve"],
     "cluster.engine_pipeline_parallel=2 with sync.lora_apply=serve: adapters served by vLLM are built for engines of "
     "one pipeline stage; set sync.lora_apply=merge"),
])
def test_impossible_engine_pipelines_are_refused_with_the_reason(overrides, reason):
    plan = plan_for([*QWEN_2x8, *overrides], QWEN_ENV)
    assert not plan.ok
    assert any(reason in p for p in plan.problems), plan.problems


@pytest.mark.parametrize("value", [0, -1])
def test_engine_pipeline_parallel_below_one_is_refused_at_config(value):
    with pytest.raises(Exception, match=r"cluster.engine_pipeline_parallel"):
        run_config([f"cluster.engine_pipeline_parallel={value}"])


DSV3_ENGINE = ["model=deepseek_v3", *GPU_TRAINING, "cluster.num_engines=1", "cluster.engine_tensor_parallel=8",
               "parallel.tensor_parallel=4", "parallel.expert_parallel=64", "routing.probe_prompts=0"]


def test_deepseek_v3_bf16_engine_spans_three_whole_nodes_one_stage_each_one_bundle_per_worker():
    """DeepSeek-V3 in bf16 (1.34 TB) on 8 x 80 GB nodes: TP=8 x PP=3 = 24 GPUs over three inference nodes, one
    stage of 8 workers on each, 52.1 GiB of weights per GPU (15.9 GiB left for the KV cache); each worker gets a
    bundle on its stage's node, the engine's actor (and vLLM's engine core) on stage 0's node, reserving no GPU;
    every node of the engine receives each version once. Before: refused ("does not fit a node of 8 GPUs ...
    stages across nodes, vLLM's Ray executor, are not built")."""
    plan = plan_for([*DSV3_ENGINE, "cluster.engine_pipeline_parallel=3"], slurm_env("gpu[01-35]", 35))
    text = plan.render()
    assert plan.ok, text
    assert ("inference pool: 3 nodes (gpu33 gpu34 gpu35): 1 engine x TP=8 PP=3, 24 GPUs each, stages across 3 "
            "nodes each") in text
    for stage, node in enumerate(["gpu33", "gpu34", "gpu35"]):
        assert f"  {node}: engine0 stage {stage} (8 of 8 GPUs)" in text
    assert "memory per engine GPU: weights 52.1 GiB of 68.0 GiB usable (15.9 GiB left for the KV cache)" in text
    assert plan.engine_worker_nodes() == [["gpu33"] * 8 + ["gpu34"] * 8 + ["gpu35"] * 8]
    assert plan.bundle_nodes()[0] == "gpu33"  # the engine actor's bundle: stage 0's node
    assert plan.engine_hosts == ["gpu33", "gpu34", "gpu35"]
    assert "into each engine host: gpu33 1342.05 GB, gpu34 1342.05 GB, gpu35 1342.05 GB" in text
    assert plan.cluster_for_run(run_config([*DSV3_ENGINE, "cluster.engine_pipeline_parallel=3"]).cluster
                                ).engine_gpus == 0.0


def test_deepseek_v3_bf16_engine_on_two_nodes_is_refused_by_its_memory_and_told_how_many_stages_fit():
    """Two 8 x 80 GB nodes per engine (TP=8 x PP=2) leave 78.1 GiB of weights on each GPU, over the 68.0 GiB vLLM
    may use: refused, naming PP >= 3 (the stages then span three nodes)."""
    plan = plan_for([*DSV3_ENGINE, "cluster.engine_pipeline_parallel=2"], slurm_env("gpu[01-34]", 34))
    assert "  gpu34: engine0 stage 1 (8 of 8 GPUs)" in plan.render()
    assert plan.problems == (
        "an engine GPU needs 78.1 GiB for its share of the weights (671.03B parameters x 2 bytes bfloat16 / TP 8 x "
        "PP 2) but vLLM may use 68.0 GiB of a 80-GiB GPU (0.9 of it less 4 GiB); more pipeline stages "
        "(cluster.engine_pipeline_parallel >= 3 at TP=8: stages beyond a node span nodes through vLLM's Ray "
        "executor, whole stages per node) or larger GPUs (cluster.gpu_memory_gib)",)


def test_two_engines_of_stages_spanning_nodes_each_get_their_own_whole_nodes():
    """Qwen3-30B-A3B, 2 engines of TP=2 x PP=8 = 16 GPUs: four stages per node, engine0 on gpu02-gpu03, engine1
    on gpu04-gpu05; too few nodes for the second engine is refused with the count."""
    overrides = [*QWEN_2x8, "cluster.num_engines=2", "cluster.engine_pipeline_parallel=8"]
    plan = plan_for(overrides, slurm_env("gpu[01-05]", 5))
    text = plan.render()
    assert plan.ok, text
    assert "  gpu02: engine0 stages 0-3 (8 of 8 GPUs)" in text and "  gpu05: engine1 stages 4-7 (8 of 8 GPUs)" in text
    assert plan.engine_worker_nodes() == [["gpu02"] * 8 + ["gpu03"] * 8, ["gpu04"] * 8 + ["gpu05"] * 8]
    short = plan_for([*overrides, "cluster.inference_nodes=3"], slurm_env("gpu[01-04]", 4))
    assert ("2 engine(s) x 16 GPUs need 32 GPUs; the inference pool (3 node(s) x 8 GPUs) holds 1 engine(s) of 2 "
            "whole nodes each") in short.problems


def test_an_engine_wider_than_a_cpu_node_is_refused_quoting_why_vllm_cpu_cannot_span_nodes():
    """On CPU nodes an engine's stages cannot go to other nodes: vLLM 0.32's CPU platform refuses its Ray
    executor, quoted from its source."""
    plan = plan_for(["cluster=slurm", "cluster.engine_pipeline_parallel=2", "cluster.engine_cpus=8"],
                    slurm_env("cpu[01-03]", 3, gpus=0, cpus=4))
    why = [p for p in plan.problems if "cannot span nodes on CPU" in p]
    assert why and why[0].startswith("an engine of cluster.engine_cpus=8 does not fit a node of 4 CPUs"), plan.problems
    assert "ValueError(\"current platform cpu does not support ray.\") (vllm/v1/executor/ray_utils.py:572-576)" in why[0]


def test_a_cpu_engine_with_more_workers_than_cores_is_noted_not_refused():
    """TP=4 x PP=3 on a 2-core host printed "plan: OK" with nothing about its 12 workers sharing 2 cores (a user's
    trial, 2026-11-28); TP=4 did run, oversubscribed. The plan now says so, and still lets it run."""
    from test_placement_plan import plan_for

    plan = plan_for(["model=deepseek_moe", "cluster.engine_tensor_parallel=4", "cluster.engine_pipeline_parallel=3",
                     "cluster.cpus_per_node=2", "cluster.gpus_per_node=0"], {})
    assert plan.ok, plan.render()
    assert "note: an engine of TP=4 x PP=3 runs 12 vLLM workers, one core set each, on nodes of 2 CPUs" in plan.render()
    quiet = plan_for(["model=deepseek_moe", "cluster.engine_tensor_parallel=2", "cluster.cpus_per_node=2",
                      "cluster.gpus_per_node=0"], {})
    assert "vLLM workers" not in quiet.render()
