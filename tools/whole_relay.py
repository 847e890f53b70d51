"""A whole-version relay over the run's relay group, for tools/bench_sync.py `--relay` and the relay's tests
(tests/sync/test_relay.py, tests/sync/test_sync.py): not what runs use (they relay each learner rank's shards,
moe_grpo/sync/shard_relay.py), but the same private group and broadcast (moe_grpo/sync/relay.py).

A sender next to the learner reads each complete version from its `SharedMemoryTransport` and broadcasts it bucket by
bucket to one receiver per other host; the receiver writes the bytes straight into that host's own transport (the
broadcast lands in the mapped bucket file), and engines there apply it as usual (`deliver.apply_version`), with the
same checks and all-or-nothing load. A receiver marks a version done only after its last bucket arrived, so a relay
that dies mid-version leaves nothing an engine would apply.
"""

from __future__ import annotations

import time

import torch

from moe_grpo.sync.plan import BucketPlan
from moe_grpo.sync.relay import Broadcaster, RelayGroup
from moe_grpo.sync.transport import SharedMemoryTransport


class RelaySender:
    """Rank 0 of the relay group, on the learner's host."""

    def __init__(self, transport: SharedMemoryTransport, group: RelayGroup) -> None:
        self.transport = transport
        self.broadcast = Broadcaster(group, 0, "sender")

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
        self.broadcast = Broadcaster(group, rank, "receiver")

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
