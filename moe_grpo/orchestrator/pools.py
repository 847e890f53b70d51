"""Ray and the two pools: placement groups reserve each pool's resources, one actor per engine and per learner rank."""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class EngineFactory:
    """Starts the engine actor of one placement bundle (at start, and again when an engine's actor died)."""

    run: Any
    run_dir: str
    sync: Any
    """The run's `SyncLayout`: where each engine's versions arrive."""
    model_dir: str
    """The model directory engines start from (version 0)."""
    placement_group: Any

    def __call__(self, bundle: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from moe_grpo.orchestrator.engine_actor import EngineWorker

        c = self.run.cluster
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=bundle)
        return ray.remote(EngineWorker).options(
            num_cpus=c.engine_cpus, num_gpus=c.engine_gpus, scheduling_strategy=strategy, max_concurrency=10_000,
        ).remote(f"engine{bundle}", self.model_dir, self.run.model, self.run.rollout, self.run_dir, self.sync,
                 _cores(c, bundle, c.engine_cpus, 0), self.run.seed + bundle, self.run.lora, self.run.sync.lora_apply)


@dataclass
class Pools:
    engines: list[tuple[str, Any]]
    """(name, actor handle) per vLLM engine, as started."""
    learners: list[Any]
    """Actor handle per learner rank, rank order."""
    infos: list[dict[str, Any]]
    """Per learner rank: its Megatron coordinates (dp, dp_size, ...)."""
    placement_group: Any
    make_engine: EngineFactory | None = None
    """Starts a replacement engine actor in a given bundle."""
    engine_pids: list[int] | None = None
    """Each engine's vLLM engine-core process."""
    sync: Any = None
    """The run's `SyncLayout` (transport, each actor's host)."""
    sync_agents: list[Any] | None = None
    """One `SyncHostAgent` per sync host under the relay (orchestrator/sync_hosts.py); empty on one host."""

    @property
    def dp_size(self) -> int:
        return int(self.infos[0]["dp_size"])


def start_ray(cluster: Any, run_dir: str) -> str | None:
    """Start a Ray cluster of this run's own (or join `cluster.ray_address` when it names one); returns the run's
    private directory (Ray's temp dir and vLLM's RPC sockets, 0700) that `stop_pools` removes, or None when joining.

    A local cluster is started with `address="local"`, so neither RAY_ADDRESS nor a `ray_current_cluster` file in
    the shared /tmp/ray attaches the run to another job's cluster, and on loopback (its node's address 127.0.0.1,
    ray_loopback.py): it is this host alone, and its servers listen where only this host reaches them."""
    import ray

    from moe_grpo.orchestrator.ray_loopback import loopback_node
    from moe_grpo.orchestrator.run_dirs import make_private_dir, remove_orphaned_private_dirs

    if ray.is_initialized():
        return None
    kwargs: dict[str, Any] = dict(logging_level=logging.WARNING, include_dashboard=False, log_to_driver=True)
    private = None
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, **kwargs)
    else:
        remove_orphaned_private_dirs()
        private = make_private_dir()
        rpc = os.path.join(private, "vllm")
        os.mkdir(rpc, 0o700)
        try:
            with loopback_node():
                ray.init(address="local", num_cpus=os.cpu_count() or 2, _temp_dir=os.path.join(private, "ray"),
                         runtime_env={"env_vars": {"VLLM_RPC_BASE_PATH": rpc}}, **kwargs)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
    try:  # Ray's own logs stay in its session directory; point at them from the run directory
        session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001 - no public accessor
        link = os.path.join(run_dir, "ray_logs")
        if not os.path.lexists(link):
            os.symlink(os.path.join(session, "logs"), link)
    except Exception:
        pass
    return private


def _cores(cluster: Any, index: int, per: float, offset: int) -> list[int] | None:
    if not cluster.pin_cpus:
        return None
    n = max(1, int(per))
    first = offset + index * n
    available = sorted(os.sched_getaffinity(0))
    if first + n > len(available):
        raise ValueError(f"cluster.pin_cpus: actor {index} needs cores {first}..{first + n - 1}, "
                         f"but this host has {len(available)}")
    return available[first : first + n]


def _rendezvous(single_host: bool) -> tuple[str, int]:
    """Where learner rank 0 serves the run's store: loopback when the whole run is on one host (no other host needs
    to reach it), this node's address otherwise."""
    import ray

    from moe_grpo.learner.spawn import free_port

    return ("127.0.0.1" if single_host else ray.util.get_node_ip_address()), free_port()


def single_host() -> bool:
    """Whether the Ray cluster is this one machine (then every run port binds to loopback)."""
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) == 1


