"""`cluster.engine_pipeline_parallel` in the placement plan and the memory estimate (issue 32, PP): an engine of
TP x PP GPUs on one node, weights / (TP x PP) per engine GPU, and the refusals naming the numbers.

Before the key existed, `cluster.engine_pipeline_parallel=2` was not a config key (Hydra refused it) and an engine
GPU was always sized at weights / TP."""

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
    (["cluster.num_engines=1", "cluster.engine_pipeline_parallel=8"],
     "an engine of cluster.engine_tensor_parallel=2 x cluster.engine_pipeline_parallel=8 = 16 GPUs does not fit a "
     "node of 8 GPUs; an engine's pipeline stages run within one node"),
    (["cluster.num_engines=1", "cluster.engine_tensor_parallel=1", "cluster.engine_pipeline_parallel=64"],
     "cluster.engine_pipeline_parallel=64 stages for the model's 48 decoder layers"),
    (["cluster.engine_pipeline_parallel=2", "cluster.engine_gpus=2"],
     "cluster.engine_gpus=2 but an engine of cluster.engine_tensor_parallel=2 x cluster.engine_pipeline_parallel=2 "
     "holds 4 GPU(s)"),
    (["cluster.num_engines=2", "cluster.engine_pipeline_parallel=2", "lora.rank=4", "lora.alpha=8"],
     "cluster.engine_pipeline_parallel=2 with lora.rank=4: LoRA versions are built for engines of one pipeline "
     "stage"),
])
def test_impossible_engine_pipelines_are_refused_with_the_reason(overrides, reason):
    plan = plan_for([*QWEN_2x8, *overrides], QWEN_ENV)
    assert not plan.ok
    assert any(reason in p for p in plan.problems), plan.problems


@pytest.mark.parametrize("value", [0, -1])
def test_engine_pipeline_parallel_below_one_is_refused_at_config(value):
    with pytest.raises(Exception, match=r"cluster.engine_pipeline_parallel"):
        run_config([f"cluster.engine_pipeline_parallel={value}"])
