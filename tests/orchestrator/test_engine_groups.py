"""An engine whose pipeline stages span nodes gets a placement group of its own, one GPU bundle per vLLM worker on
the node the plan names, and its actor is handed that group and the relay agents of its other hosts (issue 32, PP);
with Ray's calls recorded instead of made.

Before: the run had one placement group, one bundle per engine holding all its GPUs on one node, and nothing
handed an engine a group of its own (`engine_group_bundles` / `start_engine_groups` did not exist, and
`EngineWorker` took no `placement_group`)."""

import dataclasses
import importlib

import pytest
import ray

from moe_grpo.config import from_hydra, load_model_spec
from moe_grpo.orchestrator import pools
from moe_grpo.sync.layout import SyncLayout

ray_pg = importlib.import_module("ray.util.placement_group")  # the module (`ray.util.placement_group` is a function)

RAY_NODES = [{"Alive": True, "NodeManagerHostname": f"gpu{i}.cluster", "NodeManagerAddress": f"10.0.0.{i}"}
             for i in (33, 34)]


def test_one_gpu_bundle_per_worker_pinned_to_its_stages_node():
    bundles = pools.engine_group_bundles(["gpu33"] * 2 + ["gpu34"] * 2, RAY_NODES)
    assert bundles == [{"GPU": 1.0, "node:10.0.0.33": 0.001}] * 2 + [{"GPU": 1.0, "node:10.0.0.34": 0.001}] * 2
    with pytest.raises(RuntimeError, match=r"gpu35, which has not joined the Ray cluster"):
        pools.engine_group_bundles(["gpu35"], RAY_NODES)


class _Group:
    def __init__(self, bundles, ready=True):
        self.bundle_specs, self.ready = bundles, ready

    def wait(self, timeout_seconds):
        return self.ready


@pytest.fixture
def groups(monkeypatch):
    made, removed = [], []
    ready = {"value": True}

    def placement_group(bundles, strategy, name):
        made.append((name, bundles))
        return _Group(bundles, ready["value"])

    monkeypatch.setattr(ray_pg, "placement_group", placement_group)
    monkeypatch.setattr(ray_pg, "remove_placement_group", removed.append)
    monkeypatch.setattr(ray, "nodes", lambda: RAY_NODES)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": 8.0})
    return made, removed, ready


def test_only_engines_spanning_nodes_get_a_group_and_one_ray_cannot_reserve_is_named(groups):
    made, removed, ready = groups
    assert pools.start_engine_groups([None, None], 5) is None and made == []
    out = pools.start_engine_groups([["gpu33", "gpu34"], ["gpu33", "gpu34"]], 5)
    assert [name for name, _ in made] == ["moe_grpo-engine0", "moe_grpo-engine1"]
    assert out[0].bundle_specs == [{"GPU": 1.0, "node:10.0.0.33": 0.001}, {"GPU": 1.0, "node:10.0.0.34": 0.001}]
    ready["value"] = False
    with pytest.raises(RuntimeError, match=r"Ray could not reserve engine0's 2 GPU bundles on gpu33 gpu34 within 5 s"):
        pools.start_engine_groups([["gpu33", "gpu34"]], 5)
    assert len(removed) == 1  # the group it made is not left reserved


def _factory_kwargs(monkeypatch, engine_groups, layout, agents):
    asked = []

    class _Actor:
        def options(self, **options):
            asked.append(options)
            return self

        def remote(self, *args, **kwargs):
            asked.append(kwargs)

    monkeypatch.setattr(ray, "remote", lambda cls: _Actor())
    run = from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")),
                      "cluster": {"engine_tensor_parallel": 2, "engine_pipeline_parallel": 2}})
    pools.EngineFactory(run, "/tmp/run", layout, "/tmp/m", "the run's group", engine_groups, agents)(0)
    return asked


def test_the_engine_actor_gets_its_group_and_its_other_hosts_relay_agents_only_when_it_spans_nodes(monkeypatch):
    spanning = SyncLayout("relay", "run", ("L",), ("A",), engine_worker_hosts=(("A", "A", "B", "B"),))
    options, kwargs = _factory_kwargs(monkeypatch, ["engine0's group"], spanning, ["agent-L", "agent-A", "agent-B"])
    assert kwargs["placement_group"] == "engine0's group" and kwargs["host_agents"] == {"B": "agent-B"}
    assert (kwargs["tensor_parallel"], kwargs["pipeline_parallel"]) == (2, 2)
    assert options["scheduling_strategy"].placement_group == "the run's group"  # the actor: the run's bundle 0
    _, kwargs = _factory_kwargs(monkeypatch, None, SyncLayout("shm", "run", ("A",), ("A",)), [])
    assert kwargs["placement_group"] is None and kwargs["host_agents"] is None
