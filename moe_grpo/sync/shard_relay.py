"""Each learner rank's own shards, broadcast to the other hosts that assemble versions (transport 'relay').

A learner may span hosts and engines may sit on hosts without a learner rank.
Every "sync host" (layout.py: learner rank 0's host and every engine host)
keeps a complete copy of each version in its own shared memory. A rank on a
sync host writes its shards there directly, as on one host; for every other
sync host it packs its shards bucket by bucket into one reusable staging
buffer (at most one bucket's worth) and broadcasts them over its own private
gloo group (`ShardSender`). On each receiving host a `ShardReceiver` (a thread
of that host's agent, orchestrator/sync_hosts.py) receives them and copies
each shard to its place in the bucket files (the layout of every shard - HF
name, shape, strides, offset - was sent once when the group met, for each plan
the rank's versions use: every tensor, and in a LoRA run also the adapters
only; each version's header names its plan), then marks that rank done
there. A version is complete on a host only when every rank is marked done
on it, exactly as on one host, so engines there apply all of it or none. Nothing ever holds the whole model outside the hosts' buffers, and
each rank's shards cross the network once per receiving host.

Why per-rank broadcasts rather than gathering to a leader and relaying whole
versions: no version waits for the slowest rank before it starts moving, no
host forwards bytes it did not produce, and the bytes on the wire are exactly
each rank's share times the hosts that need it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from moe_grpo.learner.rendezvous import RunStore
from moe_grpo.sync.delta import DeltaHistory, RankBucket, VersionDelta, apply_bucket, decode, flat_bucket
from moe_grpo.sync.plan import BucketPlan
from moe_grpo.sync.relay import RelayGroup, Broadcaster
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError

DELTA_HISTORY = 16
"""Versions of a rank's changes a receiver keeps to bring a recycled slot forward."""

READY_WAIT_S = 1.0
"""How often a receiver waiting for its rank's first publish checks whether it should stop."""


def placements(plan: BucketPlan, writes: dict[int, list[Any]]) -> dict[int, list[list]]:
    """Per bucket, per shard: [HF name, shape, strides, element offset] of its place inside the full HF tensor."""
    shapes = plan.shapes()
    out: dict[int, list[list]] = {}
    for index, ws in writes.items():
        rows = []
        for w in ws:
            placed = w.place(torch.empty(shapes[w.name], device="meta"))
            rows.append([w.name, list(placed.shape), list(placed.stride()), int(placed.storage_offset())])
        if rows:
            out[index] = rows
    return out


def _shard_view(full: torch.Tensor, placement: Any) -> torch.Tensor:
    """A rank's shard inside a full HF tensor, from its (shape, strides, element offset) as `placements` gives it."""
    shape, stride, offset = placement
    return full.as_strided(shape, stride, full.storage_offset() + offset)


def _ready_key(group: RelayGroup) -> str:
    return f"{group.prefix}/ready"


WHOLE, ADAPTERS = 0, 1
"""The plans a rank's versions use, as the version header names them: every tensor (the base version of a LoRA
run, every version otherwise), or a LoRA run's adapters only (every version after its first)."""


@dataclass(frozen=True)
class RankShards:
    """One plan's worth of a rank's shards as its receivers place them."""

    plan: BucketPlan
    rows: dict[int, list[list]]
    """Per bucket this rank writes into: per shard [HF name, shape, strides, element offset] (`placements`)."""

    @property
    def sizes(self) -> dict[int, list[int]]:
        """Per bucket: the elements of each of the rank's shards, in `rows` order."""
        return {i: [int(torch.Size(shape).numel()) for _, shape, _, _ in rows] for i, rows in self.rows.items()}

    def staging_bytes(self) -> int:
        """The most bytes of one bucket's shards (what one broadcast of a whole version carries)."""
        item = self.plan.torch_dtype.itemsize
        return max((sum(n) * item for n in self.sizes.values()), default=0)


