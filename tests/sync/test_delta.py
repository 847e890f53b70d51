"""Delta versions' pure logic (moe_grpo/sync/delta.py): what changed in the engine's dtype, encoded both ways,
applied exactly, chained."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_grpo.sync.delta import (BucketChange, DeltaHistory, DeltaTracker, RankBucket, VersionDelta, apply_bucket,
                                 bits, decode, encode, encoded_bytes, placed_positions)
from moe_grpo.sync.sync_metrics import expert_bitmaps, experts_unchanged
from moe_grpo.sync.plan import ALIGN, Bucket, BucketEntry, BucketPlan

FULL = {"layers.0.self_attn.qkv.weight": (6, 4), "layers.0.mlp.experts.0.up.weight": (8, 3),
        "layers.0.mlp.experts.1.up.weight": (8, 3), "embed.weight": (10, 4)}


def _plan(dtype: str = "bfloat16", scale: int = 1) -> BucketPlan:
    item = {"bfloat16": 2, "float32": 4}[dtype]
    entries, offset = [], 0
    for name, (rows, cols) in FULL.items():
        shape = (rows * scale, cols * scale)
        entries.append(BucketEntry(name, shape, offset))
        offset += (math.prod(shape) * item + ALIGN - 1) // ALIGN * ALIGN
    return BucketPlan("toy", dtype, (Bucket(0, tuple(entries[:2]), offset), Bucket(1, tuple(entries[2:]), offset)))


def _shards(rank: int) -> tuple[dict[str, torch.Tensor], dict[int, list]]:
    """Rank `rank` of two: rows [rank*3, rank*3+3) of qkv, all of expert `rank`, half the embedding's columns
    (a strided place), like a TP / EP learner rank."""
    g = torch.Generator().manual_seed(rank)
    src = {"qkv": torch.randn(3, 4, generator=g), "expert": torch.randn(8, 3, generator=g),
           "embed": torch.randn(10, 2, generator=g)}
    meta = {n: torch.empty(s, device="meta") for n, s in FULL.items()}
    shards = {0: [("layers.0.self_attn.qkv.weight", src["qkv"], meta["layers.0.self_attn.qkv.weight"].narrow(0, rank * 3, 3))],
              1: []}
    expert = f"layers.0.mlp.experts.{rank}.up.weight"
    (shards[0] if rank == 0 else shards[1]).append((expert, src["expert"], meta[expert]))
    shards[1].append(("embed.weight", src["embed"], meta["embed.weight"].narrow(1, rank * 2, 2)))
    return src, shards


def _buffers(plan: BucketPlan) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor]]:
    """Flat buffers of the plan's buckets (as a transport's `raw_bucket` gives them) and each tensor's view."""
    item = plan.torch_dtype.itemsize
    flats = {b.index: torch.zeros(b.nbytes // item, dtype=plan.torch_dtype) for b in plan.buckets}
    views = {e.name: flats[b.index][e.offset // item : e.offset // item + e.numel].view(e.shape)
             for b in plan.buckets for e in b.entries}
    return flats, views


def _one(name: str, shape: tuple, dtype: str = "bfloat16") -> BucketPlan:
    """A plan of one bucket holding one tensor."""
    return BucketPlan("toy", dtype, (Bucket(0, (BucketEntry(name, shape, 0),), 4 * math.prod(shape)),))


def _full_of(srcs: list[dict[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a full sync would put in the buckets: each rank's sources cast and placed."""
    out = {n: torch.zeros(s, dtype=dtype) for n, s in FULL.items()}
    for rank, src in enumerate(srcs):
        out["layers.0.self_attn.qkv.weight"][rank * 3 : rank * 3 + 3] = src["qkv"].to(dtype)
        out[f"layers.0.mlp.experts.{rank}.up.weight"][:] = src["expert"].to(dtype)
        out["embed.weight"][:, rank * 2 : rank * 2 + 2] = src["embed"].to(dtype)
    return out


def test_applying_each_ranks_changes_gives_bit_for_bit_what_a_full_sync_of_the_new_weights_gives() -> None:
    """A delta that missed an element, or wrote one at the wrong place (a strided TP slab, an expert, a tensor at
    its offset in the bucket), would leave the engine serving weights no full sync would give it."""
    plan = _plan()
    ranks = [_shards(0), _shards(1)]
    trackers = [DeltaTracker(plan, shards) for _, shards in ranks]
    for t in trackers:  # version 1: everything
        d = t.diff(1)
        assert d.base is None and d.changed_elements() == sum(s.numel() for cs in t.shards.values() for _, s, _ in cs)
        t.commit()
    flats, buffer = _buffers(plan)
    for name, t in _full_of([src for src, _ in ranks], torch.bfloat16).items():
        buffer[name].copy_(t)
    g = torch.Generator().manual_seed(7)
    for version in (2, 3, 4):
        for src, _ in ranks:
            for name, t in src.items():  # a small step: most bf16 values do not move
                t.add_(torch.randn(t.shape, generator=g) * 1e-3 * (name != "expert" or version != 3))
        deltas = [t.diff(version) for t in trackers]
        for t in trackers:
            t.commit()
        for d in deltas:
            assert d.base == version - 1
            for index, change in d.changes.items():
                apply_bucket(flats[index], change)
        want = _full_of([src for src, _ in ranks], torch.bfloat16)
        for name in FULL:
            assert torch.equal(buffer[name].view(torch.int16), want[name].view(torch.int16)), (version, name)
        changed = sum(d.changed_elements() for d in deltas)
        assert 0 < changed < sum(math.prod(s) for s in FULL.values())
        if version == 3:  # the experts did not move: no entry for them
            assert not any("experts" in n for d in deltas for n in d.names())
        else:
            assert {"layers.0.mlp.experts.0.up.weight", "layers.0.mlp.experts.1.up.weight"} <= set().union(
                *(d.names() for d in deltas))


def test_changes_are_found_by_bits_so_signed_zero_and_nan_are_not_missed() -> None:
    """A numeric comparison calls -0.0 == 0.0 and NaN != NaN: the engine would keep a wrong sign, or every NaN
    would be resent forever."""
    w = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    tracker = DeltaTracker(_one("w", (4,)), {0: [("w", w, torch.empty(4, device="meta"))]})
    tracker.diff(1)
    tracker.commit()
    w.copy_(torch.tensor([-0.0, 1.0, float("nan"), 2.0]))
    d = tracker.diff(2)
    assert [c.positions.tolist() for c in d.changes[0].entries()] == [[0]]
    assert torch.equal(d.changes[0].values.view(torch.int16), torch.tensor([-0.0], dtype=torch.bfloat16).view(torch.int16))


def _whole_parts(plan: BucketPlan) -> dict[int, RankBucket]:
    """Every tensor of every bucket whole, as one rank holding everything has it."""
    item = plan.torch_dtype.itemsize
    return {b.index: RankBucket.of(b, [(e.name, (e.shape, (e.shape[1], 1), 0)) for e in b.entries], item)
            for b in plan.buckets}


@pytest.mark.parametrize("fraction, encoding", [(0.02, "index"), (0.6, "bitmap")])
def test_each_bucket_travels_in_the_smaller_encoding_and_decodes_to_the_same_changes(fraction: float, encoding: str) -> None:
    """Sparse changes must cost ~6 bytes each (int32 position + bf16 value), dense ones 1 bit per element plus
    the values: the wire bytes follow the changed fraction."""
    plan = _plan(scale=16)
    parts = _whole_parts(plan)
    g = torch.Generator().manual_seed(3)
    delta = VersionDelta(5, 4)
    for b in plan.buckets:
        mask = torch.rand(parts[b.index].numel, generator=g) < fraction
        mask[parts[b.index].starts[:-1]] = True  # every tensor has a change
        local = mask.nonzero().view(-1)
        delta.changes[b.index] = BucketChange(parts[b.index], local, torch.randn(local.numel(), generator=g).to(torch.bfloat16))
    blob = encode(delta, plan)
    header = int.from_bytes(blob[:8], "little")
    assert len(blob) - 8 - header == encoded_bytes(delta, plan)
    assert f'"{encoding}"' in blob[8 : 8 + header].decode()
    n = delta.changed_elements()
    total = sum(e.numel for b in plan.buckets for e in b.entries)
    assert encoded_bytes(delta, plan) <= min(n * 6, math.ceil(total / 8) + 4 + n * 2)
    back = decode(blob, plan, _whole_parts(plan))
    assert (back.version, back.base) == (5, 4)
    for index, change in delta.changes.items():
        got = back.changes[index]
        assert [e.name for e in got.entries()] == [e.name for e in plan.buckets[index].entries]
        for a, b in zip(change.entries(), got.entries()):
            assert a.name == b.name and torch.equal(a.positions, b.positions)
            assert torch.equal(a.values.view(torch.int16), b.values.view(torch.int16))


def test_a_delta_in_another_dtype_or_for_a_part_this_rank_does_not_hold_is_refused() -> None:
    """A blob decoded against another rank's shards (or sizes) would write its values at wrong places."""
    plan = _plan()
    bucket = plan.buckets[0]
    half = RankBucket.of(bucket, [("layers.0.self_attn.qkv.weight", ((3, 4), (4, 1), 12))], 2)  # rank 1's rows
    delta = VersionDelta(2, 1, {0: BucketChange(half, torch.tensor([1]), torch.tensor([1.0], dtype=torch.bfloat16))})
    blob = encode(delta, plan)
    back = decode(blob, plan, {0: half})
    assert [e.positions.tolist() for e in back.changes[0].entries()] == [[13]]
    assert back.changes[0].positions().tolist() == [13]  # the tensor starts the bucket
    with pytest.raises(ValueError, match="bfloat16, the plan in float32"):
        decode(blob, _plan("float32"), {0: half})
    whole = RankBucket.of(bucket, [("layers.0.self_attn.qkv.weight", ((6, 4), (4, 1), 0))], 2)
    with pytest.raises(ValueError, match="carries a 12-element part of bucket 0 .* this rank's is 24 elements"):
        decode(blob, plan, {0: whole})
    other = RankBucket.of(bucket, [("layers.0.mlp.experts.0.up.weight", ((4, 3), (3, 1), 0))], 2)  # 12 elements too
    with pytest.raises(ValueError, match="this rank's is 12 elements \\(shards"):
        decode(blob, plan, {0: other})
    with pytest.raises(ValueError, match="this rank's is none"):
        decode(blob, plan, {})


def test_positions_in_a_bucket_follow_each_shards_place_and_its_tensors_offset() -> None:
    """One indexed write per bucket needs every change's position in the bucket: a dense shard (an expert, a row
    slab) and a strided TP slab (columns) each at their tensor's offset; one shard off would corrupt a neighbour."""
    plan = _plan()
    item = 2
    rows = [("embed.weight", ((10, 2), (4, 1), 2)), ("layers.0.mlp.experts.1.up.weight", ((8, 3), (3, 1), 0))]
    part = RankBucket.of(plan.buckets[1], rows, item)
    local = torch.tensor([0, 3, 19, 20, 21, 43])
    offsets = {e.name: e.offset // item for e in plan.buckets[1].entries}
    full = torch.arange(40).view(10, 4)[:, 2:4].reshape(-1)  # positions of the slab's elements in embed.weight
    want = [offsets["embed.weight"] + int(full[i]) for i in (0, 3, 19)] + \
           [offsets["layers.0.mlp.experts.1.up.weight"] + i - 20 for i in (20, 21, 43)]
    assert part.positions(local).tolist() == want
    assert part.counts(local).tolist() == [3, 3]


def test_placed_positions_follow_a_strided_slab() -> None:
    full = torch.arange(60).view(6, 10)
    slab = full[:, 4:7]  # columns 4..6 of every row: a TP slab along dim 1
    local = torch.tensor([0, 2, 3, 17])
    got = placed_positions(local, (slab.shape, slab.stride(), slab.storage_offset()))
    assert got.tolist() == slab.reshape(-1)[local].tolist()


def test_a_chain_brings_an_older_buffer_forward_only_through_versions_it_knows() -> None:
    """A buffer two versions behind gets both deltas in order; a gap, a whole version or a forgotten base means
    a whole write, never a buffer brought forward from the wrong version."""
    history = DeltaHistory(keep=3)
    for v in (2, 3, 4, 5):
        history.record(v, VersionDelta(v, v - 1))
    assert [d.version for d in history.chain(3, 5)] == [4, 5]
    assert history.chain(1, 5) is None  # version 2 was dropped (keep=3)
    assert history.chain(5, 5) is None and history.chain(None, 5) is None
    history.record(6, None)  # sent whole
    history.record(7, VersionDelta(7, 6))
    assert history.chain(5, 7) is None and [d.version for d in history.chain(6, 7)] == [7]
    history.record(9, VersionDelta(9, 7))  # version 8 was never published: 9's base is 7
    assert [d.version for d in history.chain(6, 9)] == [7, 9]


def test_experts_unchanged_counts_experts_no_rank_changed_once_each_even_when_split_over_ranks() -> None:
    """`sync/experts_unchanged`: an expert whose tensors two expert-TP ranks hold must be counted once, and a
    change on either rank makes it changed."""
    names = [f"model.layers.{l}.mlp.experts.{e}.{p}.weight" for l in (0, 1) for e in range(4)
             for p in ("up_proj", "down_proj")]
    held = [expert_bitmaps(names + ["model.embed_tokens.weight"]), expert_bitmaps(names)]  # two ETP ranks
    changed = [expert_bitmaps({"model.layers.0.mlp.experts.1.up_proj.weight", "model.embed_tokens.weight"}),
               expert_bitmaps({"model.layers.1.mlp.experts.3.down_proj.weight"})]
    assert experts_unchanged(held, changed) == 6
    assert experts_unchanged(held, []) == 8


def test_small_updates_travel_as_varint_steps_in_about_the_bytes_of_the_changed_values() -> None:
    """A small step moves most changed bf16 values by one unit in the last place: index or bitmap encodings spend
    4 bytes or 1/16 of the tensor on positions, so at 3% changed a delta took 9% of a full version's bytes
    (tools/bench_sync.py --delta, 2026-11-26). As varint gaps and varint steps of the bit patterns it must take
    at most the changed fraction plus 1% of the full bytes, and decode, given the old values, to the new ones."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200_000, generator=g) * 0.02
    meta = torch.empty(400, 500, device="meta")
    src = w.view(400, 500)
    plan = _one("w", (400, 500))
    tracker = DeltaTracker(plan, {0: [("w", src, meta)]})
    tracker.diff(1)
    tracker.commit()
    old = src.to(torch.bfloat16).clone()
    src.add_(torch.sign(torch.randn(src.shape, generator=g)) * 1e-6)
    delta = tracker.diff(2)
    changed = delta.changed_elements() / w.numel()
    assert 0.005 < changed < 0.2
    blob = encode(delta, plan)
    assert '"varint"' in blob[8 : 8 + int.from_bytes(blob[:8], "little")].decode()
    full = 2 * w.numel()
    assert encoded_bytes(delta, plan) <= (changed + 0.01) * full, (encoded_bytes(delta, plan) / full, changed)
    parts = {0: tracker.parts[0]}
    back = decode(blob, plan, parts, lambda index, positions: old.view(-1)[positions])
    want = src.to(torch.bfloat16).view(-1)
    c = back.changes[0]
    assert torch.equal(c.values.view(torch.int16), want[c.local].view(torch.int16))
    assert torch.equal(c.positions(), delta.changes[0].positions())
    with pytest.raises(ValueError, match="no values of that version were given"):
        decode(blob, plan, parts)


def test_varint_steps_wrap_across_the_sign_bit_exactly() -> None:
    """Bit-pattern steps are taken modulo the element width: +0.0 -> -0.0, the largest finite value -> inf and
    back must decode to the exact new bits."""
    from moe_grpo.sync.delta import _stepped

    old = torch.tensor([0.0, -0.0, 3.3895e38, float("inf"), -1.5], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, 0.0, float("inf"), 3.3895e38, 2.0], dtype=torch.bfloat16)
    steps = bits(new).to(torch.int64) - bits(old).to(torch.int64)
    assert torch.equal(bits(_stepped(old, steps)), bits(new))


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_a_bucket_is_diffed_encoded_and_applied_at_once_not_tensor_by_tensor(monkeypatch) -> None:
    """A bucket of a 128-expert model holds hundreds of small tensors: a comparison, a `nonzero` and an indexed
    write per tensor cost 4-16x a full version's copy in seconds (tools/bench_sync.py --delta at aa5e849). The
    diff must compare the bucket once (numpy's comparison on CPU: `_not_equal`), and the apply write it once
    (one `index_copy_`), whatever the tensors' count."""
    import moe_grpo.sync.delta as delta_module

    compared = []
    not_equal = delta_module._not_equal
    monkeypatch.setattr(delta_module, "_not_equal",
                        lambda a, b, out: (compared.append(a.numel()), not_equal(a, b, out)))
    names = [f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(200)]
    plan = BucketPlan("toy", "bfloat16", (Bucket(0, tuple(BucketEntry(n, (16, 32), 1024 * i) for i, n in enumerate(names)),
                                                 1024 * len(names)),))
    srcs = [torch.randn(16, 32) for _ in names]
    tracker = DeltaTracker(plan, {0: [(n, s, torch.empty(16, 32, device="meta")) for n, s in zip(names, srcs)]})
    tracker.diff(1)
    tracker.commit()
    for s in srcs[::7]:
        s.add_(1.0)
    with _CountOps() as diff_ops:
        delta = tracker.diff(2)
    assert compared == [16 * 32 * len(names)] and diff_ops.ops.get("nonzero", 0) <= 1, (compared, diff_ops.ops)
    assert delta.names() == set(names[::7])
    flats, views = _buffers(plan)
    with _CountOps() as apply_ops:
        apply_bucket(flats[0], delta.changes[0])
    assert apply_ops.ops.get("index_copy_", 0) + apply_ops.ops.get("index_copy", 0) == 1, apply_ops.ops
    assert not apply_ops.ops.get("index_put_", 0), apply_ops.ops
    for n, s in zip(names[::7], srcs[::7]):
        assert torch.equal(views[n].view(torch.int16), s.to(torch.bfloat16).view(torch.int16))


def test_changes_found_chunk_by_chunk_are_the_same_as_over_the_whole_bucket(monkeypatch) -> None:
    """The diff compares a bucket a chunk at a time into one reused mask: an index shifted by a chunk's start,
    or a change at a chunk's edge left out, would put a value at the wrong place or miss it."""
    import moe_grpo.sync.delta as delta_module

    monkeypatch.setattr(delta_module, "COMPARE_CHUNK", 7)
    plan = BucketPlan("toy", "bfloat16", (Bucket(0, (BucketEntry("a", (5, 4), 0), BucketEntry("b", (31,), 64)), 128),))
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(5, 4, generator=g), torch.randn(31, generator=g)
    tracker = DeltaTracker(plan, {0: [("a", a, torch.empty(5, 4, device="meta")), ("b", b, torch.empty(31, device="meta"))]})
    tracker.diff(1)
    tracker.commit()
    before = torch.cat([a.view(-1), b]).to(torch.bfloat16)
    hit = torch.tensor([0, 6, 7, 13, 14, 20, 27, 50])  # both sides of chunk edges, both tensors
    a.view(-1)[hit[hit < 20]] += 1.0
    b[hit[hit >= 20] - 20] += 1.0
    flat = torch.cat([a.view(-1), b]).to(torch.bfloat16)
    d = tracker.diff(2)
    want = (bits(flat) != bits(before)).nonzero().view(-1)
    assert d.changes[0].local.tolist() == want.tolist() == hit.tolist()
    assert d.changes[0].positions().tolist() == [i if i < 20 else 32 + i - 20 for i in hit.tolist()]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_varints_of_every_length_round_trip_where_most_take_one_byte(dtype: torch.dtype) -> None:
    """The varint passes work on the few values longer than a byte (their further bytes are inserted after their
    first, and found again by their continuation bits): a value of 2..9 bytes next to another long one, at the
    start or the end of a section, or a run of them, would come back wrong if an inserted byte landed one place
    off or a run of continuation bytes were split wrongly."""
    from moe_grpo.sync.delta import _unvarint, _varint, _varint_sizes

    g = torch.Generator().manual_seed(4)
    top = 31 if dtype == torch.int32 else 63
    x = torch.randint(0, 128, (5000,), generator=g, dtype=dtype)
    long_at = torch.tensor([0, 1, 2, 17, 18, 999, 1000, 4000, 4998, 4999])
    for i, at in enumerate(long_at.tolist()):
        bits_ = [8, 14, 15, 21, 22, 28, 29, top, 35 if top > 35 else 30, top][i]
        x[at] = (1 << bits_) - 1 - i  # 2 to 9 bytes, and the largest of each width
    blob = _varint(x)
    assert blob.dtype == torch.uint8 and blob.numel() == int(_varint_sizes(x).sum())
    assert torch.equal(_unvarint(blob, x.numel()), x.to(torch.int64))
    # one value per byte only, the common case
    assert torch.equal(_unvarint(_varint(x[3:17]), 14), x[3:17].to(torch.int64))


def test_a_varint_section_holding_more_values_than_its_header_says_is_refused() -> None:
    """The header names each bucket's changes: a varint section with values left over is a corrupt (or
    mismatched) blob whose values would land at wrong places; decoding took the first ones and applied them."""
    import json

    g = torch.Generator().manual_seed(2)
    w = torch.randn(4000, generator=g)
    plan = _one("w", (4000,))
    tracker = DeltaTracker(plan, {0: [("w", w, torch.empty(4000, device="meta"))]})
    tracker.diff(1)
    tracker.commit()
    old = w.to(torch.bfloat16)
    w[::40] += 1.0
    blob = encode(tracker.diff(2), plan)
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    assert header["buckets"]["0"][0] == "varint"
    header["buckets"]["0"][1] -= 1  # one change fewer than the sections hold
    head = json.dumps(header).encode()
    tampered = len(head).to_bytes(8, "little") + head + blob[8 + size :]
    with pytest.raises(ValueError, match="holds 100 values, expected 99"):
        decode(tampered, plan, {0: tracker.parts[0]}, lambda index, positions: old[positions])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_varint_steps_are_exact_in_every_engine_dtype_with_signed_zero_infinities_and_nan(dtype: str) -> None:
    """Steps are summed in a wider integer and narrowed to the element's width (int32 -> int16 for 2-byte
    dtypes, int64 -> int32 for float32): a step that wraps, or a narrowing that saturated instead of keeping the
    low bits, would give an engine wrong bits exactly where a value crosses zero or becomes inf or NaN."""
    plan = BucketPlan("toy", dtype, (Bucket(0, (BucketEntry("w", (100, 50), 0),), 4 * 5000),))
    g = torch.Generator().manual_seed(6)
    w = torch.randn(100, 50, generator=g)
    w.view(-1)[0] = 0.0
    tracker = DeltaTracker(plan, {0: [("w", w, torch.empty(100, 50, device="meta"))]})
    tracker.diff(1)
    tracker.commit()
    old = tracker.last[0].clone()
    w.view(-1)[::3] += torch.randn(1667, generator=g) * 1e-3
    w.view(-1)[:5] = torch.tensor([-0.0, float("inf"), -float("inf"), -1e-30, float("nan")])
    blob = encode(tracker.diff(2), plan)
    assert '"varint"' in blob[8 : 8 + int.from_bytes(blob[:8], "little")].decode()
    back = decode(blob, plan, tracker.parts, lambda index, positions: old[positions])
    apply_bucket(old, back.changes[0])
    assert torch.equal(bits(old), bits(w.to(plan.torch_dtype).view(-1)))
