"""Ray and the two pools: placement groups reserve each pool's resources, one actor per engine and per learner rank."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from moe_grpo.learner.spawn import free_port
from moe_grpo.orchestrator.cluster_watch import ClusterUnreachable, wait_for_gcs
from moe_grpo.orchestrator.config import ClusterConfig
from moe_grpo.orchestrator.engine_actor import EngineWorker
from moe_grpo.orchestrator.learner_actor import LearnerWorker
from moe_grpo.orchestrator.learner_group import LearnerGroup, failure_line
from moe_grpo.orchestrator.placement_plan import pin_bundles
from moe_grpo.orchestrator.ray_loopback import loopback_node
from moe_grpo.orchestrator.run_dirs import make_private_dir, remove_orphaned_private_dirs
from moe_grpo.processes import ctrl_c_left_to_this_process, oom_kills, oom_note
from moe_grpo.rollout.engine_error import EngineError

if TYPE_CHECKING:  # the run's config composes the orchestrator's: it is a layer above (pyproject.toml)
    from moe_grpo.config import RunConfig
    from moe_grpo.sync.layout import SyncLayout


@dataclass
class EngineFactory:
    """Starts the engine actor of one placement bundle (at start, and again when an engine's actor died)."""

    run: RunConfig
    run_dir: str
    sync: SyncLayout
    """The run's `SyncLayout`: where each engine's versions arrive."""
    model_dir: str | None
    """The model directory engines start from (version 0); None while the learner ranks are still writing it
    (actors made then wait for `EngineWorker.start`)."""
    placement_group: Any
    engine_groups: list[Any] | None = None
    """Per engine, its own placement group when its stages span nodes (one GPU bundle per vLLM worker), else None."""
    sync_agents: list[Any] | None = None
    """The relay's `SyncHostAgent`s, in `sync.hosts` order (an engine spanning hosts reads each host's copy)."""

    def __call__(self, bundle: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        c = self.run.cluster
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                    placement_group_bundle_index=bundle)
        return ray.remote(EngineWorker).options(
            num_cpus=c.engine_cpus, num_gpus=c.engine_gpus, scheduling_strategy=strategy, max_concurrency=10_000,
        ).remote(f"engine{bundle}", self.model_dir, self.run.model, self.run.rollout, self.run_dir, self.sync,
                 _cores(c, bundle, c.engine_cpus, 0), self.run.seed + bundle, self.run.lora, self.run.sync.lora_apply,
                 tensor_parallel=c.engine_tensor_parallel, pipeline_parallel=c.engine_pipeline_parallel,
                 expert_parallel=c.engine_expert_parallel,
                 placement_group=self.engine_groups[bundle] if self.engine_groups else None,
                 host_agents=self._host_agents(bundle))

    def _host_agents(self, bundle: int) -> dict[str, Any] | None:
        """The relay agents of the other hosts of an engine whose stages span nodes (None for the others)."""
        if not self.engine_groups or self.engine_groups[bundle] is None:
            return None
        from moe_grpo.orchestrator.sync_hosts import engine_host_agents  # brings in torch (the transports)

        return engine_host_agents(self.sync, self.sync_agents or [], bundle)


@dataclass
class Pools:
    engines: list[tuple[str, Any]]
    """(name, actor handle) per vLLM engine, as started."""
    learners: LearnerGroup
    """The learner ranks: actors, coordinates, and every call to them."""
    placement_group: Any
    make_engine: EngineFactory | None = None
    """Starts a replacement engine actor in a given bundle."""
    engine_pids: list[int] | None = None
    """Each engine's vLLM engine-core process."""
    sync: SyncLayout | None = None
    """The run's `SyncLayout` (transport, each actor's host)."""
    sync_agents: list[Any] | None = None
    """One `SyncHostAgent` per sync host under the relay (orchestrator/sync_hosts.py); empty on one host."""
    engine_groups: list[Any] | None = None
    """Per engine, its own placement group when its stages span nodes, else None (`EngineFactory`)."""


def start_ray(cluster: ClusterConfig, run_dir: str) -> str | None:
    """Start a Ray cluster of this run's own (or join `cluster.ray_address` when it names one); returns the run's
    private directory (Ray's temp dir and vLLM's RPC sockets, 0700) that `stop_pools` removes, or None when joining
    (or when this process is connected to Ray already: the run uses that connection, see `stop_pools`)."""
    import ray

    if ray.is_initialized():
        return None
    private = None
    if cluster.ray_address:
        join_ray(cluster.ray_address)
    else:
        private = start_local_ray()
    try:  # Ray's own logs stay in its session directory; point at them from the run directory
        session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001 - no public accessor
        link = os.path.join(run_dir, "ray_logs")
        if not os.path.lexists(link):
            os.symlink(os.path.join(session, "logs"), link)
    except Exception:
        pass
    return private


def join_ray(address: str) -> None:
    """Connect to the Ray cluster at `address` ('host:port'). A cluster on loopback (127.0.0.1: one started by
    `start_local_ray`, a run's own or the test suite's) is joined on loopback too: `ray.init` replaces a loopback
    address with the host's, where nothing of that cluster listens (seen with Ray 2.60.0: "Failed to connect to GCS
    at address <host ip>:<port>" until it gives up), and this driver's node must be the cluster's node, 127.0.0.1."""
    import ray

    wait_for_gcs(address)
    token = token_auth_for_join()
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        with loopback_node() if _is_loopback(host) else contextlib.nullcontext():
            ray.init(address=address, **RAY_INIT)
    except (ConnectionError, RuntimeError) as e:  # Ray 2.60 raises either, by where the connection failed
        if isinstance(e, RuntimeError) and "Failed to connect" not in str(e):
            raise
        raise ClusterUnreachable(
            f"the Ray cluster at cluster.ray_address={address} answers but could not be joined ({e}); Ray's messages "
            "above say why: 'InvalidAuthToken' means the cluster uses token authentication and "
            + ("this host's token (~/.ray/auth_token, RAY_AUTH_TOKEN) is not the cluster's" if token else
               "this host has no token (RAY_AUTH_TOKEN=<the cluster's token>, or `ray get-auth-token` on its head)")
        ) from e


def token_auth_for_join() -> bool:
    """Turn Ray's token authentication on for a join by address when a token is at hand (~/.ray/auth_token,
    RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) and RAY_AUTH_MODE is unset; returns whether it is on. Ray 2.60's `ray start
    --head` turns authentication on when a token is at hand, and a process joining by address must present it, but
    `ray.init(address=<host:port>)` turns it on only for address "auto": such a run was refused for 20 s
    ("InvalidAuthToken" in Ray's log), then failed saying only that it could not connect (a user's trial,
    2026-11-28). A cluster without authentication accepts a driver that has it on (checked with Ray 2.60)."""
    from ray._private.authentication import authentication_token_setup as auth

    mode = os.environ.get(auth.AUTH_MODE_ENV_VAR)
    if mode is not None:
        return mode.lower() == "token"
    loader = auth.AuthenticationTokenLoader.instance()
    loader.reset_cache()
    if not loader.has_token(ignore_auth_mode=True):
        return False
    auth._enable_token_auth()  # Ray's own helper: the variable set, and its config read again
    return True


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


RAY_INIT: dict[str, Any] = dict(logging_level=logging.WARNING, include_dashboard=False, log_to_driver=True)
"""What every `ray.init` of a run passes, whether it starts a cluster or joins one."""


def start_local_ray(num_cpus: int | None = None) -> str:
    """Start a Ray cluster on this host alone, this process its driver; returns its private directory (Ray's temp
    dir and vLLM's RPC sockets, 0700, held by this process: `run_dirs.release_private_dir` removes it once Ray is
    down). What a run without `cluster.ray_address` does, and what the test suite's one cluster per session does
    (tests/ray_session.py), so both are the same cluster.

    Started with `address="local"`, so neither RAY_ADDRESS nor a `ray_current_cluster` file in the shared /tmp/ray
    attaches it to another job's cluster, and on loopback (its node's address 127.0.0.1, ray_loopback.py): it is
    this host alone, and its servers listen where only this host reaches them. Ray 2.60 turns its token
    authentication on for a new local cluster (the user's ~/.ray/auth_token); a process joining it by address
    needs RAY_AUTH_MODE=token. VLLM_RPC_BASE_PATH (vLLM's socket directory; the shared temp dir by default) is in
    the environment the cluster's processes start with, so every job's workers get it, a job that joins by address
    too (a job's runtime environment reaches that job's workers only). The run's job has no runtime environment of
    its own: with one, its actors cannot take the workers Ray starts with the cluster and each waits for a worker
    made for it (a small run's actors began their imports 10.6 s after the driver started with one, 6.4 s
    without, on 2 cores)."""
    import ray

    remove_orphaned_private_dirs()
    private = make_private_dir()
    rpc = os.path.join(private, "vllm")
    before = os.environ.get(VLLM_RPC_ENV)
    try:
        os.mkdir(rpc, 0o700)
        os.environ[VLLM_RPC_ENV] = rpc  # inherited by Ray's processes, and by the workers they start
        if "RAY_AUTH_MODE" not in os.environ:
            # Token authentication, as Ray turns it on for a cluster it starts, said rather than defaulted (Ray's own
            # helper: the variable and its config read again): Ray then skips its console warning in every run
            # ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ...").
            from ray._private.authentication.authentication_token_setup import _enable_token_auth

            _enable_token_auth()
        with loopback_node(), ctrl_c_left_to_this_process():
            ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2, _temp_dir=os.path.join(private, "ray"),
                     **RAY_INIT)
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    finally:  # this process's own environment as it was
        if before is None:
            os.environ.pop(VLLM_RPC_ENV, None)
        else:
            os.environ[VLLM_RPC_ENV] = before
    return private


