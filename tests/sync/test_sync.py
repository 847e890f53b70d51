"""Weight sync from every learner layout into the running vLLM engine, and what happens when a side dies."""

import os
import signal
import sys

import numpy as np
import pytest
import torch

import layout_scenarios as S
from publishing import publish_version, serve_published
from moe_grpo.learner.spawn import DistributedRunError, run_distributed
from moe_grpo.models.hf_names import param_mappings, to_hf, to_megatron

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY_PROMPTS = [[1, 5, 9, 33, 70], [1, 200, 3, 3, 17, 90, 4], [1, 44]]


def _greedy(engine):
    from moe_grpo.rollout.types import SamplingSettings

    out = engine.generate(GREEDY_PROMPTS, SamplingSettings(n=1, temperature=0.0, max_tokens=16))
    return [c[0].token_ids.tolist() for c in out]


def _scores(engine):
    return engine.score([s.tokens for s in S.make_sequences(engine.spec, n=4, with_routing=False)])


@pytest.fixture(scope="module")
def synced(engine_and_learner, tmp_path_factory):
    """The engine's starting weights as a Megatron checkpoint (and as HF tensors), a transport, and the engine's
    greedy completions after a sync from one process (the reference for the other layouts)."""
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport

    engine, learner = engine_and_learner
    root = tmp_path_factory.mktemp("sync")
    ckpt = str(root / "start")
    learner.save_checkpoint(ckpt)
    start = {k: v.clone() for k, v in hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())).items()}
    transport = SharedMemoryTransport(str(root / "shm"))
    version = engine.policy_version + 1
    learner_lp = run_distributed(S.train_and_sync, 1, 1, 1, 1, ckpt, version, str(transport.root))[0]
    apply_version(engine, transport, version)
    reference = {"greedy": _greedy(engine), "learner_lp": learner_lp, "start": start}
    yield engine, transport, ckpt, reference
    # Hand the shared engine back on the in-process learner's weights for the other test modules.
    serve_published(engine, hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())),
                    engine.policy_version + 1)
    transport.unpin(engine.engine_id)
    transport.close()


def _max_gap(got, want) -> float:
    """max |logprob| difference over every token of every sequence."""
    return max(float(np.abs(got[i] - want[i]).max()) for i in range(len(got)))


# Before a sync, the engine's log-probs must be at least this far from the learner's, so that a sync that
# applied nothing, or left any tensor behind, cannot pass the 1e-4 match afterwards.
NOT_YET_SYNCED = 0.1


def _perturbed(start, seed):
    """Every tensor of `start` moved by noise of 0.3x its mean magnitude."""
    g = torch.Generator().manual_seed(seed)
    return {k: t + 0.3 * t.abs().mean().clamp_min(1e-3) * torch.randn(t.shape, generator=g, dtype=t.dtype)
            for k, t in start.items()}


def _serve_other_weights(engine, transport, start, seed):
    """Make the engine serve weights the learner does not hold; returns the version the learner publishes next.

    The engine applies a perturbed copy of the start weights (every tensor changed) through the transport.
    A second perturbed copy is published and not applied: it fills the transport's other buffer, the one the
    learner's sync writes next, so a shard the sync leaves unwritten shows up as wrong weights instead of the
    right ones an earlier sync of the same step left there."""
    from moe_grpo.sync.deliver import apply_version

    version = engine.policy_version + 1
    publish_version(transport, version, engine.spec, tensors=_perturbed(start, seed))
    apply_version(engine, transport, version)
    assert engine.policy_version == version
    publish_version(transport, version + 1, engine.spec, tensors=_perturbed(start, seed + 1000))
    return version + 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2)], ids=["1proc", "EP=2", "TP=2", "PP=2"])
