"""The relay's private process group: where its members meet (`RelayGroup`) and the broadcast they carry versions
with (`Broadcaster`). sync/shard_relay.py sends each learner rank's shards to the other sync hosts through one such
group per rank (`sync.transport=relay`).

The group is private (its own store and gloo ProcessGroup, not
`torch.distributed`'s global group), so it never mixes with the learner's
collectives. Its store admits only holders of the run's secret
(learner/rendezvous.py) and listens on `RelayGroup.host` only. Gloo carries host memory over TCP; an NCCL relay (buckets
through a device buffer) is not built: no GPU to run it on yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_grpo.learner.rendezvous import RunStore, RunStoreServer
from moe_grpo.sync.transport import SyncError


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


class Broadcaster:
    """Member `rank` of `group`'s gloo group: `broadcast(tensor, what)` sends (rank 0) or receives (the others) one
    tensor; a failure or a broadcast past the group's timeout raises a `SyncError` naming `role`, the member and
    `what` was being broadcast."""

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
