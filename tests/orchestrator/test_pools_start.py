"""The order in which a run asks Ray for its actors (`pools._start_actors`), with Ray's calls recorded instead of made:
what reaches the start-up's critical path before the engines' actors are even asked for."""

import dataclasses
from types import SimpleNamespace

import pytest
import ray

from moe_grpo.config import from_hydra, load_model_spec
from moe_grpo.orchestrator import pools


class _Recorded:
    """Stands in for a remote function, an actor class or an actor method: `.options(...)` and `.remote(...)` note
    what was asked, in order, in `calls`."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def options(self, **_):
        return self

    def remote(self, *args, **_):
        self.calls.append(self.name)
        return _Recorded(self.name, self.calls)  # an actor's handle, or the reference of a call's result

    def __getattr__(self, method):
        return _Recorded(f"{self.name}.{method}", self.calls)


@pytest.fixture
def recorded_ray(monkeypatch):
    calls = []

    def remote(fn=None, **_):
        if fn is None:
            return lambda f: _Recorded(f.__name__, calls)
        return _Recorded(fn.__name__, calls)

    def get(refs, timeout=None):
        if refs.name == "LearnerWorker.info":  # a rank's coordinates (`LearnerGroup.start` waits for each)
            return {"dp": 0, "dp_size": 1}
        calls.append(f"get {refs.name}")
        if refs.name == "_rendezvous":
            return ("10.0.0.1", 1234)
        return 4242  # an engine's start: its vLLM pid

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
    return calls


def _nodes(monkeypatch, n):
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "NodeID": f"n{i}"} for i in range(n)])


def test_on_one_host_the_engines_are_asked_for_first_and_no_task_comes_before_the_actors(recorded_ray, monkeypatch):
    """A one-host run picked learner rank 0's rendezvous in a Ray task before asking for any actor: that task needs a
    worker process of the run's job first (1.5-2.5 s on 2 cores, on the start-up's critical path, since the engine
    actor's vLLM import is the last thing the learner ranks wait for). Now the engines are asked for first and the
    driver picks the loopback port itself."""
    _nodes(monkeypatch, 1)
    run = from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "cluster": {"num_engines": 2}})
    out = pools._start_actors(run, "/tmp/run", SimpleNamespace(), SimpleNamespace(), [], lambda learners: "/tmp/m",
                              None)
    calls = recorded_ray
    assert calls[:2] == ["EngineWorker", "EngineWorker"], calls
    assert "_rendezvous" not in calls, "no Ray task on one host"
    assert out.engine_pids == [4242, 4242] and [name for name, _ in out.engines] == ["engine0", "engine1"]


def test_on_several_hosts_rank_0s_node_picks_the_rendezvous_after_the_engines_are_asked_for(recorded_ray,
                                                                                             monkeypatch):
    """On several hosts rank 0's address is its node's, found by a task on that node; the engines' actors are
    asked for before it, so their start-up runs while it does."""
    _nodes(monkeypatch, 2)
    run = from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "cluster": {"num_engines": 1}})
    pools._start_actors(run, "/tmp/run", SimpleNamespace(), SimpleNamespace(), [], lambda learners: "/tmp/m", None)
    calls = recorded_ray
    assert calls[0] == "EngineWorker" and calls.index("_rendezvous") < calls.index("LearnerWorker"), calls


def test_a_failing_relay_cleanup_does_not_keep_the_pools_from_being_released(monkeypatch, caplog):
    """The relay agents' cleanup runs inside `stop_pools`, between the engines' shutdown and Ray's: when it fails (a
    cluster whose processes a SIGTERM to all of them ended), Ray must still be left and the failure said, not raised
    past the release."""
    left = []
    monkeypatch.setattr(ray, "shutdown", lambda: left.append("ray.shutdown"))

    def cleanup():
        raise RuntimeError("GCS unreachable")

    with caplog.at_level("WARNING", logger="moe_grpo"):
        pools.stop_pools(None, [], after_engines=cleanup)
    assert left == ["ray.shutdown"]
    assert "the relay agents' cleanup failed (RuntimeError: GCS unreachable)" in caplog.text


def test_ray_shuts_down_with_no_garbage_left_to_free_and_the_collector_held_meanwhile(monkeypatch):
    """A cycle holding a Ray object, freed by the garbage collector in another thread while Ray shuts down (the
    run record's PNG is drawn beside the cleanup), reaches Ray's core worker mid-shutdown, and Ray ends the process
    with exit status 1 and nothing printed: a whole test session ended so (2026-11-28). The race itself is not
    reproduced here; what `shutdown_ray` does about it is: the cycles are freed on this thread first, and the
    collector cannot run in any thread until Ray is down. (Ray's shutdown recorded, not made.)"""
    import gc
    import weakref

    class Held:
        pass

    cycle = Held()
    cycle.me = cycle
    freed = weakref.ref(cycle)
    del cycle
    seen = {}

    def shutdown():
        seen["collector on"], seen["cycle freed"] = gc.isenabled(), freed() is None

    monkeypatch.setattr(ray, "shutdown", shutdown)
    enabled = gc.isenabled()
    gc.enable()
    try:
        pools.shutdown_ray()
        assert seen == {"collector on": False, "cycle freed": True}
        assert gc.isenabled(), "the collector is back once Ray is down"
    finally:
        if not enabled:
            gc.disable()