class ShardSender:
    """In a learner rank: member 0 of its relay group; the group meets at the first version it sends."""

    def __init__(self, group: RelayGroup, rank: int, plan: BucketPlan, writes: dict[int, list[Any]],
                 adapter_plan: BucketPlan | None = None, adapter_writes: dict[int, list[Any]] | None = None) -> None:
        """`plan` / `writes`: every tensor; with LoRA `adapter_plan` / `adapter_writes` too: the adapters only
        (the versions after the first)."""
        if (adapter_plan is None) != (adapter_writes is None):
            raise ValueError("ShardSender: adapter_plan and adapter_writes go together (a LoRA run) or not at all")
        self.group, self.rank = group, rank
        self.plans = [plan] if adapter_plan is None else [plan, adapter_plan]
        self.writes = [{i: ws for i, ws in w.items() if ws} for w in [writes, adapter_writes] if w is not None]
        self.shards = [RankShards(p, placements(p, w)) for p, w in zip(self.plans, self.writes)]
        self.staging = torch.empty(max(s.staging_bytes() for s in self.shards), dtype=torch.uint8)
        self.broadcast: Broadcaster | None = None
        self.bytes_sent = 0
        self.seconds = 0.0
        self.delta_version: int | None = None
        self.kind = WHOLE
        """The plan of the version being sent (`WHOLE` or `ADAPTERS`)."""

    def kind_of(self, plan: BucketPlan) -> int:
        """Which of the bound plans `plan` is (the very object `WeightSync` bound)."""
        for kind, bound in enumerate(self.plans):
            if plan is bound:
                return kind
        raise ValueError(f"relay of learner rank {self.rank}: a version of a plan of {len(plan.buckets)} bucket(s) "
                         f"that was not bound (bound: {[len(p.buckets) for p in self.plans]} bucket(s))")

    def _connect(self) -> None:
        RunStore(self.group.host, self.group.port, self.group.secret,
                 timedelta(seconds=self.group.timeout_s)).set(_ready_key(self.group), b"1")
        self.broadcast = Broadcaster(self.group, 0, f"shard sender of learner rank {self.rank}")
        setup = json.dumps([{"plan": r.plan.to_json(), "placements": r.rows} for r in self.shards]).encode()
        self.broadcast(torch.tensor([len(setup)], dtype=torch.int64), "the shard layout's size")
        self.broadcast(torch.frombuffer(bytearray(setup), dtype=torch.uint8), "the shard layout")

    def begin(self, version: int, changes: bytes | None = None, kind: int = WHOLE) -> None:
        """Announce `version` of plan `kind`: with `changes` (a delta version, `delta.encode`) they follow at once
        and nothing more of it is sent; otherwise its buckets follow, in plan order, those this rank writes into."""
        if not 0 <= kind < len(self.plans):
            raise ValueError(f"relay of learner rank {self.rank}: version {version} of plan {kind}, expected 0.."
                             f"{len(self.plans) - 1} (1: adapters only, a LoRA run's)")
        if changes is not None and kind != WHOLE:
            raise ValueError(f"relay of learner rank {self.rank}: version {version} as changes of adapters only; "
                             "delta versions carry every tensor's changes")
        if self.broadcast is None:
            self._connect()
        assert self.broadcast is not None
        t0 = time.perf_counter()
        size = -1 if changes is None else len(changes)
        self.kind = kind
        self.broadcast(torch.tensor([version, size, kind], dtype=torch.int64), f"the header of version {version}")
        self.delta_version = version if changes is not None else None
        if changes:
            self.broadcast(torch.frombuffer(bytearray(changes), dtype=torch.uint8), f"the changes of version {version}")
            self.bytes_sent += len(changes)
        self.seconds += time.perf_counter() - t0

    def send_bucket(self, version: int, index: int) -> None:
        """Pack this rank's shards of bucket `index` into the staging buffer and broadcast them (nothing for a
        delta version: its changes went with the header)."""
        assert self.broadcast is not None, "begin(version) first"
        writes = self.writes[self.kind]
        if index not in writes or self.delta_version == version:
            return
        t0 = time.perf_counter()
        dtype, pos = self.plans[self.kind].torch_dtype, 0
        with torch.no_grad():
            for w in writes[index]:
                n = w.source.numel() * dtype.itemsize
                self.staging[pos : pos + n].view(dtype).view(w.source.shape).copy_(w.source)
                pos += n
        self.broadcast(self.staging[:pos], f"bucket {index} of version {version}")
        self.bytes_sent += pos
        self.seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Tell every receiver to stop (only once the group met)."""
        if self.broadcast is not None:
            self.broadcast(torch.tensor([-1, -1, WHOLE], dtype=torch.int64), "the stop message")


class ShardReceiver:
    """On a receiving host: member `member` of learner rank `rank`'s group; writes into that host's transport."""

    def __init__(self, transport: SharedMemoryTransport, group: RelayGroup, member: int, rank: int, world: int,
                 claims: bool) -> None:
        if not 0 < member < group.world:
            raise ValueError(f"receiver member {member}, expected 1..{group.world - 1}")
        self.transport, self.group, self.member, self.rank, self.world, self.claims = \
            transport, group, member, rank, world, claims
        self.broadcast: Broadcaster | None = None
        self.shards: list[RankShards] = []
        """Where the rank's shards go, per plan (`WHOLE`, and `ADAPTERS` in a LoRA run)."""
        self.plan: BucketPlan | None = None
        """The plan of every tensor (what delta versions index)."""
        self.parts: dict[int, RankBucket] = {}
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.received: list[int] = []
        """Versions received (whole or as changes), in order."""
        self.history = DeltaHistory(DELTA_HISTORY)
        self.last_slot: str | None = None
        """The slot this rank's previous version went into (pinned: a delta's fallback copies its shards from it)."""

    def connect(self, stop: threading.Event) -> bool:
        """Wait until the rank sends its first version (or `stop`), meet the group, read the shard layout."""
        store = RunStore(self.group.host, self.group.port, self.group.secret, timedelta(seconds=self.group.timeout_s))
        while not store.check([_ready_key(self.group)]):
            if stop.wait(READY_WAIT_S):
                return False
        self.broadcast = Broadcaster(self.group, self.member, f"shard receiver of learner rank {self.rank}")
        size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size, "the shard layout's size")
        raw = torch.zeros(int(size[0]), dtype=torch.uint8)
        self.broadcast(raw, "the shard layout")
        setup = json.loads(bytes(raw.numpy()).decode())
        self.shards = [RankShards(BucketPlan.from_json(p["plan"]), {int(k): v for k, v in p["placements"].items()})
                       for p in setup]
        self.plan = self.shards[WHOLE].plan
        item = self.plan.torch_dtype.itemsize
        self.parts = {i: RankBucket.of(self.plan.buckets[i], [(name, (shape, stride, offset))
                                                              for name, shape, stride, offset in rows], item)
                      for i, rows in self.shards[WHOLE].rows.items()}
        """Where the rank's shards lie in each bucket (`delta.RankBucket`): what its changes index."""
        self.staging = torch.empty(max(r.staging_bytes() for r in self.shards), dtype=torch.uint8)
        return True

    def receive(self) -> int | None:
        """Block until the rank's next version is in this host's buffers (returns it) or the rank closed (None)."""
        assert self.broadcast is not None and self.plan is not None, "connect() first"
        header = torch.zeros(3, dtype=torch.int64)
        self.broadcast(header, "the version header")
        version, size, kind = (int(x) for x in header)
        if version < 0:
            return None
        if not 0 <= kind < len(self.shards):
            raise SyncError(f"relay of learner rank {self.rank}: version {version} of plan {kind}, but the rank bound "
                            f"{len(self.shards)} plan(s)")
        shards = self.shards[kind]
        delta = self._receive_changes(version, size) if size >= 0 else None
        self.history.record(version, delta)
        slot = self.transport.claim(version, shards.plan, self.rank, self.world, self.group.timeout_s,
                                    claims=self.claims)
        if delta is None:
            elements = self._receive_whole(version, slot, shards)
        else:
            elements = self._apply_changes(version, slot, delta)
        # Pinned before it is complete: once every rank is done a claim could otherwise take it for a newer version
        # before this rank's next changes are applied from it.
        self.transport.pin(f"relay-r{self.rank}", {slot: version})
        self.transport.mark_done(slot, version, self.rank, elements)
        self.transport.log_changes(version, self.rank, None if delta is None else delta.base,
                                   None if delta is None else sorted(delta.names()))
        self.last_slot = slot
        self.received.append(version)
        return version

    def _receive_changes(self, version: int, size: int) -> VersionDelta:
        assert self.broadcast is not None and self.plan is not None
        blob = torch.zeros(size, dtype=torch.uint8)
        if size:
            self.broadcast(blob, f"the changes of version {version}")
        plan = self.plan

        def old_values(index: int, positions: torch.Tensor) -> torch.Tensor:
            """The values at `positions` of bucket `index` in the version this rank sent last (its slot is
            pinned): what a version's varint steps are added to."""
            if self.last_slot is None:
                raise SyncError(f"relay of learner rank {self.rank}: changes arrived before any whole version")
            with self.transport.raw_bucket(self.last_slot, plan.buckets[index], writable=False) as raw:
                return flat_bucket(raw, plan.torch_dtype).index_select(0, positions)  # a copy

        delta = decode(memoryview(blob.numpy()), self.plan, self.parts, old_values)
        if delta.base is None or self.received[-1:] != [delta.base]:
            raise SyncError(f"relay of learner rank {self.rank}: version {version} came as changes against "
                            f"version {delta.base}, which this host does not hold (last received: "
                            f"{self.received[-1:] or 'none'})")
        return delta

    def _receive_whole(self, version: int, slot: str, shards: RankShards) -> dict[int, int]:
        assert self.broadcast is not None
        plan, dtype, item = shards.plan, shards.plan.torch_dtype, shards.plan.torch_dtype.itemsize
        sizes = shards.sizes
        elements: dict[int, int] = {}
        for b in plan.buckets:
            rows = shards.rows.get(b.index)
            if not rows:
                continue
            numel = sizes[b.index]
            staging = self.staging[: sum(numel) * item]
            self.broadcast(staging, f"bucket {b.index} of version {version}")
            with torch.no_grad(), self.transport.bucket_views(slot, b, dtype) as full:
                pos = 0
                for (name, shape, stride, offset), n in zip(rows, numel):
                    _shard_view(full[name], (shape, stride, offset)).copy_(
                        staging[pos : pos + n * item].view(dtype).view(shape))
                    pos += n * item
            elements[b.index] = sum(numel)
        return elements

    def _apply_changes(self, version: int, slot: str, delta: VersionDelta) -> dict[int, int]:
        """Bring this rank's shards in `slot` to `version`: the chain of changes from what the slot held, or (a
        link unknown: a fresh slot, a version between sent whole) its shards copied from the slot its previous
        version went into, then this version's changes."""
        assert self.plan is not None
        chain = self.history.chain(self.transport.slot_base(slot), version)
        if chain is None:  # `_receive_changes` checked that the slot of the last version holds the base
            assert self.last_slot is not None
            self._copy_own(self.last_slot, slot)
            chain = [delta]
        dtype = self.plan.torch_dtype
        with torch.no_grad():
            for b in self.plan.buckets:
                changes = [c for d in chain if (c := d.changes.get(b.index)) is not None]
                if not changes:
                    continue
                with self.transport.raw_bucket(slot, b, writable=True) as raw:
                    flat = flat_bucket(raw, dtype)
                    for c in changes:
                        apply_bucket(flat, c)
        return {i: sum(n) for i, n in self.shards[WHOLE].sizes.items()}

    def _copy_own(self, source: str, slot: str) -> None:
        """This rank's shards (only its own: other ranks' receivers write theirs) from `source` into `slot`."""
        assert self.plan is not None
        dtype = self.plan.torch_dtype
        with torch.no_grad():
            for b in self.plan.buckets:
                rows = self.shards[WHOLE].rows.get(b.index)
                if not rows:
                    continue
                with self.transport.bucket_views(source, b, dtype) as old, \
                        self.transport.bucket_views(slot, b, dtype) as new:
                    for name, *placement in rows:
                        _shard_view(new[name], placement).copy_(_shard_view(old[name], placement))
