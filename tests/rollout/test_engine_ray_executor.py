"""An engine whose pipeline stages span nodes (issue 32, PP), without a GPU and without vLLM's Ray executor running:
the executor vLLM is given, the engine's placement group set on vLLM's config, and the refusal on CPU quoting
vLLM 0.32's own reason.

Before rollout/ray_executor.py, every engine of several workers got the multiprocessing executor (all workers on
the engine's host) and there was no way to hand vLLM a placement group: `engine_args(..., spans_nodes=True)` was a
TypeError, and a CPU engine asked to span nodes would have reached vLLM's engine core and died there at start."""

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import vllm
from moe_grpo.config import load_model_spec
from moe_grpo.rollout import ray_executor
from moe_grpo.rollout.engine_error import EngineError
from moe_grpo.rollout.engine_setup import engine_args
from moe_grpo.rollout.worker_start import ForkedWorkersExecutor


def _args(tmp_path, **kw):
    base = dict(dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0, tensor_parallel=2, extension=True,
                max_num_batched_tokens=None, native=False, served_lora=None, on_gpu=True, pipeline_parallel=2)
    return engine_args(str(tmp_path), load_model_spec("deepseek_moe"), **{**base, **kw})


def test_stages_spanning_nodes_get_vllms_ray_executor_and_everything_else_unchanged(tmp_path):
    """On GPU an engine spanning nodes gets distributed_executor_backend='ray' and the same arguments otherwise
    (the worker extension, TP and PP sizes); an engine on one node keeps the forked multiprocessing executor."""
    spanning = _args(tmp_path, spans_nodes=True)
    local = _args(tmp_path)
    assert spanning["distributed_executor_backend"] == "ray"
    assert local["distributed_executor_backend"] is ForkedWorkersExecutor
    assert {k: v for k, v in spanning.items() if k != "distributed_executor_backend"} == \
        {k: v for k, v in local.items() if k != "distributed_executor_backend"}
    assert spanning["worker_extension_cls"] == "moe_grpo.rollout.worker_extension.RoutingCaptureExtension"
    assert (spanning["tensor_parallel_size"], spanning["pipeline_parallel_size"]) == (2, 2)


def test_cpu_engine_spanning_nodes_is_refused_before_vllm_starts_quoting_vllm(tmp_path):
    """On CPU the engine refuses stages on other nodes with vLLM's own words, before any process starts."""
    with pytest.raises(EngineError, match=r"tensor_parallel=2 x pipeline_parallel=2 with its stages on several "
                                          r"nodes .* on vLLM's CPU backend: .*current platform cpu does not support "
                                          r"ray\."):
        _args(tmp_path, spans_nodes=True, on_gpu=False)
    assert _args(tmp_path, on_gpu=False)["distributed_executor_backend"] is ForkedWorkersExecutor


def test_the_quoted_refusal_is_what_the_installed_vllm_says():
    """The quote is vLLM 0.32's source: CpuPlatform has no Ray device key, and initialize_ray_cluster raises the
    quoted error when the key is empty (a vLLM that lifts it makes this fail, and the refusal must go)."""
    from vllm.platforms.cpu import CpuPlatform

    assert vllm.__version__.startswith("0.32")
    assert CpuPlatform.ray_device_key == ""
    source = (Path(vllm.__file__).parent / "v1/executor/ray_utils.py").read_text().splitlines()
    assert source[571:576] == [
        "    device_str = current_platform.ray_device_key",
        "    if not device_str:",
        "        raise ValueError(",
        '            f"current platform {current_platform.device_name} does not support ray."',
        "        )"]
    interface = (Path(vllm.__file__).parent / "platforms/interface.py").read_text().splitlines()
    assert "empty string means the device does not support ray" in " ".join(interface[148:150])
    assert "(vllm/v1/executor/ray_utils.py:572-576)" in ray_executor.RAY_ON_CPU_REFUSAL


def test_placement_group_bundles_are_checked_against_the_workers_with_the_numbers():
    ray_executor.check_placement_group([{"GPU": 1.0}] * 4, 4)
    with pytest.raises(EngineError, match=r"has 3 GPU bundle\(s\) \(none with more than one GPU\), expected 4"):
        ray_executor.check_placement_group([{"GPU": 1.0}] * 3 + [{"CPU": 1.0}], 4)
    with pytest.raises(EngineError, match=r"\{'GPU': 2.0\} with more than one GPU"):
        ray_executor.check_placement_group([{"GPU": 2.0}, {"GPU": 1.0}], 2)


def test_the_engines_placement_group_is_set_on_vllms_config_and_each_rank_gets_its_bundle(tmp_path, monkeypatch):
    """vLLM's AsyncEngineArgs takes no placement group: start_async_llm sets it on the VllmConfig it builds (what
    vLLM's engine core reads in initialize_ray_cluster), names bundle i for worker rank i (the plan's order of
    nodes), points the engine core at the actor's Ray cluster, and refuses a group for a non-Ray executor."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    config = SimpleNamespace(parallel_config=SimpleNamespace(placement_group="the run's group (vLLM's pick)"))
    started = {}
    monkeypatch.setattr(AsyncEngineArgs, "create_engine_config", lambda self, *a, **k: config)
    monkeypatch.setattr(AsyncLLM, "from_vllm_config", classmethod(lambda cls, c, **k: started.update(config=c, **k)
                                                                   or "llm"))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv(ray_executor.BUNDLE_INDICES_ENV, "")  # restored (removed) after the test
    group = object()
    assert ray_executor.start_async_llm(_args(tmp_path, spans_nodes=True), group) == "llm"
    assert started["config"].parallel_config.placement_group is group
    assert started["disable_log_stats"] is True
    assert os.environ[ray_executor.BUNDLE_INDICES_ENV] == "0,1,2,3"
    assert os.environ["RAY_ADDRESS"] == "10.0.0.1:6379"
    with pytest.raises(EngineError, match=re.escape("a placement group for an engine whose executor is")):
        ray_executor.start_async_llm(_args(tmp_path), group)
