"""Every worker of an engine at tensor parallelism 2 loads every published version once (issue 32, Show: "every
version loaded by both workers once").

A TP=2 `VllmEngine` on test_families' DeepSeek-V3 tiny checkpoint (MLA, fp32) is handed three published versions
through shared memory, one after the other, as a run's engine is. Each version's reload calls are recorded as the
engine's workers answered them: each bucket of the version reloaded once, answered by both workers, each with that
bucket's tensor count, so each worker took each tensor of the version exactly once (none would leave its slices of
that tensor on the old version; twice is a reload repeated). Each worker's own digests (`weight_digests`,
'tp<rank>/<name>') show the load landed in both: after each version both changed the same weights (experts, the
MLA projections vLLM packs for its CPU kernels, embeddings, norms, head) to bits neither held before, and the
tokens the engine then samples are stamped with that version.

What it would catch: a version served while one worker kept the old weights (its digests unchanged), a bucket
skipped or loaded twice by the engine's reload plan, or a worker answering for tensors it did not load.
"""

from __future__ import annotations

import pytest
import torch

from publishing import publish_version

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VERSIONS = (1, 2, 3)


def _version_tensors(hf_dir: str, spec, seed: int) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus seeded noise: every tensor differs from the checkpoint and other versions."""
    from moe_grpo.checkpoint.hf_io import SafetensorsDir
    from moe_grpo.models.hf_names import hf_names

    files, gen = SafetensorsDir(hf_dir), torch.Generator().manual_seed(seed)
    return {name: files.get(name).float() + 0.02 * torch.randn(files.get(name).shape, generator=gen)
            for name in hf_names(spec)}


def _by_rank(digests: dict[str, str]) -> dict[str, dict[str, str]]:
    """'tp<rank>/<name>' -> {rank: {name: digest}}."""
    out: dict[str, dict[str, str]] = {}
    for key, digest in digests.items():
        rank, name = key.split("/", 1)
        out.setdefault(rank, {})[name] = digest
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """The TP=2 engine's reload calls and per-worker digests for each of `VERSIONS`, loaded in turn."""
    from moe_grpo.models.hf_config import read_hf_config, spec_from_hf_config
    from moe_grpo.models.hf_names import hf_names
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport
    from test_families import write_checkpoint

    root = tmp_path_factory.mktemp("tp_loads")
    hf = str(root / "hf")
    write_checkpoint("deepseek_v3", hf)
    spec = spec_from_hf_config(read_hf_config(hf), name="hf")  # the name the published versions carry
    transport = SharedMemoryTransport(str(root / "shm"))
    engine = VllmEngine(hf, spec, max_model_len=256, max_num_seqs=8, tensor_parallel=2, name="tp2_loads")
    try:
        real, calls = engine._collective_rpc, []

        async def recorded(method, args=()):
            answers = await real(method, args)
            calls.append((method, list(answers or [])))
            return answers

        engine._collective_rpc = recorded
        out = {"start": engine.weight_digests(), "versions": {}}
        for version in VERSIONS:
            _, plan = publish_version(transport, version, spec, tensors=_version_tensors(hf, spec, version))
            del calls[:]
            apply_version(engine, transport, version)
            reloads = [answers for method, answers in calls if method == "moe_grpo_reload_bucket"]
            sampled = engine.generate([[5, 9, 17, 33]], SamplingSettings(n=1, max_tokens=4, temperature=0.0))
            out["versions"][version] = {
                "served": engine.policy_version, "reloads": reloads,
                "bucket_sizes": [len(b.entries) for b in plan.buckets],
                "digests": engine.weight_digests(), "stamps": sampled[0][0].versions.tolist()}
        out["tensors"] = len(hf_names(spec))
        yield out
    finally:
        engine.shutdown()
        transport.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_each_worker_of_a_tp2_engine_loads_each_tensor_of_a_version_once(loads, version):
    got = loads["versions"][version]
    assert got["served"] == version and set(got["stamps"]) == {version}, got["stamps"]
    # One reload per bucket of the version, in the plan's order, each answered by both workers with its size.
    assert got["reloads"] == [[n, n] for n in got["bucket_sizes"]], (got["reloads"], got["bucket_sizes"])
    assert sum(answers[0] for answers in got["reloads"]) == loads["tensors"], "each tensor of the version once"


@pytest.mark.parametrize("version", VERSIONS)
def test_both_workers_of_a_tp2_engine_hold_each_version_after_its_load(loads, version):
    before = _by_rank(loads["start"] if version == VERSIONS[0] else loads["versions"][version - 1]["digests"])
    after = _by_rank(loads["versions"][version]["digests"])
    assert set(after) == {"tp0", "tp1"}, sorted(after)
    changed = {rank: {n for n, d in after[rank].items() if d != before[rank][n]} for rank in after}
    assert changed["tp0"] == changed["tp1"], "the two workers took different weights of the version"
    expected = ("experts.w13_weight", "experts.w2_weight", "embed_tokens", "lm_head", "self_attn", "shared_experts")
    assert all(any(e in n for n in changed["tp0"]) for e in expected), sorted(changed["tp0"])
    # New bits, not a version already held (an old buffer mapped again, or a load that went to the wrong slot).
    held = [loads["start"]] + [loads["versions"][v]["digests"] for v in VERSIONS if v < version]
    for rank in ("tp0", "tp1"):
        for name in changed[rank]:
            assert all(after[rank][name] != _by_rank(d)[rank][name] for d in held), (rank, name)
