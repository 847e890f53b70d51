"""tools/bench_sync_delta.py's projection: the bytes of a delta version at a changed fraction, as the sync encodes
them (sync/delta.py `encoded_bucket_bytes`), and the bf16 sizes of the projected models."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import bench_sync_delta as bench  # noqa: E402
from moe_grpo.sync.delta import BucketChange, RankBucket, encoded_bucket_bytes  # noqa: E402


def _part(numel: int) -> RankBucket:
    """One rank holding one whole tensor of `numel` elements, alone in its bucket."""
    return RankBucket(["w"], [((numel,), (1,), 0)], [0])


@pytest.mark.parametrize("changed", [0, 3, 100, 1000, 4096])
def test_projected_delta_bytes_match_the_syncs_smaller_encoding(changed):
    """Would have caught: a projection in another encoding than the one the sync picks (indices below ~1/32 of the
    elements changed, the bitmap above), or counting bytes per change wrong (4-byte position + 2-byte bf16 value)."""
    numel = 4096
    local = torch.arange(changed, dtype=torch.int64)
    change = BucketChange(_part(numel), local, torch.zeros(changed, dtype=torch.bfloat16))
    _, want = encoded_bucket_bytes(change, 2)
    assert bench.delta_bytes(numel, changed / numel) == want


def test_projection_is_the_models_bf16_bytes_over_the_link():
    """Would have caught: the projection counting fp32 bytes, or seconds not bytes / link rate."""
    p = bench.project("qwen3_moe_30b_a3b", 0.0)
    assert 2 * 30e9 < p["full_bytes"] < 2 * 31.5e9  # ~30.5 B parameters in bf16
    assert p["full_seconds"] == pytest.approx(p["full_bytes"] / 25e9)
    assert p["delta_bytes"] == 0
    q = bench.project("deepseek_v3", 0.0005)
    assert 2 * 650e9 < q["full_bytes"] < 2 * 690e9
    # 1 in 2000 changed: a 2-byte varint gap and a 1-byte step per change (6 bytes as int32 index + value)
    assert q["delta_bytes"] == pytest.approx(q["full_bytes"] / 2 * 0.0005 * 3, rel=1e-6)


@pytest.mark.parametrize("gap", [3, 200, 40_000])
def test_projected_varint_bytes_match_the_syncs_varint_encoding(gap):
    """Evenly spaced changes of one unit in the last place: the projection's varint estimate is exactly what
    the sync's encoding spends."""
    count = 50
    numel = gap * count
    local = torch.arange(gap - 1, numel, gap)
    change = BucketChange(_part(numel), local, torch.zeros(count, dtype=torch.bfloat16), torch.ones(count, dtype=torch.int64))
    encoding, want = encoded_bucket_bytes(change, 2)
    assert bench.delta_bytes(numel, count / numel, step_bytes=1) == want
    assert encoding == "varint"
