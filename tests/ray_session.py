"""One Ray cluster for the whole test session, which whole runs join by address (`cluster.ray_address`).

A run that starts its own Ray spends ~5 s on it (measured here, 2 cores: `ray.init` 2.5-3.6 s, its first worker
1.0-1.2 s, `ray.shutdown` 1.3-1.6 s). The session's cluster is started once, the way a run starts its own
(`pools.start_local_ray`: a private 0700 temp dir, the node on loopback, Ray 2.60's token authentication with the
user's token, vLLM's RPC sockets in the private dir), by a helper process of its own (`python tests/ray_session.py`),
so the test process itself never connects to Ray unless a test does (several tests start and stop Ray in-process).

Whole-run tests get its address from the `session_ray_address` fixture (tests/conftest.py) or, for
tests/faults/runs.py `Run`, from `address()`; both start it on first use. `stop()` ends it at the session's end
(the conftest's `pytest_sessionfinish`, and `atexit` should the session end otherwise), checks that none of its
processes and not its private directory are left, and says so. Killed outright, the test process leaves the helper
reading end-of-file on its stdin: the helper then shuts its cluster down itself (Ray's processes are tied to the
helper, so they die with it however it dies, and the next run's sweep removes the private dir). Its logs (the
helper's, and Ray's copied when it stops) are in `$TMPDIR/moe_grpo_ray_session-<uid>-...`; a new session removes
those of ended sessions but the newest two. `MOE_GRPO_TEST_SESSION_RAY=0`: whole runs start Ray of their own.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


@dataclass
class SessionCluster:
    """The helper process and what it reported once its cluster was up."""

    helper: int
    """The helper's pid (not a child of the test process: see `_start`)."""
    group: int
    """Its process group (the helper, Ray's processes)."""
    stdin: object
    """Closing it tells the helper to shut its cluster down."""
    address: str
    """GCS address, 127.0.0.1:<port>: what `cluster.ray_address` takes."""
    private_dir: str
    log_path: str
    pids: list[int]
    """The helper and every process below it once the cluster was up (Ray's GCS, raylet, agents, idle workers)."""
    started_s: float
    """How long the start took."""

    def processes(self) -> list[str]:
        """The helper and every process below it now, as 'pid cmdline'."""
        import psutil

        try:
            top = psutil.Process(self.helper)
            procs = [top] + top.children(recursive=True)
        except psutil.Error:
            return []
        out = []
        for p in procs:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
        return out


_cluster: SessionCluster | None = None

OFF_ENV = "MOE_GRPO_TEST_SESSION_RAY"
"""Set to 0, whole runs start Ray of their own as before (`Run`, `on_session_ray`): to compare, or to rule the
shared cluster out when a test fails."""


def enabled() -> bool:
    """Whether whole runs join the session cluster (unless `OFF_ENV` is 0)."""
    return os.environ.get(OFF_ENV, "1").strip() not in ("0", "false", "no")


def joining(run):
    """`run` (a RunConfig) joining the session cluster (`cluster.ray_address`), or as it is when `enabled()` is
    false."""
    import dataclasses

    if not enabled():
        return run
    return dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, ray_address=address()))


def join_env() -> dict[str, str]:
    """What a process joining the session cluster by address needs in its environment: token authentication on
    (Ray turns it on by itself only for a cluster it starts; the token is the user's, as the cluster's)."""
    return {"RAY_AUTH_MODE": "token"}


def address() -> str:
    """The session cluster's address, started on first use. The test process is made ready to join it in-process
    (`train(run)` with `cluster.ray_address`): token authentication on, as Ray does for a cluster it starts (Ray 2.60
    reads its config once: refreshed here with Ray's own helper, as tools/ray_nodes.py does)."""
    global _cluster
    if _cluster is None:
        _cluster = _start()
        atexit.register(stop)
    if os.environ.get("RAY_AUTH_MODE") != "token":
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    return _cluster.address


def current() -> SessionCluster | None:
    """The session cluster if it was started (and not stopped)."""
    return _cluster


