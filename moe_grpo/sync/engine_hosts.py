"""The receiving side of an engine whose vLLM workers are on several hosts (pipeline stages across nodes, vLLM's Ray
executor): each worker reads its own host's copy of a version.

Every host of such an engine is a sync host (`SyncLayout.engine_worker_hosts`): the relay delivers each version to
it once, whatever number of the engine's workers it holds. The engine's actor runs on one of them (stage 0's) and
reads its buffers as any engine does; for each other host it asks that host's `SyncHostAgent`
(orchestrator/sync_hosts.py) to wait for the version to be complete there and to pin it for the engine. Each bucket
the workers are handed names its file on every host (`paths`, by Ray node id); a worker opens its own node's
(`transports.open_bucket`), a worker that is no Ray actor (the multiprocessing executor: every worker on the
actor's host) the actor's host's (`path`).

A delta version is reloaded whole here (no `changed_since`): which tensors changed is known per host, and the
engine's hosts are asked only for complete versions.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from moe_grpo.sync.plan import BucketPlan
from moe_grpo.sync.transport import WeightReceiver, shm_bucket_sources


class EngineHostsReceiver:
    """A `WeightReceiver` over the engine actor's host (`local`) and its workers' other hosts (`agents`: host ->
    something with `complete(version, timeout_s) -> slot`, `pin(engine_id, slots)` and `unpin(engine_id)`, called
    through `call`: a Ray actor handle's methods with `ray.get`, or plain objects in tests)."""

    def __init__(self, local: WeightReceiver, local_host: str, agents: dict[str, Any],
                 call: Callable[[Any, str, tuple], Any] | None = None) -> None:
        self.local, self.local_host, self.agents = local, local_host, dict(agents)
        self._call = call or _ray_call
        self._slots: dict[int, dict[str, str]] = {}
        """version -> host -> that host's slot of it (the version's buffers there)."""

    @property
    def root(self) -> Any:
        return self.local.root  # type: ignore[attr-defined]

    def wait_complete(self, version: int, timeout_s: float) -> tuple[str, BucketPlan]:
        """The actor's host's slot and plan once `version` is complete on every host of the engine."""
        slot, plan = self.local.wait_complete(version, timeout_s)
        slots = {self.local_host: slot}
        for host, agent in self.agents.items():
            slots[host] = self._call(agent, "complete", (version, timeout_s))
        self._slots[version] = slots
        return slot, plan

    def _version_of(self, slot: str) -> int:
        for version, slots in self._slots.items():
            if slots[self.local_host] == slot:
                return version
        raise KeyError(f"slot {slot} was not waited for on the engine's hosts (wait_complete first)")

    def bucket_sources(self, slot: str, plan: BucketPlan) -> list[dict]:
        """The actor's host's bucket sources, each with `paths`: its file on every host of the engine."""
        hosts = self._slots[self._version_of(slot)]
        per_host = {host: shm_bucket_sources(host_slot, plan) for host, host_slot in hosts.items()}
        out = []
        for i, source in enumerate(self.local.bucket_sources(slot, plan)):
            out.append({**source, "paths": {host: sources[i]["path"] for host, sources in per_host.items()}})
        return out

    def pin(self, engine_id: str, slots: dict[str, int]) -> None:
        """Pin the versions of `slots` (actor's host's slot -> version) on every host of the engine."""
        self.local.pin(engine_id, slots)
        for host, agent in self.agents.items():
            self._call(agent, "pin", (engine_id, {self._slots[v][host]: v for v in slots.values()}))
        newest = max(slots.values(), default=0)  # what is pinned, and what may be pinned next, is kept
        self._slots = {v: s for v, s in self._slots.items() if v in slots.values() or v > newest}

    def unpin(self, engine_id: str) -> None:
        """Unpin on every host; an agent already gone (the run's end) has nothing left to keep."""
        self.local.unpin(engine_id)
        for agent in self.agents.values():
            with contextlib.suppress(Exception):
                self._call(agent, "unpin", (engine_id,))


def _ray_call(agent: Any, method: str, args: tuple) -> Any:
    import ray

    return ray.get(getattr(agent, method).remote(*args), timeout=max(60.0, float(args[1]) + 30.0)
                   if method == "complete" else 60.0)


def worker_node() -> str | None:
    """This process's Ray node id when it is a Ray worker (a vLLM worker of the Ray executor), else None."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not a Ray process: the actor's host's path applies
        return None


def own_path(source: dict[str, Any], node: Callable[[], str | None] = worker_node) -> str:
    """The file of a bucket on this worker's node (`node()`, its entry in `paths`), else the engine actor's host's
    (`path`): a source without `paths` (an engine on one host) never asks which node this is."""
    if "paths" not in source:
        return source["path"]
    return source["paths"].get(node(), source["path"])
