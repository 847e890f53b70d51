"""Choosing a run's weight transport (`sync.transport`): the one place that names the transport classes.

- `make_publisher(where, rank)`: what a learner rank's `WeightSync` writes through;
- `make_receiver(where)`: what an engine's `apply_version` reads through (an engine whose workers span hosts:
  each host's copy, `engine_hosts.py`);
- `shared_memory(root, slots)`: a host's buffers in shared memory (a relay host's agent, `WeightSync`'s default);
- `make_shard_receiver(buffers, layout, rank, host)`: on a relay host, what fills its buffers from learner `rank`;
- `open_bucket(source)`: inside an engine's vLLM worker, the tensors of one bucket the receiver described.

`where` is a `SyncLayout` (a run: the driver computed it from where Ray placed every actor) or a directory
(shared memory at that root: tools and tests on one host).

| transport | publisher (learner rank) | receiver (engine) | worker opens |
|---|---|---|---|
| shm | its host's `SharedMemoryTransport` | the same root | the bucket file, mapped |
| relay | its host's buffers if a sync host, plus `ShardSender` to every other sync host (a delta version: its encoded changes only) | its host's buffers, filled by `ShardReceiver`s there | the bucket file, mapped |
| cuda_ipc | `CudaIpcTransport` (buffers in rank 0's GPU memory) | the same | the buffer, by CUDA IPC handle |
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from moe_grpo.sync.cuda_ipc import CudaIpcTransport, device_views, open_handle
from moe_grpo.sync.engine_hosts import EngineHostsReceiver, own_path
from moe_grpo.sync.layout import SyncLayout
from moe_grpo.sync.plan import DTYPES, Bucket, BucketEntry, BucketPlan
from moe_grpo.sync.shard_relay import ShardReceiver, ShardSender
from moe_grpo.sync.transport import SharedMemoryTransport, WeightReceiver, WeightTransport, read_bucket


def shared_memory(root: str | None = None, slots: int = 2) -> SharedMemoryTransport:
    """A host's buffers in shared memory at `root` (None: the default root) holding `slots` versions."""
    return SharedMemoryTransport(root, slots)


def make_shard_receiver(buffers: SharedMemoryTransport, layout: SyncLayout, rank: int, host: str) -> ShardReceiver:
    """On relay host `host`: what receives learner rank `rank`'s shards into that host's `buffers`."""
    return ShardReceiver(buffers, layout.group(rank), layout.member(rank, host), rank, layout.world,
                         claims=layout.claimer(host) == rank)


def _local(where: SyncLayout | str) -> SharedMemoryTransport:
    if isinstance(where, str):
        return shared_memory(where)
    if where.transport == "cuda_ipc":
        return CudaIpcTransport(where.path(), where.slots)
    return shared_memory(where.path(), where.slots)


def make_publisher(where: SyncLayout | str, rank: int) -> WeightTransport:
    """The transport learner rank `rank` publishes through."""
    if isinstance(where, SyncLayout) and where.transport == "relay" and where.stream_targets(rank):
        return RelayPublisher(where, rank)
    return _local(where)


def make_receiver(where: SyncLayout | str, host_agents: dict[str, Any] | None = None,
                  host: str | None = None) -> WeightReceiver:
    """The transport an engine on this host (`host`) reads through (its host's buffers); with `host_agents` (the
    `SyncHostAgent` of each other host of an engine whose workers span hosts) each worker reads its own host's
    (`engine_hosts.EngineHostsReceiver`)."""
    if host_agents:
        if host is None:
            raise ValueError("make_receiver: an engine spanning hosts needs its own host (Ray node id)")
        return EngineHostsReceiver(_local(where), host, host_agents)
    return _local(where)


