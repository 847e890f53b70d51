"""The device path of delta versions (moe_grpo/sync/delta.py with `torch_ops`): what a GPU learner rank runs over
`cuda_ipc` (compare, find, gather, size the encodings, place, apply, keep) as torch ops on the tensors' device,
run here on CPU tensors and compared bit for bit with the numpy path the CPU transports use."""

from __future__ import annotations

import math

import pytest
import torch

from moe_grpo.sync.delta import DeltaTracker, apply_bucket, bits, encoded_bytes, flat_bucket
from moe_grpo.sync.plan import ALIGN, Bucket, BucketEntry, BucketPlan

SHAPES = {"layers.0.self_attn.qkv.weight": (12, 10), "layers.0.mlp.experts.0.up.weight": (9, 7),
          "layers.0.mlp.experts.1.up.weight": (9, 7), "embed.weight": (13, 8)}


def _plan(dtype: str) -> BucketPlan:
    item = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    entries, offset = [], 0
    for name, shape in SHAPES.items():
        entries.append(BucketEntry(name, shape, offset))
        offset += (math.prod(shape) * item + ALIGN - 1) // ALIGN * ALIGN
    return BucketPlan("toy", dtype, (Bucket(0, tuple(entries[:2]), offset), Bucket(1, tuple(entries[2:]), offset)))


def _sources(seed: int) -> dict[str, torch.Tensor]:
    """One rank's fp32 shards: a row slab of qkv, expert 0 whole, expert 1 whole, a column slab of the embedding
    (strided: a TP slab along a later dimension)."""
    g = torch.Generator().manual_seed(seed)
    return {"qkv": torch.randn(6, 10, generator=g), "e0": torch.randn(9, 7, generator=g),
            "e1": torch.randn(9, 7, generator=g), "embed": torch.randn(13, 3, generator=g)}


def _shards(src: dict[str, torch.Tensor]) -> dict[int, list]:
    meta = {n: torch.empty(s, device="meta") for n, s in SHAPES.items()}
    return {0: [("layers.0.self_attn.qkv.weight", src["qkv"], meta["layers.0.self_attn.qkv.weight"].narrow(0, 6, 6)),
                ("layers.0.mlp.experts.0.up.weight", src["e0"], meta["layers.0.mlp.experts.0.up.weight"])],
            1: [("layers.0.mlp.experts.1.up.weight", src["e1"], meta["layers.0.mlp.experts.1.up.weight"]),
                ("embed.weight", src["embed"], meta["embed.weight"].narrow(1, 4, 3))]}


def _nan(payload: int) -> float:
    """A float32 NaN with the given mantissa payload (its bits differ from the canonical NaN's)."""
    return torch.tensor([0x7F800000 | payload], dtype=torch.int32).view(torch.float32).item()


