"""Engines that die between two delta versions (sync.delta). An engine whose vLLM engine core is SIGKILLed between two delta versions (sync.delta) is restarted as the engine
pool restarts it (`VllmEngine.restart`, what `EngineWorker.restart` runs) and then catches up on a delta version
(`apply_version`, what the pool's catch-up runs): it serves that version bit for bit as a full load of it.

One engine of its own (not the session's: its processes are killed), on a random model directory, so a restart
that fell back to the model directory's weights, or a chain of changes applied on top of them, shows in the
digests. Engine starts: two (the engine's and its restart's). And the engines that must not take a chain of
changes at all: one replaced by a new actor (it starts from the model directory) or one whose restore failed.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from test_delta_engine import publish_sparse_versions

from moe_grpo.learner.spawn import run_distributed



def test_an_engine_that_no_longer_holds_a_published_version_reloads_every_tensor(tmp_path):
    """Would have caught: a replacement engine actor (the pool's answer to a dead actor: it starts from the model
    directory) or an engine whose restore failed after a restart (`broken`) taking only the changes since the
    version it claims, on top of weights that are not that version."""
    from types import SimpleNamespace

    import layout_scenarios as S
    from moe_grpo.sync.deliver import changed_tensors
    from moe_grpo.sync.plan import plan_buckets
    from moe_grpo.sync.transport import SharedMemoryTransport

    transport = SharedMemoryTransport(str(tmp_path / "sync"), slots=4)
    plan = plan_buckets(S.tiny_spec(), torch.float32, 1 << 16)
    names = sorted(plan.shapes())
    slots = {}
    for version, base, changed in [(1, None, None), (2, 1, [names[0]]), (3, 2, [names[-1]])]:
        slots[version] = transport.claim(version, plan, 0, 1)
        transport.mark_done(slots[version], version, 0, {b.index: sum(e.numel for e in b.entries)
                                                          for b in plan.buckets})
        transport.log_changes(version, 0, base, changed)
    on_slot = SimpleNamespace(policy_version=2, weight_source=(slots[2], plan, None), broken=None)
    assert changed_tensors(on_slot, transport, 3, plan) == {names[-1]}  # holds version 2 whole: the chain
    replaced = SimpleNamespace(policy_version=2, weight_source="model_dir", broken=None)
    assert changed_tensors(replaced, transport, 3, plan) is None
    new_actor = SimpleNamespace(policy_version=0, weight_source="model_dir", broken=None)
    assert changed_tensors(new_actor, transport, 3, plan) is None
    restore_failed = SimpleNamespace(policy_version=2, weight_source=(slots[2], plan, None),
                                     broken="restarted but could not reload version 2")
    assert changed_tensors(restore_failed, transport, 3, plan) is None
    transport.close()


def _random_model(spec, directory):
    """A random checkpoint of `spec` (norms 1, the rest N(0, 0.05)) written as a vLLM model directory: weights
    no version published here holds."""
    from moe_grpo.rollout.export import export_model_dir
    from moe_grpo.sync.plan import plan_buckets

    g = torch.Generator().manual_seed(0)
    plan = plan_buckets(spec, torch.float32, 1 << 16)
    state = {e.name: (torch.ones(e.shape) if "norm" in e.name else 0.05 * torch.randn(e.shape, generator=g))
             for b in plan.buckets for e in b.entries}
    return export_model_dir(spec, state, directory)


def _kill_engine_core(engine) -> None:
    """SIGKILL vLLM's engine core (the parent of the worker `worker_pid` names) and wait until the engine is dead."""
    import psutil

    core = psutil.Process(engine.worker_pid).parent()
    assert core is not None and core.pid != os.getpid(), "expected the worker to run under vLLM's engine core"
    os.kill(core.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.alive():
        assert time.monotonic() < deadline, f"engine still alive 30 s after SIGKILL of its engine core {core.pid}"
        time.sleep(0.05)


@pytest.mark.vllm
@pytest.mark.slow
def test_an_engine_killed_between_delta_versions_is_restarted_and_caught_up_exactly(tmp_path):
    """Would have caught: a restarted engine that reloads the model directory (or part of its version) and then
    takes only a delta's changed tensors on top of it; a catch-up that takes a chain of changes from a version
    the engine no longer holds; a restart that loses the slot its version is in (unpinned, recycled)."""
    import layout_scenarios as S
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.deliver import apply_version, changed_tensors, reload_groups
    from moe_grpo.sync.transport import SharedMemoryTransport

    spec = S.tiny_spec()
    engine = VllmEngine(_random_model(spec, tmp_path / "model"), spec, max_model_len=256, max_num_seqs=8)
    at_model_dir = engine.weight_digests()
    root, first, versions = str(tmp_path / "shm"), 1, 5
    reports = run_distributed(publish_sparse_versions, 1, root, first, versions)[0]
    assert [r["sync/delta"] for r in reports] == [0.0] + [1.0] * (versions - 1)
    transport = SharedMemoryTransport(root)
    served, target = first + 1, first + 3  # killed while serving a delta version; two delta versions later
    try:
        for version in range(first, served + 1):
            apply_version(engine, transport, version)
        before_kill = engine.weight_digests()
        assert before_kill != at_model_dir

        _kill_engine_core(engine)
        t0 = time.perf_counter()
        out = engine.restart(timeout_s=120)
        print(f"restart took {time.perf_counter() - t0:.1f} s")
        assert out["policy_version"] == served and out["pid"] != out["old_pid"] and engine.alive()
        assert engine.weight_digests() == before_kill, \
            "the restarted engine must serve the version it served, not the model directory's weights"

        plan = transport.wait_complete(target, 5)[1]
        only = changed_tensors(engine, transport, target, plan)
        chain = transport.changed_since(served, target)
        assert only is not None and chain, "the restarted engine serves a published slot: it takes the chain"
        assert only == reload_groups(chain, plan.shapes()) and len(only) < len(plan.shapes()) / 2
        apply_version(engine, transport, target)
        assert engine.policy_version == target
        caught_up = engine.weight_digests()
        assert caught_up != before_kill

        slot, plan = transport.wait_complete(target, 5)
        engine.load_published(slot, plan, target, sources=transport.bucket_sources(slot, plan))  # every tensor
        full = engine.weight_digests()
        differ = sorted(n for n in full if full[n] != caught_up.get(n))
        assert not differ, f"after the restart and the chain, tensors differ from a full load of {target}: {differ}"
    finally:
        transport.unpin(engine.engine_id)
        transport.close()
        engine.shutdown()
