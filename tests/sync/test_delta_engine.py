"""A vLLM engine served delta versions (sync.delta) holds what a full load of the same version gives it, and
reloads only the tensors that changed."""

import numpy as np
import pytest

import layout_scenarios as S
from publishing import serve_published
from moe_grpo.learner.spawn import run_distributed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def publish_sparse_versions(root: str, first: int, versions: int) -> list[dict]:
    """One learner rank publishes version `first` whole, then versions that each change a few weights in place (one
    expert's first elements, a few embedding rows, one attention matrix): what sparse optimizer steps look like."""
    import torch

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    learner = MegatronLearner(S.tiny_spec(), config=LearnerConfig(seed=11))
    sync = WeightSync(learner, SharedMemoryTransport(root, slots=versions + 1), max_bucket_bytes=1 << 16,
                      delta=DeltaOptions())
    params = dict(learner.module.named_parameters())
    expert = next(n for n in params if "experts" in n)
    attention = next(n for n in params if "linear_qkv" in n)
    edits = [(expert, slice(0, 100)), ("embedding.word_embeddings.weight", slice(0, 40)), (attention, slice(0, 64))]
    reports = [sync.sync(first).wait().metrics()]
    with torch.no_grad():
        for i, version in enumerate(range(first + 1, first + versions)):
            name, where = edits[i % len(edits)]
            params[name].view(-1)[where] += 0.05
            reports.append(sync.sync(version).wait().metrics())
    return reports


def test_an_engine_served_delta_versions_scores_exactly_as_after_a_full_load(engine_and_learner, tmp_path):
    """Would have caught: an engine skipping a tensor a version changed (a chain of changes missed a link), a
    reload of a stale buffer, or an engine that reloads every tensor of a delta version anyway."""
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.deliver import apply_version, changed_tensors
    from moe_grpo.sync.transport import SharedMemoryTransport

    engine, learner = engine_and_learner
    root, versions, first = str(tmp_path / "shm"), 4, engine.policy_version + 1
    reports = run_distributed(publish_sparse_versions, 1, root, first, versions)[0]
    assert [r["sync/delta"] for r in reports] == [0.0] + [1.0] * (versions - 1)
    transport = SharedMemoryTransport(root)
    last = first + versions - 1
    sequences = [s.tokens for s in S.make_sequences(engine.spec, n=4, with_routing=False)]
    try:
        reloaded = []
        for version in range(first, last + 1):
            only = changed_tensors(engine, transport, version, transport.wait_complete(version, 5)[1])
            assert (only is None) == (version == first)  # the first is whole; then the engine serves a slot
            reloaded.append(len(only) if only is not None else None)
            apply_version(engine, transport, version)
        total = len(transport.wait_complete(last, 5)[1].shapes())
        print(f"tensors reloaded per delta version: {reloaded[1:]} of {total}")
        assert all(0 < n < total / 2 for n in reloaded[1:]), (reloaded, total)
        delta_scores = engine.score(sequences)
        slot, plan = transport.wait_complete(last, 5)
        engine.load_published(slot, plan, last, sources=transport.bucket_sources(slot, plan))  # every tensor again
        full_scores = engine.score(sequences)
        for got, want in zip(delta_scores, full_scores):
            assert np.array_equal(got, want)
    finally:
        serve_published(engine, hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())),
                        engine.policy_version + 1)
        transport.unpin(engine.engine_id)
        transport.close()