def _step(src: dict[str, torch.Tensor], version: int, g: torch.Generator) -> None:
    """What happens to the weights before `version`: small steps, signed zeros, NaN payloads, nothing, everything."""
    if version == 2:  # a small step: some values move, most do not
        for t in src.values():
            t.add_(torch.randn(t.shape, generator=g) * 1e-3)
    elif version == 3:  # signed zeros and NaN payloads (numerically equal / unequal to themselves)
        src["qkv"].view(-1)[:4] = 0.0
        src["e1"].view(-1)[5] = _nan(1)
        src["embed"].view(-1)[-1] = float("nan")
    elif version == 4:
        src["qkv"].view(-1)[:2] = -0.0  # -0.0 == 0.0 numerically: a change all the same
        src["e1"].view(-1)[5] = _nan(2)  # another payload
        src["embed"].view(-1)[-1] = _nan(3)
    elif version == 6:  # everything changes
        for t in src.values():
            t.copy_(torch.where(t.isnan(), 7.0, t + 1.0))
    # version 5: no step, no change


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_torch_op_path_finds_places_sizes_and_applies_the_same_changes_as_the_numpy_path(monkeypatch, dtype):
    """Would have caught: the device path (a GPU rank's torch ops) missing a change or shifting an index across a
    compare chunk's edge, a gather, step or position differing from the numpy path's, a strided TP slab placed as
    a dense one, varint / bitmap / index sizes (`sync/bytes`) computed differently on the device, another set of
    changed tensors (the engines' change log, `sync/experts_unchanged`), or a slot or kept copy written
    differently; over a small step, -0.0 vs 0.0 and NaN payloads (float32 keeps them), no change and every
    element changed. Failed before the device path existed: `DeltaTracker` took no `torch_ops` (TypeError)."""
    import moe_grpo.sync.delta as delta_module

    monkeypatch.setattr(delta_module, "COMPARE_CHUNK", 11)  # odd chunks cross every tensor's edges
    plan = _plan(dtype)
    tdtype = plan.torch_dtype
    srcs = {way: _sources(3) for way in ("numpy", "torch")}
    trackers = {way: DeltaTracker(plan, _shards(srcs[way]), torch_ops=(way == "torch")) for way in srcs}
    flats = {way: {b.index: torch.zeros(b.nbytes // tdtype.itemsize, dtype=tdtype) for b in plan.buckets}
             for way in srcs}
    gens = {way: torch.Generator().manual_seed(9) for way in srcs}
    for version in range(1, 7):
        for way in srcs:
            _step(srcs[way], version, gens[way])
        deltas = {way: trackers[way].diff(version) for way in srcs}
        a, b = deltas["numpy"], deltas["torch"]
        assert (a.version, a.base) == (b.version, b.base) == (version, None if version == 1 else version - 1)
        assert sorted(a.changes) == sorted(b.changes), version
        assert a.changed_elements() == b.changed_elements(), version
        assert a.names() == b.names(), version
        assert encoded_bytes(a, plan) == encoded_bytes(b, plan), version
        for index in a.changes:
            ca, cb = a.changes[index], b.changes[index]
            assert ca.local.dtype == cb.local.dtype == torch.int64
            assert torch.equal(ca.local, cb.local), (version, index)
            assert torch.equal(bits(ca.values), bits(cb.values)), (version, index)
            assert (ca.steps is None) == (cb.steps is None) == (version == 1)
            if ca.steps is not None:
                assert ca.steps.dtype == cb.steps.dtype and torch.equal(ca.steps, cb.steps), (version, index)
            assert torch.equal(ca.positions(), cb.positions()), (version, index)
            assert delta_module._sizes(ca, tdtype.itemsize) == delta_module._sizes(cb, tdtype.itemsize)
            for way, change in (("numpy", ca), ("torch", cb)):
                apply_bucket(flats[way][index], change)
        for way in srcs:
            trackers[way].commit()
        for index in flats["numpy"]:
            assert torch.equal(bits(flats["numpy"][index]), bits(flats["torch"][index])), (version, index)
            assert torch.equal(bits(trackers["numpy"].last[index]), bits(trackers["torch"].last[index]))
        if version == 3:
            assert "layers.0.mlp.experts.0.up.weight" not in b.names()
            assert b.names() == {"layers.0.self_attn.qkv.weight", "layers.0.mlp.experts.1.up.weight", "embed.weight"}
        if version == 4:  # -0.0 where 0.0 was; another NaN payload (bf16 rounds NaNs to one pattern)
            assert b.changes[0].count == 2
            assert (b.changes[1].count if 1 in b.changes else 0) == (2 if dtype == "float32" else 0)
        if version == 5:
            assert b.changes == {} and encoded_bytes(b, plan) == 0
        if version == 6:
            assert b.changed_elements() == sum(t.numel() for t in srcs["torch"].values())
    # The slots hold what a full version of the last weights would (each shard cast and placed).
    want = {n: torch.zeros(s, dtype=tdtype) for n, s in SHAPES.items()}
    src = srcs["torch"]
    want["layers.0.self_attn.qkv.weight"][6:] = src["qkv"].to(tdtype)
    want["layers.0.mlp.experts.0.up.weight"][:] = src["e0"].to(tdtype)
    want["layers.0.mlp.experts.1.up.weight"][:] = src["e1"].to(tdtype)
    want["embed.weight"][:, 4:7] = src["embed"].to(tdtype)
    for bucket in plan.buckets:
        for e in bucket.entries:
            o = e.offset // tdtype.itemsize
            got = flats["torch"][bucket.index][o : o + e.numel].view(e.shape)
            assert torch.equal(bits(got), bits(want[e.name])), e.name


class _HostReads:
    """Counts the host reads of tensor data (`tolist`, `item`) and refuses numpy views and `.cpu()` copies: on a
    GPU each of those waits for the device or copies across PCIe."""

    def __init__(self, monkeypatch) -> None:
        self.reads: list[str] = []

        def refuse(name):
            def f(t, *args, **kwargs):
                raise AssertionError(f"Tensor.{name} on the device path")
            return f

        def count(name, original):
            def f(t, *args, **kwargs):
                self.reads.append(name)
                return original(t, *args, **kwargs)
            return f

        for name in ("numpy", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, refuse(name))
        for name in ("tolist", "item", "__int__", "__float__", "__bool__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, count(name, getattr(torch.Tensor, name)))


def test_the_torch_op_path_makes_no_host_copies_and_two_host_reads_per_version(monkeypatch) -> None:
    """On a GPU a full version is one device copy (~10 ms for 315 MB on an H200) and a delta version cost
    14-275x that (tools/bench_sync_ipc_delta.py, 2026-11-27) because its changes went to the host: indices, values
    and steps copied with `.cpu()`, their encodings sized with numpy, positions placed with numpy and copied back.
    The device path (diff, sizes, positions, apply, keep, changed tensors) must not copy to the host or use numpy,
    and read the host at most twice a version (the encodings' sizes, the changed tensors), whatever the buckets'
    count. Failed before it existed: `DeltaTracker` took no `torch_ops` (TypeError)."""
    plan = BucketPlan("toy", "bfloat16", tuple(
        Bucket(i, tuple(BucketEntry(f"layers.{i}.mlp.experts.{e}.up.weight", (16, 32), 1024 * e) for e in range(6)),
               6 * 1024) for i in range(4)))
    g = torch.Generator().manual_seed(2)
    srcs = {b.index: [torch.randn(16, 32, generator=g) for _ in b.entries] for b in plan.buckets}
    tracker = DeltaTracker(plan, {i: [(e.name, s, torch.empty(16, 32, device="meta"))
                                      for e, s in zip(plan.buckets[i].entries, srcs[i])] for i in srcs},
                           torch_ops=True)
    flats = {b.index: torch.zeros(b.nbytes // 2, dtype=torch.bfloat16) for b in plan.buckets}
    reads = _HostReads(monkeypatch)
    for version in (1, 2, 3):
        if version > 1:
            for i, ts in srcs.items():
                for t in ts[:: version]:
                    t.add_(torch.randn(t.shape, generator=g) * 1e-2)
        reads.reads.clear()
        delta = tracker.diff(version)
        wire = encoded_bytes(delta, plan)
        names = delta.names()
        for index, change in delta.changes.items():
            apply_bucket(flats[index], change)
        tracker.commit()
        assert len(reads.reads) <= 2, (version, reads.reads)
        if version > 1:
            assert 0 < wire < 2 * sum(b.nbytes for b in plan.buckets) and names
    monkeypatch.undo()
    for b in plan.buckets:
        for e, s in zip(b.entries, srcs[b.index]):
            got = flat_bucket(flats[b.index].view(torch.uint8), torch.bfloat16)[e.offset // 2 : e.offset // 2 + e.numel]
            assert torch.equal(bits(got), bits(s.to(torch.bfloat16).view(-1))), e.name


@pytest.mark.slow
def test_a_learner_publishing_through_the_device_path_on_cpu_equals_full_versions_by_sha256(tmp_path, monkeypatch):
    """tests/sync/test_cuda_ipc_delta.py's scenario (an fp32 learner's 6 bf16 versions, 2 recycled slots, a no-step
    version, a periodic full one, compare chunks of 4099 elements, a fresh process reading each version) over
    shared memory with `WeightSync` on the device path (`DeltaOptions.torch_ops`): what a GPU rank runs over
    `cuda_ipc`, here on CPU tensors, with its checks (sha256 per tensor against a full version, `sync/bytes` within
    the bitmap bound, `sync/experts_unchanged`, the engines' change log). Would have caught, without a GPU, the
    device path's changes applied at the wrong place, a chain brought forward wrongly with device-held changes
    (a history kept shorter on the device), or reported figures differing from the numpy path's meaning."""
    import moe_grpo.sync.delta as delta_module
    from test_cuda_ipc_delta import check_versions, publish_versions

    monkeypatch.setattr(delta_module, "COMPARE_CHUNK", 4099)
    for line in check_versions(publish_versions("shm", tmp_path, torch_ops=True), "cpu"):
        print(line)