def test_engine_matches_the_learner_after_a_sync_from_each_layout(synced, layout):
    from moe_grpo.sync.deliver import apply_version

    engine, transport, ckpt, reference = synced
    tp, ep, pp = layout
    # The engine first serves weights the learner does not hold (a seed per layout), and the buffer the learner
    # writes holds other weights again: the sync must carry every tensor from this layout's shards to match.
    version = _serve_other_weights(engine, transport, reference["start"], seed=tp + 2 * ep + 4 * pp)
    learner_lp = run_distributed(S.train_and_sync, tp * ep * pp, tp, ep, pp, ckpt, version, str(transport.root))[0]
    before = _max_gap(_scores(engine), learner_lp)
    assert before > NOT_YET_SYNCED, f"{layout}: the engine already matched the learner before the sync ({before})"
    apply_version(engine, transport, version)
    assert engine.policy_version == version
    diff = _max_gap(_scores(engine), learner_lp)
    print(f"sync from {layout}: max |logprob(vLLM) - logprob(learner)| = {before:.2e} before, {diff:.2e} after")
    # fp32 on both sides; differences come from summation order in different kernels (~1e-6 measured).
    assert diff < 1e-4, f"{layout}: max |logprob(vLLM) - logprob(learner)| = {diff}"
    # Every layout took the same step from the same weights: the engine completes greedily the same way.
    assert _greedy(engine) == reference["greedy"]


@pytest.mark.parametrize("change,message", [
    (dict(moe_ffn_hidden_size=32), r"model.layers.1.mlp.experts.0.gate_proj.weight has shape \[32, 128\], expected \[64, 128\]"),
    (dict(num_layers=5), r"\['model.layers.4.*are not parameters of deepseek_moe"),
], ids=["wrong-shape", "wrong-name"])
def test_wrong_tensors_are_refused_before_anything_is_applied(synced, change, message):
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    engine, transport, _, _ = synced
    before, version = _scores(engine), engine.policy_version
    publish_version(transport, version + 1, engine.spec.replace(**change))
    with pytest.raises(SyncError, match=message):
        apply_version(engine, transport, version + 1)
    assert engine.policy_version == version
    assert all(np.array_equal(a, b) for a, b in zip(before, _scores(engine)))


def test_learner_killed_mid_sync_leaves_the_engine_on_its_version(synced):
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    engine, transport, _, _ = synced
    before, version = _scores(engine), engine.policy_version
    with pytest.raises(DistributedRunError, match="died"):
        run_distributed(S.die_while_publishing, 1, str(transport.root), version + 1, 3)
    with pytest.raises(SyncError, match=rf"version {version + 1} incomplete after 2 s: learner rank\(s\) \[0\] did not finish"):
        apply_version(engine, transport, version + 1, timeout_s=2)
    assert engine.policy_version == version
    assert all(np.array_equal(a, b) for a, b in zip(before, _scores(engine)))


def test_engine_failure_part_way_rolls_back_to_the_previous_version(synced):
    """A bucket file that is cut short fails the engine's load after earlier buckets were applied."""
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    engine, transport, _, _ = synced
    before, version = _scores(engine), engine.policy_version
    slot, plan = publish_version(transport, version + 1, engine.spec, fill=0.01)
    os.truncate(os.path.join(slot, "b00003.bin"), 100)
    with pytest.raises(SyncError, match=rf"failed part-way .*b00003.bin holds 100 bytes.*rolled back to version {version}"):
        apply_version(engine, transport, version + 1)
    assert engine.policy_version == version and engine.broken is None
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, _scores(engine))) < 1e-6


def test_megatron_hf_megatron_is_bit_exact_for_every_parameter(engine_and_learner):
    _, learner = engine_and_learner
    state = dict(learner.module.state_dict())
    for m in param_mappings(learner.spec):
        back = to_megatron(m, to_hf(m, state[m.megatron], learner.spec), learner.spec)
        assert torch.equal(back, state[m.megatron]), m.megatron


@pytest.mark.multiprocess
def test_background_sync_publishes_the_weights_from_before_the_next_step(tmp_path):
    from moe_grpo.sync.transport import SharedMemoryTransport

    out = run_distributed(S.background_sync_then_step, 1, str(tmp_path))[0]
    assert out["metrics"]["sync/bytes"] > 4e6 and out["metrics"]["sync/seconds"] > 0
    assert out["in_flight"] and len(out["changed"]) > 50  # the step really changed the weights while the sync was in flight
    got = SharedMemoryTransport(str(tmp_path)).read_version(1)
    for name, t in out["before"].items():
        assert torch.equal(got[name], t), name
    got = SharedMemoryTransport(str(tmp_path)).read_version(2)
    for name, t in out["after"].items():
        assert torch.equal(got[name], t), name


