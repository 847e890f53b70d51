"""LoRA versions applied by merging in a real vLLM engine (sync.lora_apply=merge; rollout/lora_merge.py).

One engine on the default tiny model (deepseek_moe, 4 layers) starts from a base version's start directory
(frozen base + the version's PEFT adapter, non-zero A and B) and takes adapter-only versions from a one-rank
LoRA learner's WeightSync through shared memory."""

import pytest
import torch

import layout_scenarios as S
import lora_scenarios as L
from moe_grpo.rollout.lora_merge import MergedWeights

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-4
"""Largest |engine - learner| log-prob of a token, fp32 both sides."""


def test_merging_never_accumulates_and_names_a_bad_adapter():
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 5, generator=gen)
    merged = MergedWeights(["model.layers.0.mlp.down_proj.weight"])
    merged.keep({"model.layers.0.mlp.down_proj.weight": w0, "model.layers.0.mlp.up_proj.weight": w0})
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_{}.weight"
    adapter = {key.format("A"): torch.randn(2, 5, generator=gen), key.format("B"): torch.randn(6, 2, generator=gen)}
    first = next(merged.merged(adapter, 0.5))
    second = next(merged.merged(adapter, 0.5))
    want = w0 + 0.5 * adapter[key.format("B")] @ adapter[key.format("A")]
    assert torch.equal(first["model.layers.0.mlp.down_proj.weight"], second["model.layers.0.mlp.down_proj.weight"])
    assert torch.allclose(first["model.layers.0.mlp.down_proj.weight"], want, atol=1e-6)
    assert set(first) == {"model.layers.0.mlp.down_proj.weight"} and merged.nbytes == w0.numel() * 4
    with pytest.raises(ValueError, match="missing"):
        next(merged.merged({}, 0.5))


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    """(engine, learner, WeightSync, transport, sequences, base log-probs) on one random non-zero adapter."""
    # vLLM's presence is checked by tests/conftest.py for every `vllm`-marked test before its fixtures start
    # (importing `conftest` here could find tests/faults/conftest.py first, as it did in a whole-suite run).
    from moe_grpo.rollout.vllm_engine import VllmEngine

    root = tmp_path_factory.mktemp("lora_merge")
    spec, lora = S.tiny_spec(), L.lora_config()
    learner, sync, transport, seqs, base_lp, start = L.lora_start(spec, lora, root)
    engine = VllmEngine(start, spec, max_model_len=256, max_num_seqs=16, lora=lora)
    yield engine, learner, sync, transport, seqs, base_lp
    engine.shutdown()
    transport.close()


_gap = L.logprob_gap


def _scores(engine, seqs):
    return engine.score([s.tokens for s in seqs])


def test_engine_serves_the_learners_lora_model_through_adapter_only_versions(lora_engine):
    from moe_grpo.sync.deliver import apply_version

    engine, learner, sync, transport, seqs, base_lp = lora_engine
    assert engine.lora_base_bytes > 0
    start = _scores(engine, seqs)
    assert _gap(start, learner.logprobs(seqs)) < TOLERANCE, "the start directory's adapter was applied"
    assert _gap(start, base_lp) > 1e-2, "the adapter changes the model (else this test could not fail)"
    for version in (1, 2):
        learner.train_step(seqs, replay=False)
        report = sync.sync(version).wait()
        seconds = apply_version(engine, transport, version)
        got, want = _scores(engine, seqs), learner.logprobs(seqs)
        print(f"version {version}: {report.version_bytes} B sent (base version {sync.plan.total_bytes} B), learner "
              f"write {report.seconds * 1e3:.1f} ms, engine apply {seconds:.2f} s, gap {_gap(got, want):.2e}")
        assert _gap(got, want) < TOLERANCE
        assert report.version_bytes == sync.adapter_plan.total_bytes < sync.plan.total_bytes / 10
    assert engine.policy_version == 2


def test_the_same_adapter_twice_serves_the_same_weights_and_a_failed_merge_rolls_back(lora_engine, monkeypatch):
    """W = W0 + s B A from the copy of W0: a version with the same adapters as the one served changes nothing (an
    in-place W += s B A would add it twice). A merge that fails part-way leaves the engine on its version."""
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    engine, learner, sync, transport, seqs, _ = lora_engine
    version = engine.policy_version
    sync.sync(version + 1).wait()  # no step in between: the same adapters
    before = _scores(engine, seqs)
    apply_version(engine, transport, version + 1)
    assert _gap(_scores(engine, seqs), before) == 0.0
    learner.train_step(seqs, replay=False)
    sync.sync(version + 2).wait()
    real = engine._collective_rpc

    async def merge_then_fail(method, args=()):
        out = await real(method, args)
        if method == "moe_grpo_merge_adapter" and not failed:
            failed.append(True)
            raise RuntimeError("injected failure after the merge")
        return out

    failed: list = []
    monkeypatch.setattr(engine, "_collective_rpc", merge_then_fail)
    with pytest.raises(SyncError, match=f"rolled back to version {version + 1}"):
        apply_version(engine, transport, version + 2)
    assert failed and engine.policy_version == version + 1 and engine.broken is None
    assert _gap(_scores(engine, seqs), before) == 0.0
