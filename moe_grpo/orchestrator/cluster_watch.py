"""The Ray cluster's GCS, checked before a run joins it and watched while the run trains: a run never waits on an
address where no cluster answers, and a run whose GCS dies checkpoints and stops before Ray ends it.

Joining (`cluster.ray_address`): `ray.init(address=...)` on an address where nothing listens waited without end (a
run was still waiting after 400 s, printing Ray's retries). `wait_for_gcs` gives it `JOIN_WAIT_S`, then
`ClusterUnreachable` names the address (one line, exit 1).

Ray 2.60, when the GCS (the cluster's control store, on its head node) stops answering: the run's actors go on
answering the driver (their calls do not pass through the GCS), nothing new can start (an engine restart cannot),
and `RAY_gcs_rpc_server_reconnect_timeout_s` (60 s) later Ray ends the driver from inside ("Failed to connect to GCS
within 60 seconds"): no checkpoint, no cleanup, no last line, exit 1, the steps since the last checkpoint lost (a
user's trial, 2026-11-28, on a joined cluster; the same with a run's own cluster whose GCS was killed). The raylets
end the actors about as late.

`GcsWatch` opens a TCP connection to the GCS's port every `PERIOD_S` (the kernel accepts it while the process
lives, however busy it is: a refused or timed-out connect is a GCS gone or a head unreachable, not a slow one).
After `cluster.gcs_lost_after_s` of failures it tells the driver, which stops as for SIGTERM: a checkpoint at the
end of the step in flight, then the cleanup, then `ClusterLost` (one line, exit 1) naming the checkpoint; all of it
has to fit in Ray's 60 s. A GCS that comes back (Ray's GCS fault tolerance) within the grace costs nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

log = logging.getLogger("moe_grpo")

GCS_LOST = "GCS"
"""The driver's stop reason (`Driver.on_signal`) when the GCS is gone, beside the signals' names."""

PERIOD_S = 1.0
"""Seconds between two connects."""

CONNECT_TIMEOUT_S = 1.0


def ray_gives_up_after_s() -> float:
    """Seconds after which Ray ends a process whose GCS is gone (its default, unless the environment sets it)."""
    try:
        return float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", "60"))
    except ValueError:
        return 60.0


def gcs_answers(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the GCS at `address` ('host:port') is accepted within `timeout_s`."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


JOIN_WAIT_S = 30.0
"""Seconds a run waits for the GCS at `cluster.ray_address` to accept a connection (a cluster still starting)."""


class ClusterUnreachable(RuntimeError):
    """No Ray cluster could be joined at `cluster.ray_address`."""


def wait_for_gcs(address: str, wait_s: float | None = None) -> None:
    """Return once the GCS at `address` accepts a connection; raise `ClusterUnreachable` after `wait_s` (None:
    `JOIN_WAIT_S`)."""
    wait_s = JOIN_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    while not gcs_answers(address):
        if time.monotonic() >= deadline:
            raise ClusterUnreachable(
                f"no Ray cluster answers at cluster.ray_address={address} (nothing accepted a connection on its GCS "
                f"port for {wait_s:.0f} s): start it (`ray start --head --port=<port>` prints the address to join) or "
                "fix the address; without cluster.ray_address the run starts a cluster of its own")
        time.sleep(PERIOD_S)


class ClusterLost(RuntimeError):
    """The Ray cluster's GCS stopped answering: the run stopped (after a checkpoint when there was time for one)."""


class GcsWatch:
    """A daemon thread connecting to the GCS every `PERIOD_S`; `on_lost(why)` is called once, from that thread,
    when it has refused or not answered for `lost_after_s` (0 = never: the watch does not start)."""

    def __init__(self, address: str, lost_after_s: float, on_lost: Callable[[str], None] | None = None,
                 period_s: float = PERIOD_S) -> None:
        self.address, self.lost_after_s, self.period_s = address, lost_after_s, period_s
        self.on_lost = on_lost
        """Set once the driver exists (`RunSession.attach`); before it, a loss is only logged."""
        self.lost_at: float | None = None
        """time.monotonic() of the first failed connect of the loss that was reported; None while the GCS answers."""
        self.why = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.lost_after_s > 0:
            self._thread = threading.Thread(target=self._watch, name="moe_grpo-gcs-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CONNECT_TIMEOUT_S + self.period_s)

    def _watch(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            if gcs_answers(self.address):
                if failing_since is not None:
                    log.info("the Ray cluster's GCS at %s answers again after %.0f s", self.address,
                             now - failing_since)
                failing_since = None
                continue
            if failing_since is None:
                failing_since = now - self.period_s  # the last connect that answered was a period ago
            if now - failing_since >= self.lost_after_s:
                self.lost_at = failing_since
                self.why = (f"the Ray cluster's GCS at {self.address} stopped answering (no connection for "
                            f"{now - failing_since:.0f} s; Ray ends this process {ray_gives_up_after_s():.0f} s "
                            "after it went)")
                log.error("%s: %s", self.why, "stopping after a checkpoint at the end of this step" if self.on_lost
                          else "the run is starting: once its pools are up it checkpoints and stops, if Ray has not "
                          "ended it by then")
                if self.on_lost is not None:
                    self.on_lost(self.why)
                return
