"""The run's weight transport on the Ray cluster: which host each actor landed on, and one agent per sync host.

`plan_sync` turns the placement group's bundle -> node table into a `SyncLayout` (a host is a Ray node). Under
the relay (`sync.transport=relay`, or `auto` on more than one node), `start_sync_hosts` starts a `SyncHostAgent`
on every sync host before the learner ranks: the one on learner rank 0's host serves the store the relay groups
meet in; each agent removes what SIGKILLed runs left on its host, creates its host's buffer directory for the run,
runs one `ShardReceiver` thread per learner rank that relays shards to it (sync/shard_relay.py), and removes the
directory when the run ends. On one host
(shm, cuda_ipc) nothing is started: the driver keeps the buffers itself, as it always did.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_grpo.learner.rendezvous import RunStoreServer
from moe_grpo.orchestrator.run_dirs import make_owned_dir, release, remove_orphaned_sync_roots
from moe_grpo.process_ties import remove_recorded_shm
from moe_grpo.sync.layout import SyncLayout, host_root, resolve_transport
from moe_grpo.sync.transport import secure_root
from moe_grpo.sync.transports import make_shard_receiver, shared_memory

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig

log = logging.getLogger("moe_grpo")


def plan_sync(run: RunConfig, placement_group: Any, run_name: str, engine_groups: list[Any] | None = None) -> SyncLayout:
    """The run's `SyncLayout`: engines are bundles 0..num_engines-1, learner rank r is bundle num_engines + r;
    `engine_groups`: per engine its own placement group when its stages span nodes (its workers' hosts)."""
    import ray

    nodes = ray.util.placement_group_table(placement_group)["bundles_to_node_id"]
    c, world = run.cluster, run.learner_world_size()
    engine_hosts = tuple(nodes[i] for i in range(c.num_engines))
    rank_hosts = tuple(nodes[c.num_engines + r] for r in range(world))
    worker_hosts = tuple(_group_hosts(g) for g in engine_groups) if engine_groups else ()
    all_hosts = set(engine_hosts + rank_hosts).union(*map(set, worker_hosts))
    transport = resolve_transport(run.sync.transport, len(all_hosts))
    return SyncLayout(transport, run_name, rank_hosts, engine_hosts, run.sync.root, run.sync.slots,
                      timeout_s=run.sync.relay_timeout_s, engine_worker_hosts=worker_hosts)


def _group_hosts(group: Any) -> tuple[str, ...]:
    """The host of each bundle of an engine's own placement group (None: the engine has none)."""
    import ray

    if group is None:
        return ()
    table = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return tuple(table[i] for i in range(len(table)))


def engine_host_agents(layout: SyncLayout, agents: list[Any], engine: int) -> dict[str, Any] | None:
    """The `SyncHostAgent` of each host of engine `engine`'s workers other than its own (None: all on its
    host). Raises naming the host when the relay has no agent there."""
    others = layout.worker_hosts(engine)
    if not others:
        return None
    by_host = dict(zip(layout.hosts, agents))
    missing = [h for h in others if h not in by_host]
    if missing:
        raise RuntimeError(f"engine{engine}'s workers are on host(s) {', '.join(missing)} without a weight relay "
                           f"agent (sync.transport={layout.transport}); they could not read the versions there")
    return {h: by_host[h] for h in others}


class SyncHostAgent:
    """One per sync host of a relay run (a Ray actor pinned to that node)."""

    def __init__(self, layout: SyncLayout, host: str, serve_store: bool) -> None:
        self.layout, self.host = layout, host
        root = host_root(layout.root)
        secure_root(root)
        remove_orphaned_sync_roots(root)  # what SIGKILLed runs left on this host
        # Held by this agent for as long as it lives (with the driver, on the driver's host): a sweep by another run
        # here removes it only once both are gone (run_dirs.py).
        path = Path(make_owned_dir(root, lambda: layout.run_name, existing_ok=True))
        self.transport = shared_memory(str(path), layout.slots)  # checked private like any root
        self.server = None
        if serve_store:
            import ray

            self.server = RunStoreServer(ray.util.get_node_ip_address(), 0, layout.secret)
        self.stop = threading.Event()
        self.receivers: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.threads: list[threading.Thread] = []

    def address(self) -> tuple[str, int]:
        """Where the relay groups' store listens (this node's address, a free port)."""
        assert self.server is not None
        return self.server.host, self.server.port

    def start(self, layout: SyncLayout) -> list[int]:
        """Receive, in a thread each, every learner rank that relays shards here; returns those ranks."""
        self.layout = layout
        for rank in layout.streams_into(self.host):
            receiver = make_shard_receiver(self.transport, layout, rank, self.host)
            self.receivers[rank] = receiver
            thread = threading.Thread(target=self._receive, args=(rank, receiver), daemon=True,
                                      name=f"moe_grpo-shards-r{rank}")
            thread.start()
            self.threads.append(thread)
        return sorted(self.receivers)

    def _receive(self, rank: int, receiver: Any) -> None:
        try:
            if not receiver.connect(self.stop):
                return
            while not self.stop.is_set() and receiver.receive() is not None:
                pass
        except Exception as e:  # noqa: BLE001 - kept for the driver (`received`), the engines here time out naming the rank
            self.errors[rank] = f"{type(e).__name__}: {e}"
            if not self.stop.is_set():
                log.error("host %s: relay of learner rank %d failed: %s", self.host[:8], rank, e)

    def complete(self, version: int, timeout_s: float) -> str:
        """This host's slot of `version` once it is complete here (an engine whose workers span hosts asks each
        of its hosts: sync/engine_hosts.py)."""
        slot, _ = self.transport.wait_complete(version, timeout_s)
        return slot

    def pin(self, engine_id: str, slots: dict[str, int]) -> None:
        """Keep these slots of this host for engine `engine_id` (its workers here read them)."""
        self.transport.pin(engine_id, slots)

    def unpin(self, engine_id: str) -> None:
        self.transport.unpin(engine_id)

    def received(self) -> dict[str, Any]:
        """{"versions": {rank: versions received whole, in order}, "errors": {rank: message}, "root": directory}."""
        return {"versions": {r: list(rec.received) for r, rec in self.receivers.items()}, "errors": dict(self.errors),
                "root": str(self.transport.root)}

    def close(self, engines_stopped: bool = False) -> list[str]:
        """Stop receiving and remove this host's buffers of the run, with what this host's engines recorded in
        /dev/shm and did not remove (their records lie in these buffers: the driver's cleanup never sees another
        host's); returns those /dev/shm names. `engines_stopped`: the run's engines were shut down (or killed), so
        every record left is an engine's that did not remove its own; else only dead engines' records are acted on."""
        self.stop.set()
        removed = remove_recorded_shm(str(self.transport.root), dead_holders_only=not engines_stopped)
        shutil.rmtree(self.transport.root, ignore_errors=True)
        release(str(self.transport.root))
        return removed


def start_sync_hosts(layout: SyncLayout) -> tuple[SyncLayout, list[Any]]:
    """Under the relay: an agent on every sync host (the store first), returns the layout with the store's address
    and the agents. Otherwise nothing to start."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if layout.transport != "relay" or not any(layout.stream_targets(r) for r in range(layout.world)):
        return layout, []  # every rank writes where the engines read: nothing to relay

    layout = dataclasses.replace(layout, secret=secrets.token_hex(32))
    agent_cls = ray.remote(SyncHostAgent)

    def on(host: str, serve: bool) -> Any:
        return agent_cls.options(num_cpus=0, max_concurrency=4, scheduling_strategy=NodeAffinitySchedulingStrategy(
            host, soft=False)).remote(layout, host, serve)

    agents = [on(layout.hosts[0], True)]
    layout = dataclasses.replace(layout, store=tuple(ray.get(agents[0].address.remote(), timeout=120)))
    agents += [on(host, False) for host in layout.hosts[1:]]
    ranks = ray.get([a.start.remote(layout) for a in agents], timeout=120)
    log.info("weight relay: %d sync host(s); learner ranks relayed to each: %s", len(agents),
             ", ".join(f"{h[:8]}<-{r}" for h, r in zip(layout.hosts, ranks)))
    return layout, agents


def relay_report(layout: SyncLayout | None, agents: list[Any]) -> dict[str, Any]:
    """What the run's summary says about the transport: which one, on how many hosts, and under the relay what
    each sync host received (per learner rank, the versions that arrived whole, in order; and any failure)."""
    import ray

    if layout is None:
        return {}
    out: dict[str, Any] = {"transport": layout.transport, "hosts": len(layout.hosts),
                           "rank_hosts": [layout.hosts.index(h) if h in layout.hosts else -1 for h in layout.rank_hosts]}
    if agents:
        try:
            got = ray.get([a.received.remote() for a in agents], timeout=30)
        except Exception as e:  # noqa: BLE001 - a dead agent: say so rather than lose the summary
            got = [{"errors": {"agent": f"{type(e).__name__}: {e}"}}] * len(agents)
        out["received"] = {i: g.get("versions", {}) for i, g in enumerate(got)}
        out["errors"] = {i: g["errors"] for i, g in enumerate(got) if g.get("errors")}
    return out


def stop_sync_hosts(agents: list[Any], *, engines_stopped: bool = False) -> list[str]:
    """Every agent removes its host's buffers of the run (bounded: a dead agent's host keeps them until the next
    run there sweeps them); returns the /dev/shm entries engines left that they removed with them
    (`SyncHostAgent.close`)."""
    import ray

    if not agents:
        return []
    ready, _ = ray.wait([a.close.remote(engines_stopped) for a in agents], num_returns=len(agents), timeout=30)
    removed: list[str] = []
    for ref in ready:
        try:
            removed += ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - an agent that died: its host's sweep removes them later
            pass
    return sorted(removed)
