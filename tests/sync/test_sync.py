"""Weight sync from every learner layout into the running vLLM engine."""

import numpy as np
import pytest
import torch

import layout_scenarios as S
from moe_grpo.learner.spawn import run_distributed
from moe_grpo.models.hf_names import param_mappings, to_hf, to_megatron

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def synced(engine_and_learner, tmp_path_factory):
    """The engine's starting weights as a Megatron checkpoint, and a transport that knows them."""
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.transport import SharedMemoryTransport

    engine, learner = engine_and_learner
    ckpt = str(tmp_path_factory.mktemp("sync") / "start")
    learner.save_checkpoint(ckpt)
    transport = SharedMemoryTransport(engine)
    transport.adopt(hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())))
    engine.load_weights(transport.current, engine.policy_version)
    yield engine, transport, ckpt
    # Hand the shared engine back on the in-process learner's weights for the other test modules.
    engine.load_weights(hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())),
                        engine.policy_version + 1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 2)], ids=["1proc", "EP=2", "TP=2", "PP=2"])
def test_engine_matches_the_learner_after_a_sync_from_each_layout(synced, layout):
    from moe_grpo.sync.reshard import iter_hf_buckets, release

    engine, transport, ckpt = synced
    tp, ep, pp = layout
    version = engine.policy_version + 1
    stage_dir, learner_lp = run_distributed(S.train_and_stage, tp * ep * pp, tp, ep, pp, ckpt, version)[0]
    try:
        report = transport.push(iter_hf_buckets(stage_dir, max_bucket_bytes=1 << 20), version)
    finally:
        release(stage_dir)
    assert engine.policy_version == version and report["sync/bytes"] > 0
    seqs = S.make_sequences(engine.spec, n=4, with_routing=False)
    got = engine.score([s.tokens for s in seqs])
    diff = max(float(np.abs(got[i] - learner_lp[i]).max()) for i in range(len(seqs)))
    # fp32 on both sides; differences come from summation order in different kernels.
    assert diff < 1e-4, f"{layout}: max |logprob(vLLM) - logprob(learner)| = {diff}"


def test_bad_tensors_are_refused_and_the_engine_keeps_its_version(synced):
    from moe_grpo.sync.transport import SyncError

    engine, transport, _ = synced
    seqs = S.make_sequences(engine.spec, n=2, with_routing=False)
    before, version = engine.score([s.tokens for s in seqs]), engine.policy_version
    bad_shape = dict(transport.current)
    bad_shape["model.norm.weight"] = torch.zeros(7)
    with pytest.raises(SyncError, match=r"model.norm.weight has shape \[7\], expected \[128\]"):
        transport.push([bad_shape], version + 1)
    bad_name = dict(transport.current)
    bad_name["model.layers.9.mlp.gate.weight"] = torch.zeros(8, 128)
    with pytest.raises(SyncError, match="not parameters of"):
        transport.push([bad_name], version + 1)
    assert engine.policy_version == version
    after = engine.score([s.tokens for s in seqs])
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_engine_failure_mid_sync_rolls_back_to_the_previous_version(synced, monkeypatch):
    from moe_grpo.rollout.vllm_engine import EngineError
    from moe_grpo.sync.transport import SyncError

    engine, transport, _ = synced
    seqs = S.make_sequences(engine.spec, n=2, with_routing=False)
    before, version = engine.score([s.tokens for s in seqs]), engine.policy_version
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in transport.current.items()}
    real_rpc = engine.llm.collective_rpc
    calls = {"n": 0}

    def dying_rpc(method, *a, **k):
        if method == "moe_grpo_reload_from_file":
            calls["n"] += 1
            if calls["n"] == 3:  # the engine dies after two layers were applied
                raise RuntimeError("engine process died")
        return real_rpc(method, *a, **k)

    monkeypatch.setattr(engine.llm, "collective_rpc", dying_rpc)
    with pytest.raises(SyncError, match="rolled back"):
        transport.push([new], version + 1)
    monkeypatch.undo()
    assert engine.policy_version == version
    after = engine.score([s.tokens for s in seqs])
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, after)) < 1e-6


def test_megatron_hf_megatron_is_bit_exact_for_every_parameter(engine_and_learner):
    _, learner = engine_and_learner
    state = dict(learner.module.state_dict())
    for m in param_mappings(learner.spec):
        back = to_megatron(m, to_hf(m, state[m.megatron], learner.spec), learner.spec)
        assert torch.equal(back, state[m.megatron]), m.megatron
