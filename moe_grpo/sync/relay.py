"""Carry published versions to engines on other hosts: a broadcast over a private process group.

Shared memory serves the engines on the learner's host. For the others, a
relay next to the learner reads each complete version from its
`SharedMemoryTransport` and broadcasts it bucket by bucket to one receiver
per engine host; the receiver writes the bytes straight into that host's own
`SharedMemoryTransport` (the broadcast lands in the mapped bucket file), and
the engines there apply it as usual (`deliver.apply_version`), with the same
checks and all-or-nothing load. A receiver marks a version done only after
its last bucket arrived, so a relay that dies mid-version leaves nothing an
engine would apply.

The group is private (its own store and gloo ProcessGroup, not
`torch.distributed`'s global group), so it never mixes with the learner's
collectives. Its store admits only holders of the run's secret
(learner/rendezvous.py) and listens on `RelayGroup.host` only. Gloo carries host memory over TCP; an NCCL relay (buckets
through a device buffer) is not built: no GPU to run it on yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moe_grpo.learner.rendezvous import RunStore, RunStoreServer
from moe_grpo.sync.plan import BucketPlan
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError


@dataclass(frozen=True)
class RelayGroup:
    """Where the relay's group meets: the sender is rank 0, receivers are ranks 1..world-1."""

    host: str
    """The address the sender's store listens on (only that interface): loopback when every member is on its host."""
    port: int
    world: int
    """1 sender + one receiver per engine host."""
    secret: str
    """The run's secret (secrets.token_hex(32), handed to every member through Ray): the store admits no one else."""
    timeout_s: float = 120.0
    """How long any broadcast may take before the group fails (names the part in the error)."""
    prefix: str = ""
    """'' : the sender serves the group's store itself; otherwise the group meets under this prefix in a store
    someone else serves at host:port (one per run, for every learner rank's shard group)."""

    def __post_init__(self) -> None:
        if self.world < 2:
            raise ValueError(f"RelayGroup.world={self.world}, expected at least 2 (a sender and a receiver)")
        if len(self.secret) < 32:
            raise ValueError(f"RelayGroup.secret of {len(self.secret)} characters, expected at least 32 "
                             "(secrets.token_hex(16) or longer)")

    def __repr__(self) -> str:  # never print the secret
        return (f"RelayGroup(host={self.host!r}, port={self.port}, world={self.world}, timeout_s={self.timeout_s}, "
                f"prefix={self.prefix!r})")


class _Broadcaster:
    def __init__(self, group: RelayGroup, rank: int, role: str) -> None:
        self.group, self.rank, self.role = group, rank, role
        timeout = timedelta(seconds=group.timeout_s)
        # The sender serves the store (kept as long as the group: gloo's pairs were set up through it).
        self.server = RunStoreServer(group.host, group.port, group.secret) if rank == 0 and not group.prefix else None
        self.store = RunStore(group.host, group.port, group.secret, timeout)
        store = dist.PrefixStore(group.prefix, self.store) if group.prefix else self.store
        self.pg = dist.ProcessGroupGloo(store, rank, group.world, timeout)

    def __call__(self, tensor: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            self.pg.broadcast([tensor], opts).wait(timedelta(seconds=self.group.timeout_s))
        except Exception as e:
            raise SyncError(f"relay {self.role} (rank {self.rank} of {self.group.world} at {self.group.host}:"
                            f"{self.group.port}) failed while broadcasting {what}: {e}") from e


class RelaySender:
    """Rank 0 of the relay group, on the learner's host."""

    def __init__(self, transport: SharedMemoryTransport, group: RelayGroup) -> None:
        self.transport = transport
        self.broadcast = _Broadcaster(group, 0, "sender")

    def send(self, version: int, *, wait_s: float = 60.0) -> dict[str, float]:
        """Broadcast a complete version to every receiver; returns bytes and seconds."""
        slot, plan = self.transport.wait_complete(version, wait_s)
        t0 = time.perf_counter()
        header = torch.frombuffer(bytearray(plan.to_json().encode()), dtype=torch.uint8)
        self.broadcast(torch.tensor([version, header.numel()], dtype=torch.int64), "the version header")
        self.broadcast(header, f"the plan of version {version}")
        for b in plan.buckets:
            with self.transport.raw_bucket(slot, b, writable=False) as raw:
                self.broadcast(raw, f"bucket {b.index} of version {version}")
        return {"relay/bytes": float(plan.total_bytes), "relay/seconds": time.perf_counter() - t0}

    def close(self) -> None:
        """Tell every receiver to stop."""
        self.broadcast(torch.tensor([-1, 0], dtype=torch.int64), "the stop message")


class RelayReceiver:
    """Ranks 1.. of the relay group, one per engine host; writes into that host's transport."""

    def __init__(self, transport: SharedMemoryTransport, group: RelayGroup, rank: int) -> None:
        if not 0 < rank < group.world:
            raise ValueError(f"receiver rank {rank}, expected 1..{group.world - 1}")
        self.transport = transport
        self.broadcast = _Broadcaster(group, rank, "receiver")

    def receive(self) -> int | None:
        """Block until the next version arrived whole (returns it) or the sender closed (None)."""
        meta = torch.zeros(2, dtype=torch.int64)
        self.broadcast(meta, "the version header")
        version, size = int(meta[0]), int(meta[1])
        if version < 0:
            return None
        header = torch.zeros(size, dtype=torch.uint8)
        self.broadcast(header, f"the plan of version {version}")
        plan = BucketPlan.from_json(bytes(header.numpy()).decode())
        slot = self.transport.claim(version, plan, 0, 1)
        for b in plan.buckets:
            with self.transport.raw_bucket(slot, b, writable=True) as raw:
                self.broadcast(raw, f"bucket {b.index} of version {version}")
        self.transport.mark_done(slot, version, 0, {b.index: sum(e.numel for e in b.entries) for b in plan.buckets})
        return version