def start_pools(run: Any, run_dir: str, sync_name: str, model_dir_fn: Any, learner_cls: type | None = None,
                bundle_nodes: list[str | None] | None = None) -> Pools:
    """Learner ranks first (they build the initial weights), then engines on `model_dir_fn(learners)`.

    `sync_name`: the run's directory under each host's weight-buffer root. Once Ray placed the bundles, the
    weight transport is planned from where they landed, and under the relay its host agents start first.

    `learner_cls` replaces `LearnerWorker` (a subclass; tests slow it down on purpose). `bundle_nodes`: the host
    each bundle (engines, then learner ranks) must be reserved on, from the placement plan; None lets Ray pack."""
    import ray
    from ray.util.placement_group import placement_group

    c = run.cluster
    world = run.learner_world_size()
    bundles = ([{"CPU": c.engine_cpus, **({"GPU": c.engine_gpus} if c.engine_gpus else {})}] * c.num_engines
               + [{"CPU": c.learner_cpus, **({"GPU": c.learner_gpus} if c.learner_gpus else {})}] * world)
    if bundle_nodes is not None:
        from moe_grpo.orchestrator.placement_plan import pin_bundles

        bundles = pin_bundles(bundles, bundle_nodes, ray.nodes())
    pg = placement_group(bundles, strategy="PACK")
    if not pg.wait(timeout_seconds=c.start_timeout_s):
        raise RuntimeError(f"Ray could not reserve {bundles} within {c.start_timeout_s:.0f} s "
                           f"(cluster has {ray.cluster_resources()}); lower cluster.* resources or add nodes")

    from moe_grpo.orchestrator.sync_hosts import plan_sync, start_sync_hosts

    layout, agents = start_sync_hosts(plan_sync(run, pg, sync_name))
    try:
        return _start_actors(run, run_dir, pg, layout, agents, model_dir_fn, learner_cls)
    except BaseException:
        from moe_grpo.orchestrator.sync_hosts import stop_sync_hosts

        stop_sync_hosts(agents)
        raise


def _start_actors(run: Any, run_dir: str, pg: Any, layout: Any, agents: list[Any], model_dir_fn: Any,
                  learner_cls: type | None) -> Pools:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from moe_grpo.orchestrator.learner_actor import LearnerWorker

    c = run.cluster
    world = run.learner_world_size()

    def at(i: int) -> Any:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    addr, port = ray.get(ray.remote(num_cpus=0)(_rendezvous).options(scheduling_strategy=at(c.num_engines))
                         .remote(single_host()))
    secret = secrets.token_hex(32)  # the run's rendezvous secret, handed to the ranks as an actor argument
    learner_cls = ray.remote(learner_cls or LearnerWorker)
    learners = [learner_cls.options(num_cpus=c.learner_cpus, num_gpus=c.learner_gpus, scheduling_strategy=at(c.num_engines + r),
                                    name=None).remote(r, world, addr, port, run, layout,
                                                      _cores(c, r, c.learner_cpus, int(c.engine_cpus) * c.num_engines),
                                                      secret)
                for r in range(world)]
    try:
        infos = ray.get([a.info.remote() for a in learners], timeout=c.start_timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise RuntimeError(f"learner ranks did not start within {c.start_timeout_s:.0f} s "
                           f"(rendezvous {addr}:{port}, world size {world})") from e
    model_dir = model_dir_fn(learners)
    make_engine = EngineFactory(run, run_dir, layout, model_dir, pg)
    engines = [(f"engine{i}", make_engine(i)) for i in range(c.num_engines)]
    t0 = time.perf_counter()
    pids = []
    for name, handle in engines:
        try:
            pids.append(ray.get(handle.pid.remote(), timeout=max(1.0, c.start_timeout_s - (time.perf_counter() - t0))))
        except ray.exceptions.GetTimeoutError as e:
            raise RuntimeError(f"{name} (vLLM) did not start within {c.start_timeout_s:.0f} s") from e
    return Pools(engines, learners, infos, pg, make_engine, pids, layout, agents)


def stop_pools(pools: Pools | None, engines: list[Any] | None = None) -> None:
    """Shut the engines down (`engines`: the handles now serving, replacements included), then Ray."""
    import ray

    handles = engines if engines is not None else [h for _, h in pools.engines] if pools is not None else []
    refs = []
    for handle in handles:
        try:
            refs.append(handle.shutdown.remote())
        except Exception:  # noqa: BLE001 - a dead actor has nothing left to shut down
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=30)
    ray.shutdown()