def _start() -> SessionCluster:
    import psutil
    import tempfile

    from moe_grpo.orchestrator.run_dirs import make_owned_dir

    t0 = time.perf_counter()
    base = tempfile.gettempdir()
    _sweep_logs(base)
    # Held (run_dirs.py) by this process for the session: a later session's sweep leaves a live session's logs alone.
    log_dir = make_owned_dir(base, lambda: f"{LOG_PREFIX}{os.getuid()}-{os.getpid()}-{int(time.time())}")
    log_path = os.path.join(log_dir, "helper.log")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    with open(log_path, "w") as log:
        # A session of its own: a Ctrl-C in the terminal reaches pytest, whose session end stops the cluster in order.
        # The helper forks and its first process exits, so the cluster is not below the test process: tests that
        # look at the test process's descendants (listeners.py, an in-process run's process record) see only theirs.
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), log_dir], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, cwd=ROOT, env=env, start_new_session=True,
                                text=True)
    line = _read_line(proc, START_TIMEOUT_S)
    proc.wait(10)  # the first process exits once the helper reported (or failed)
    if not line:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError(f"the session's Ray cluster did not start within {START_TIMEOUT_S:.0f} s (exit "
                           f"{proc.poll()}); its log: {log_path}:\n{open(log_path).read()[-3000:]}")
    info = json.loads(line)
    top = psutil.Process(info["pid"])
    pids = [top.pid] + [p.pid for p in top.children(recursive=True)]
    cluster = SessionCluster(top.pid, proc.pid, proc.stdin, info["address"], info["private_dir"], log_path, pids,
                             time.perf_counter() - t0)
    print(f"\nsession Ray cluster at {cluster.address} (private dir {cluster.private_dir}), up in "
          f"{cluster.started_s:.1f} s", file=sys.stderr)
    return cluster


LOG_PREFIX = "moe_grpo_ray_session-"
KEEP_LOGS = 2
"""Ended sessions whose logs (the helper's, a copy of Ray's) are kept, newest first."""


def _sweep_logs(base: str) -> None:
    """Remove the log directories of ended sessions of this user but the newest `KEEP_LOGS`."""
    import shutil

    from moe_grpo.orchestrator.run_dirs import owner_alive

    prefix = f"{LOG_PREFIX}{os.getuid()}-"
    ended = []
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if name.startswith(prefix) and os.path.isdir(path) and owner_alive(path) is False:
            ended.append((os.path.getmtime(path), path))
    for _, path in sorted(ended, reverse=True)[KEEP_LOGS:]:
        shutil.rmtree(path, ignore_errors=True)


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if sel.select(timeout_s):
        return proc.stdout.readline().strip()
    return ""


def stop() -> list[str]:
    """End the session cluster (if started): the helper shuts Ray down and removes its private directory. Returns
    what of it is left (its processes, its private directory), after waiting for them; empty when nothing is."""
    global _cluster
    cluster, _cluster = _cluster, None
    if cluster is None:
        return []
    import psutil

    t0 = time.perf_counter()
    pids = sorted(set(cluster.pids) | {int(line.split()[0]) for line in cluster.processes()})  # workers started since
    try:
        cluster.stdin.close()  # the helper's cue to shut down
    except OSError:
        pass
    if not _gone([cluster.helper], STOP_TIMEOUT_S):
        os.killpg(cluster.group, signal.SIGKILL)  # the helper and what it started
        _gone([cluster.helper], 10)
    deadline = time.monotonic() + 30  # Ray's processes exit a little after the helper
    while True:
        left = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.Error:
                pass
        if os.path.exists(cluster.private_dir):
            left.append(f"its private directory {cluster.private_dir}")
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"\nsession Ray cluster at {cluster.address} stopped in {time.perf_counter() - t0:.1f} s; left of it: "
          f"{left or 'nothing'}", file=sys.stderr)
    return left


def session_ray_address_fixture():
    """The body of tests/conftest.py's `session_ray_address`: the address, the cluster stopped at the session's end
    and checked gone (a failure of the session's teardown names what was left)."""
    yield address()
    left = stop()
    assert not left, f"the session's Ray cluster left {left}"


def _gone(pids: list[int], timeout_s: float) -> bool:
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def _serve(log_dir: str) -> None:
    """The helper: start the cluster as a run does, report it, keep it until stdin closes (the test process is done
    or gone) or a SIGTERM, then shut it down and remove its private directory."""
    import ray

    from moe_grpo.orchestrator.pools import start_local_ray
    from moe_grpo.orchestrator.run_dirs import release_private_dir
    from moe_grpo.orchestrator.session import keep_handlers_through_ray_shutdown

    if os.fork():  # the first process exits: the helper is not below the test process
        os._exit(0)
    keep_handlers_through_ray_shutdown()
    private = start_local_ray()
    try:
        session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001 - no public accessor
        os.symlink(os.path.join(session, "logs"), os.path.join(log_dir, "ray_logs"))

        def on_term(signum, frame):
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(json.dumps({"address": ray.get_runtime_context().gcs_address, "private_dir": private,
                          "pid": os.getpid()}), flush=True)
        sys.stdin.read()  # until end of file
    finally:
        ray.shutdown()
        release_private_dir(private, log_dir)  # Ray's logs copied next to the helper's log


if __name__ == "__main__":
    _serve(sys.argv[1])
