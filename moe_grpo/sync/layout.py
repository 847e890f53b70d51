"""Where a run's weight versions are written and read: one record the driver computes once from where Ray placed
each actor, handed to every learner rank, engine and host agent (pure data, no Ray).

A host is a Ray node. Each host keeps its own buffers under its own root (`host_root`), so two `ray start`
nodes on one machine with different `MOE_GRPO_SYNC_ROOT` behave as two hosts. The hosts that hold a complete
copy of each version ("sync hosts") are learner rank 0's host (the exports read it there) and every host with an
engine. Each learner rank writes its shards straight into its own host's buffers when its host is a sync host,
and (transport 'relay') broadcasts them to every other sync host, where a receiver scatters them into that
host's buffers: every sync host assembles each version once, from every rank's shards, with no host holding
more than its own buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moe_grpo.sync.config import ROOT_ENV
from moe_grpo.sync.relay import RelayGroup
from moe_grpo.sync.transport import default_root


def host_root(root: str | None = None) -> str:
    """This host's weight-buffer directory: `root` (sync.root), else $MOE_GRPO_SYNC_ROOT, else the default."""
    return root or os.environ.get(ROOT_ENV) or default_root()


@dataclass(frozen=True)
class SyncLayout:
    """A run's transport and which host every learner rank and engine is on."""

    transport: str
    """'shm', 'relay' or 'cuda_ipc' (resolved: never 'auto')."""
    run_name: str
    """The run's directory under each host's root (`run-<driver pid>-<time>`)."""
    rank_hosts: tuple[str, ...]
    """Host (Ray node id) of each learner rank, rank order."""
    engine_hosts: tuple[str, ...]
    """Host of each engine (placement bundle order)."""
    root: str | None = None
    """sync.root (None: each host's $MOE_GRPO_SYNC_ROOT or the default)."""
    slots: int = 2
    store: tuple[str, int] = ("", 0)
    """Where the relay groups meet (a store served by the agent on learner rank 0's host); relay only."""
    secret: str = field(default="", repr=False)
    """The run's secret for that store."""
    timeout_s: float = 300.0
    engine_worker_hosts: tuple[tuple[str, ...], ...] = ()
    """Per engine, the hosts of its vLLM workers when its pipeline stages span hosts (vLLM's Ray executor), its
    own host first; empty (or an empty entry): every worker on the engine's host. Each is a sync host: it receives
    every version once, and the engine's workers there read that host's copy (sync/engine_hosts.py)."""

    def __post_init__(self) -> None:
        if self.transport not in ("shm", "relay", "cuda_ipc"):
            raise ValueError(f"SyncLayout.transport={self.transport!r}, expected 'shm', 'relay' or 'cuda_ipc'")
        if not self.rank_hosts:
            raise ValueError("SyncLayout.rank_hosts is empty, expected the host of every learner rank")
        if self.transport != "relay" and len(set(self.rank_hosts + self.hosts)) > 1:
            raise ValueError(f"sync.transport={self.transport} needs every learner rank and engine on one host "
                             f"(each engine's workers too); this run spans {len(set(self.rank_hosts + self.hosts))} hosts "
                             f"(use sync.transport=relay or auto)")

    @property
    def world(self) -> int:
        return len(self.rank_hosts)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The sync hosts: learner rank 0's host first, then every other engine host, in bundle order (an engine
        spanning hosts: its workers' hosts after its own)."""
        spans = [h for i, e in enumerate(self.engine_hosts) for h in (e, *self.worker_hosts(i))]
        return tuple(dict.fromkeys((self.rank_hosts[0], *spans)))

    def worker_hosts(self, engine: int) -> tuple[str, ...]:
        """The hosts of engine `engine`'s workers other than its own host (empty: all on its host)."""
        hosts = self.engine_worker_hosts[engine] if engine < len(self.engine_worker_hosts) else ()
        return tuple(h for h in dict.fromkeys(hosts) if h != self.engine_hosts[engine])

    def local_ranks(self, host: str) -> list[int]:
        return [r for r, h in enumerate(self.rank_hosts) if h == host]

    def local_rank(self, rank: int) -> int:
        """The rank's index among the learner ranks on its host (LOCAL_RANK)."""
        return self.local_ranks(self.rank_hosts[rank]).index(rank)

    def writes_locally(self, rank: int) -> bool:
        """Whether the rank writes its shards into its own host's buffers (its host is a sync host)."""
        return self.rank_hosts[rank] in self.hosts

    def stream_targets(self, rank: int) -> tuple[str, ...]:
        """The sync hosts the rank's shards are relayed to (all but its own)."""
        return tuple(h for h in self.hosts if h != self.rank_hosts[rank])

    def claimer(self, host: str) -> int:
        """The learner rank whose writer claims each version's slot on `host`: its lowest local rank, or (a host
        with no learner rank) rank 0, whose relayed shards arrive there."""
        local = self.local_ranks(host)
        return local[0] if local else 0

    def streams_into(self, host: str) -> list[int]:
        """The learner ranks whose shards are relayed into `host`."""
        return [r for r in range(self.world) if host in self.stream_targets(r)]

    def group(self, rank: int) -> RelayGroup:
        """The rank's relay group: the rank is member 0, the receivers on `stream_targets(rank)` are 1.."""
        return RelayGroup(self.store[0], self.store[1], 1 + len(self.stream_targets(rank)), self.secret,
                          timeout_s=self.timeout_s, prefix=f"shards{rank}")

    def member(self, rank: int, host: str) -> int:
        """The receiver on `host`'s place in `group(rank)`."""
        return 1 + self.stream_targets(rank).index(host)

    def path(self) -> str:
        """This host's directory of the run's buffers (call it on the host in question)."""
        return os.path.join(host_root(self.root), self.run_name)


def resolve_transport(transport: str, hosts: int) -> str:
    """`sync.transport` for a run whose actors are on `hosts` hosts: 'auto' is 'shm' on one host, 'relay' beyond."""
    if transport == "auto":
        return "shm" if hosts == 1 else "relay"
    if transport in ("shm", "cuda_ipc") and hosts > 1:
        raise ValueError(f"sync.transport={transport}: the run's learner ranks and engines were placed on {hosts} "
                         f"hosts (Ray nodes), and {transport} reaches only one; use sync.transport=relay or auto")
    return transport
