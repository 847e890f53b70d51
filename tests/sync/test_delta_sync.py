"""Delta versions from real learner ranks (moe_grpo/sync/weight_sync.py with `delta`): after each optimizer step
the buckets hold bit for bit what a full sync of the same weights gives, while only the changes are written."""

import hashlib

import pytest
import torch

from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.learner.spawn import run_distributed
from moe_grpo.sync.sync_metrics import combine_sync_metrics


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in tensors.items()}


def publish_with_and_without_delta(tp: int, ep: int, delta_root: str, full_root: str, steps: int, lr: float,
                                   slots: int) -> list[dict]:
    """Train `steps` steps; after each, publish the version twice (bf16): with delta versions and whole. Rank 0
    compares the two versions tensor by tensor (sha256 of the bits). Returns per version this rank's reports and
    the names whose hashes differ."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    spec = tiny_spec()
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, 1), LearnerConfig(seed=5, lr=lr, lr_decay="constant"))
    delta_t, full_t = SharedMemoryTransport(delta_root, slots=slots), SharedMemoryTransport(full_root)
    delta = WeightSync(learner, delta_t, max_bucket_bytes=1 << 16, dtype="bfloat16",
                       delta=DeltaOptions(max_fraction=0.9))
    full = WeightSync(learner, full_t, max_bucket_bytes=1 << 16, dtype="bfloat16")
    out = []
    for version in range(1, steps + 1):
        if version > 1:
            learner.train_step(make_sequences(spec, n=4, seed=version), replay=True)
        d, f = delta.sync(version).wait(), full.sync(version).wait()
        torch.distributed.barrier()
        mismatched = []
        if torch.distributed.get_rank() == 0:
            want, got = _digests(full_t.read_version(version, 5)), _digests(delta_t.read_version(version, 5))
            mismatched = sorted(n for n in want if got.get(n) != want[n])
        torch.distributed.barrier()
        out.append({"delta": d.metrics(), "full": f.metrics(), "mismatched": mismatched})
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp, ep, slots", [(2, 1, 2), (1, 2, 3)])
def test_delta_versions_equal_full_versions_bit_for_bit_and_send_only_the_changes(tmp_path, tp, ep, slots):
    """Would have caught: a change written at the wrong place (TP slabs, qkv groups, gate/up halves, EP experts),
    a recycled slot brought forward from the wrong version (2 slots: every version two behind; 3: three behind),
    changes found numerically instead of bitwise, or `sync/bytes` reporting the whole version."""
    out = run_distributed(publish_with_and_without_delta, 2, tp, ep, str(tmp_path / "d"), str(tmp_path / "f"), 6,
                          2e-5, slots)
    versions = list(zip(*out))
    for v, ranks in enumerate(versions, start=1):
        assert ranks[0]["mismatched"] == [], (v, ranks[0]["mismatched"])
        delta = combine_sync_metrics([r["delta"] for r in ranks])
        full = combine_sync_metrics([r["full"] for r in ranks])
        assert delta["sync/full_bytes"] == full["sync/bytes"] == full["sync/full_bytes"]
        if v == 1:
            assert delta["sync/delta"] == 0 and delta["sync/changed_fraction"] == 1.0
            continue
        print(f"version {v}: changed {delta['sync/changed_fraction']:.4f}, bytes {delta['sync/bytes']:.0f} of "
              f"{delta['sync/full_bytes']:.0f}, experts unchanged {delta['sync/experts_unchanged']:.0f}")
        assert delta["sync/delta"] == 1.0
        assert 0 < delta["sync/changed_fraction"] < 0.9
        # index encoding: 4 + 2 bytes per change at most; bitmap: 1/16 of the bf16 bytes + 2 per change
        changed = delta["sync/changed_fraction"] * full["sync/bytes"] / 2
        assert delta["sync/bytes"] <= min(6 * changed, full["sync/bytes"] / 16 + 2 * changed + 64 * 100)