class RelayPublisher:
    """A learner rank's publisher under 'relay': its host's buffers when that is a sync host, and its shards
    broadcast to every other sync host (`shard_relay.ShardSender`)."""

    def __init__(self, layout: SyncLayout, rank: int) -> None:
        host = layout.rank_hosts[rank]
        self.layout, self.rank = layout, rank
        self.local = shared_memory(layout.path(), layout.slots) if layout.writes_locally(rank) else None
        self.claims = layout.claimer(host) == rank
        self.sender: Any = None

    @property
    def writes_locally(self) -> bool:
        return self.local is not None

    def check_room(self, version_bytes: int, later_bytes: int | None = None) -> None:
        if self.local is not None:
            self.local.check_room(version_bytes, later_bytes)

    def bind(self, plan: BucketPlan, writes: dict[int, list[Any]], adapter_plan: BucketPlan | None = None,
             adapter_writes: dict[int, list[Any]] | None = None) -> None:
        """The rank's shard writes (fixed for the run; with LoRA also those of its adapter-only versions): their
        places are sent once, when the group meets."""
        self.sender = ShardSender(self.layout.group(self.rank), self.rank, plan, writes, adapter_plan, adapter_writes)

    def claim(self, version: int, plan: BucketPlan, rank: int, world: int, timeout_s: float = 60.0, *,
              changes: bytes | None = None) -> str:
        """Announce `version` to the other sync hosts (with `changes`: a delta version, sent at once) and claim
        this host's slot for it ("" when this host holds no copy)."""
        if self.sender is None:
            raise RuntimeError("RelayPublisher.bind(plan, writes) must come before the first claim")
        self.sender.begin(version, changes, self.sender.kind_of(plan))
        if self.local is None:
            return ""
        return self.local.claim(version, plan, rank, world, timeout_s, claims=self.claims)

    def slot_base(self, slot: str) -> int | None:
        return self.local.slot_base(slot) if self.local is not None and slot else None

    def log_changes(self, version: int, rank: int, base: int | None, names: list[str] | None) -> None:
        if self.local is not None:
            self.local.log_changes(version, rank, base, names)

    def bucket_views(self, slot: str, bucket: Bucket, dtype: torch.dtype) -> Any:
        assert self.local is not None, "a rank on a host without engines writes nothing locally"
        return self.local.bucket_views(slot, bucket, dtype)

    def raw_bucket(self, slot: str, bucket: Bucket, writable: bool) -> Any:
        assert self.local is not None, "a rank on a host without engines writes nothing locally"
        return self.local.raw_bucket(slot, bucket, writable)

    def forward_bucket(self, version: int, bucket: Bucket) -> None:
        self.sender.send_bucket(version, bucket.index)

    def mark_done(self, slot: str, version: int, rank: int, elements: dict[int, int]) -> None:
        if self.local is not None:
            self.local.mark_done(slot, version, rank, elements)

    def read_version(self, version: int, timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
        if self.local is None:
            raise RuntimeError(f"learner rank {self.rank}'s host holds no copy of the versions (no engine, not "
                               "rank 0's host); read them on rank 0")
        return self.local.read_version(version, timeout_s)

    def close_relay(self) -> None:
        """Tell this rank's receivers there is nothing more (a run's end may also just stop them)."""
        if self.sender is not None:
            self.sender.close()


@contextlib.contextmanager
def open_bucket(source: dict[str, Any]) -> Iterator[dict[str, torch.Tensor]]:
    """The HF-named tensors of one bucket a receiver described (`bucket_sources`), without a copy."""
    bucket = Bucket(0, tuple(BucketEntry(n, tuple(s), o) for n, s, o in source["entries"]), int(source["nbytes"]))
    dtype = DTYPES[source["dtype"]]
    if source["kind"] == "shm":
        with read_bucket(own_path(source), bucket, dtype) as tensors:
            yield tensors
    elif source["kind"] == "cuda_ipc":
        yield device_views(open_handle(source["handle"]), bucket, dtype)
    else:
        raise ValueError(f"bucket source of kind {source['kind']!r}, expected 'shm' or 'cuda_ipc'")