VLLM_RPC_ENV = "VLLM_RPC_BASE_PATH"


def _cores(cluster: ClusterConfig, index: int, per: float, offset: int) -> list[int] | None:
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

    return ("127.0.0.1" if single_host else ray.util.get_node_ip_address()), free_port()


def rendezvous(strategy: Any) -> tuple[str, int]:
    """`_rendezvous` for the node of learner rank 0's bundle (`strategy` places a task there).

    On a one-node cluster that node is this driver's own (a driver that joins by address runs on a node of the
    cluster), so the driver picks the loopback port itself: a Ray task would first need a worker process of this
    job (a Python start and Ray's import, 1.5-2.5 s on 2 cores) before any actor of the run is asked for."""
    import ray

    if single_host():
        return _rendezvous(True)
    return ray.get(ray.remote(num_cpus=0)(_rendezvous).options(scheduling_strategy=strategy).remote(False))


def single_host() -> bool:
    """Whether the Ray cluster is this one machine (then every run port binds to loopback)."""
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) == 1


def engine_group_bundles(worker_nodes: list[str], ray_nodes: Any) -> list[dict[str, float]]:
    """The placement bundles of an engine whose stages span nodes: one GPU per vLLM worker, in its rank order,
    each pinned to the node the plan gives it (vLLM's Ray executor takes one GPU bundle per worker, at most one GPU
    each: rollout/ray_executor.py)."""
    return pin_bundles([{"GPU": 1.0}] * len(worker_nodes), worker_nodes, ray_nodes)