def test_engine_killed_mid_sync_is_reported_skipped_and_restarts_on_its_previous_version(synced):
    """A second engine's process is SIGKILLed while it loads a version. The load names it and does not hang,
    the other engine takes the version, and the restarted engine serves the version it had before."""
    from moe_grpo.rollout.vllm_engine import EngineError, VllmEngine
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    engine, transport, _, _ = synced
    second = VllmEngine(engine.model_dir, engine.spec, max_model_len=128, max_num_seqs=4)
    try:
        v1 = engine.policy_version + 1
        publish_version(transport, v1, engine.spec, fill=0.02)
        apply_version(second, transport, v1)
        served = _scores(second)
        real_rpc, calls = second._collective_rpc, {"n": 0}

        async def kill_on_second_bucket(method, args=()):
            if method == "moe_grpo_reload_bucket":
                calls["n"] += 1
                if calls["n"] == 2:
                    os.kill(second.worker_pid, signal.SIGKILL)
            return await real_rpc(method, args)

        second._collective_rpc = kill_on_second_bucket
        v2 = v1 + 1
        publish_version(transport, v2, engine.spec, fill=0.03)
        apply_version(engine, transport, v2)
        with pytest.raises(SyncError, match=f"engine {second.engine_id}"):
            apply_version(second, transport, v2, timeout_s=60)
        assert engine.policy_version == v2, "the other engine took the version"
        assert second.policy_version == v1 and second.broken
        with pytest.raises(EngineError, match="refuses"):
            _scores(second)
        second.restart()
        assert second.policy_version == v1
        assert all(np.array_equal(a, b) for a, b in zip(served, _scores(second)))
        _mid_rollout_hang_and_death_are_named(second)
    finally:
        second.shutdown()
        transport.unpin(second.engine_id)


def _mid_rollout_hang_and_death_are_named(engine):
    """An engine whose worker stops mid-rollout is named within its timeout; one whose worker dies, at once."""
    import time

    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import EngineError

    long = SamplingSettings(n=1, temperature=1.0, max_tokens=100)
    prompt = [[5, 6, 7]]
    engine.request_timeout_s = 3.0
    future = engine.submit(prompt[0], long)
    os.kill(engine.worker_pid, signal.SIGSTOP)  # hung, not dead: only the clock can tell
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError, match=rf"engine {engine.engine_id}: .*did not finish within 3 s"):
            engine.generate(prompt, long)
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(engine.worker_pid, signal.SIGCONT)
    future.cancel()
    worker = engine.worker_pid
    os.kill(worker, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=rf"engine {engine.engine_id}: .*(died|dead|failed)"):
        engine.generate(prompt, long)
    assert time.monotonic() - t0 < 5


@pytest.mark.multiprocess
def test_engine_on_another_host_matches_the_learner_through_the_relay(synced, tmp_path):
    """Learner -> its host's shared memory -> gloo relay -> the engine host's shared memory -> engine."""
    import multiprocessing as mp
    import secrets

    from moe_grpo.learner.spawn import free_port
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.relay import RelayGroup
    from moe_grpo.sync.transport import SharedMemoryTransport

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    from whole_relay import RelaySender

    engine, transport, ckpt, reference = synced
    version = _serve_other_weights(engine, transport, reference["start"], seed=99)
    learner_lp = run_distributed(S.train_and_sync, 2, 1, 2, 1, ckpt, version, str(transport.root))[0]
    assert _max_gap(_scores(engine), learner_lp) > NOT_YET_SYNCED
    port, engine_host, secret = free_port(), str(tmp_path / "engine_host"), secrets.token_hex(32)
    receiver = mp.get_context("spawn").Process(target=S.relay_receive,
                                               args=("127.0.0.1", port, 2, secret, 1, engine_host))
    receiver.start()
    sender = RelaySender(transport, RelayGroup("127.0.0.1", port, 2, secret, timeout_s=60))
    sender.send(version)
    sender.close()
    receiver.join(60)
    remote = SharedMemoryTransport(engine_host)
    try:
        apply_version(engine, remote, version)
        assert engine.policy_version == version and _max_gap(_scores(engine), learner_lp) < 1e-4
    finally:
        # serve the same version from the fixture's transport, which outlives this test's directory
        slot, plan = transport.wait_complete(version)
        transport.pin(engine.engine_id, {slot: version})
        engine.load_published(slot, plan, version)
        remote.unpin(engine.engine_id)