def start_engine_groups(engine_worker_nodes: list[list[str] | None], timeout_s: float) -> list[Any] | None:
    """A placement group per engine whose stages span nodes (None for the others); None when no engine does.
    Raises naming the engine whose group Ray could not reserve within `timeout_s` (the groups made are removed)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if not any(engine_worker_nodes):
        return None
    groups: list[Any] = []
    try:
        for i, nodes in enumerate(engine_worker_nodes):
            if not nodes:
                groups.append(None)
                continue
            bundles = engine_group_bundles(nodes, ray.nodes())
            group = placement_group(bundles, strategy="PACK", name=f"moe_grpo-engine{i}")
            groups.append(group)
            if not group.wait(timeout_seconds=timeout_s):
                raise RuntimeError(f"Ray could not reserve engine{i}'s {len(bundles)} GPU bundles on "
                                   f"{' '.join(dict.fromkeys(nodes))} within {timeout_s:.0f} s (cluster has "
                                   f"{ray.cluster_resources()})")
    except BaseException:
        for group in groups:
            if group is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(group)
        raise
    return groups


def start_pools(run: RunConfig, run_dir: str, sync_name: str, model_dir_fn: Any, learner_cls: type | None = None,
                bundle_nodes: list[str | None] | None = None,
                engine_worker_nodes: list[list[str] | None] | None = None) -> Pools:
    """Learner ranks first (they build the initial weights), then engines on `model_dir_fn(learners)` (the ranks'
    `LearnerGroup`).

    `sync_name`: the run's directory under each host's weight-buffer root. Once Ray placed the bundles, the
    weight transport is planned from where they landed, and under the relay its host agents start first.

    `learner_cls` replaces `LearnerWorker` (a subclass; tests slow it down on purpose). `bundle_nodes`: the host
    each bundle (engines, then learner ranks) must be reserved on, from the placement plan; None lets Ray pack.
    `engine_worker_nodes`: per engine, its workers' nodes when its stages span nodes (the plan's
    `engine_worker_nodes`): such an engine gets a placement group of its own, one GPU bundle per worker."""
    import ray
    from ray.util.placement_group import placement_group

    c = run.cluster
    world = run.learner_world_size()
    bundles = ([{"CPU": c.engine_cpus, **({"GPU": c.engine_gpus} if c.engine_gpus else {})}] * c.num_engines
               + [{"CPU": c.learner_cpus, **({"GPU": c.learner_gpus} if c.learner_gpus else {})}] * world)
    if bundle_nodes is not None:
        bundles = pin_bundles(bundles, bundle_nodes, ray.nodes())
    pg = placement_group(bundles, strategy="PACK")
    if not pg.wait(timeout_seconds=c.start_timeout_s):
        raise RuntimeError(f"Ray could not reserve {bundles} within {c.start_timeout_s:.0f} s "
                           f"(cluster has {ray.cluster_resources()}); lower cluster.* resources or add nodes")

    from moe_grpo.orchestrator.sync_hosts import plan_sync, start_sync_hosts  # brings in torch (the transports)

    groups: list[Any] | None = None
    agents: list[Any] = []
    try:
        groups = start_engine_groups(engine_worker_nodes or [], c.start_timeout_s)
        layout, agents = start_sync_hosts(plan_sync(run, pg, sync_name, groups))
        return _start_actors(run, run_dir, pg, layout, agents, model_dir_fn, learner_cls, groups)
    except BaseException:
        from ray.util.placement_group import remove_placement_group

        from moe_grpo.orchestrator.sync_hosts import stop_sync_hosts  # brings in torch (the transports)

        for group in [pg, *(groups or [])]:  # ends the actors started so far (no Pools to release them by)
            if group is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(group)
        stop_sync_hosts(agents, engines_stopped=True)  # the engines' records in the agents' buffers, then those
        raise


def _start_actors(run: RunConfig, run_dir: str, pg: Any, layout: Any, agents: list[Any], model_dir_fn: Any,
                  learner_cls: type | None, engine_groups: list[Any] | None = None) -> Pools:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    c = run.cluster
    world = run.learner_world_size()

    def at(i: int) -> Any:
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

    # The engines' actors are asked for first: they get ready (vLLM's import: ~10 s of a run's start-up on CPU)
    # while the learner ranks start and build the weights; each starts its engine once the model directory is
    # written.
    oom_since = oom_kills()  # this host's OOM kills before the engines' actors start (their death's message)
    make_engine = EngineFactory(run, run_dir, layout, None, pg, engine_groups, agents)
    engines = [(f"engine{i}", make_engine(i)) for i in range(c.num_engines)]
    addr, port = rendezvous(at(c.num_engines))
    secret = secrets.token_hex(32)  # the run's rendezvous secret, handed to the ranks as an actor argument
    learner_cls = ray.remote(learner_cls or LearnerWorker)
    learners = [learner_cls.options(num_cpus=c.learner_cpus, num_gpus=c.learner_gpus, scheduling_strategy=at(c.num_engines + r),
                                    name=None).remote(r, world, addr, port, run, layout,
                                                      _cores(c, r, c.learner_cpus, int(c.engine_cpus) * c.num_engines),
                                                      secret)
                for r in range(world)]
    group = LearnerGroup.start(learners, timeout_s=c.learner_timeout_s, start_timeout_s=c.start_timeout_s,
                               where=f"rendezvous {addr}:{port}, world size {world}")
    make_engine.model_dir = model_dir_fn(group)
    t0 = time.perf_counter()
    started = {name: handle.start.remote(make_engine.model_dir) for name, handle in engines}
    pids = []
    for name, ref in started.items():
        try:
            pids.append(ray.get(ref, timeout=max(1.0, c.start_timeout_s - (time.perf_counter() - t0))))
        except ray.exceptions.GetTimeoutError as e:
            raise EngineError(f"{name} (vLLM) did not start within cluster.start_timeout_s="
                              f"{c.start_timeout_s:.0f} s") from e
        except ray.exceptions.RayActorError as e:  # Ray's traceback named neither the engine nor a cause, and
            # escaped the run's one-line report (an engine's actor OOM-killed at start: a user's trial, 2026-11-28)
            raise EngineError(actor_died_at_start(name, e, oom_since)) from e
    return Pools(engines, group, pg, make_engine, pids, layout, agents, engine_groups)


def actor_died_at_start(name: str, e: BaseException, oom_since: int | None) -> str:
    """The message of engine `name`'s Ray actor gone before its vLLM served (`e`: Ray's RayActorError): its
    `__init__`'s error, or the process that died, and the OOM killer's part where it had one on this host."""
    text = str(e)
    if getattr(e, "actor_init_failed", False):
        return f"engine {name}: its Ray actor failed to start: {failure_line(text)}"
    pid = re.search(r"^\s*pid: (\d+)$", text, re.MULTILINE)
    ip = re.search(r"^\s*ip: (\S+)$", text, re.MULTILINE)
    here = ip is not None and ip.group(1) == _node_ip()  # the OOM-kill count is this host's
    return (f"engine {name}: its Ray actor (pid {pid.group(1) if pid else '?'}) died while vLLM started"
            f"{oom_note(oom_since) if here else ''}")


def _node_ip() -> str | None:
    """This process's Ray node address (None outside Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only a message depends on it
        return None


def stop_pools(pools: Pools | None, engines: list[Any] | None = None, *, release: bool = False,
               disconnect: bool = True, timeout_s: float = 30.0,
               after_engines: Callable[[], None] | None = None) -> None:
    """Shut the engines down (`engines`: the handles now serving, replacements included), run `after_engines` (the
    relay agents' cleanup, which removes what engines that did not shut down left in /dev/shm on their hosts), then
    leave Ray.

    `release`: the cluster is not the run's own (joined by address, or the caller's connection): remove the run's
    placement group, which ends every actor in it (engines, learner ranks), and the relay agents, and wait until
    they are dead, so the cluster is as the run found it, its CPUs free for the next job. On the run's own cluster
    `ray.shutdown()` ends all of it. `disconnect`: the run connected to Ray itself (`start_ray`); a connection the
    caller made (Ray initialized before `train`) is left to the caller."""
    import ray

    handles = engines if engines is not None else [h for _, h in pools.engines] if pools is not None else []
    refs = []
    for handle in handles:
        try:
            refs.append(handle.shutdown.remote())
        except Exception:  # noqa: BLE001 - a dead actor has nothing left to shut down
            pass
    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if after_engines is not None:
        try:
            after_engines()
        except Exception as e:  # noqa: BLE001 - the actors and Ray must still be released
            logging.getLogger("moe_grpo").warning("cleanup: the relay agents' cleanup failed (%s: %s); releasing the "
                                                  "pools anyway", type(e).__name__, e)
    if release and pools is not None:
        release_actors(pools, handles, timeout_s)
    if disconnect:
        shutdown_ray()


def shutdown_ray() -> None:
    """`ray.shutdown()` with Python's cyclic garbage collector held off while it runs, after a collection on this
    thread while Ray is still up. The collector runs in whichever thread allocates: a cycle holding an ObjectRef or
    an actor handle that it frees in another thread while Ray shuts down (the run record's PNG is drawn on a thread
    beside the cleanup) reaches Ray's core worker mid-shutdown, and Ray ends the process on the spot with exit
    status 1 and nothing printed ("The core worker has already been shutdown ... The process will exit", in Ray's
    driver log only: a whole test session ended so, 2026-11-28, during a run's cleanup in-process)."""
    import ray

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        ray.shutdown()
    finally:
        if was_enabled:
            gc.enable()


def _actor_dead(actor: Any) -> bool:
    """Whether Ray's control store (GCS) holds `actor` as DEAD (`ray._private.state.actors`, Ray 2.60: the public
    `ray.util.state` needs the dashboard, which runs do not start)."""
    from ray._private import state

    return state.actors(actor._actor_id.hex()).get("State") == "DEAD"


def release_actors(pools: Pools, engines: list[Any], timeout_s: float) -> None:
    """End the run's actors on a cluster that outlives the run: its placement group removed (Ray kills the actors
    in it), the relay agents (placed by node, outside it) killed; waits until each is dead and the group removed.
    Raises naming what is still there after `timeout_s`."""
    import ray
    from ray.util import placement_group_table, remove_placement_group

    actors = [*engines, *pools.learners.actors, *(pools.sync_agents or [])]
    if pools.placement_group is not None:
        remove_placement_group(pools.placement_group)
    for engine_group in pools.engine_groups or []:  # vLLM's Ray workers of engines spanning nodes
        if engine_group is not None:
            remove_placement_group(engine_group)
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
    deadline = time.monotonic() + timeout_s
    # Asked of Ray's control store, not of the actors: a call (`__ray_ready__`) that reached an actor as it was
    # being killed made its worker abort on a failed Ray check ("Object at idx 0 was not stored"), printing a C++
    # stack trace at the end of every run on a cluster it joined (seen on two Ray nodes, Ray 2.60).
    pending = [a for a in actors if not _actor_dead(a)]
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [a for a in pending if not _actor_dead(a)]
    group = pools.placement_group
    while group is not None and placement_group_table(group).get("state") != "REMOVED" and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{len(pending)} actor(s)"] if pending else []
    if group is not None and placement_group_table(group).get("state") != "REMOVED":
        left.append(f"placement group {group.id.hex()} ({placement_group_table(group).get('state')})")
    if left:
        raise RuntimeError(f"the run's {' and '.join(left)} still on the Ray cluster {timeout_s:.0f} s after it "
                           "asked Ray to end them")
