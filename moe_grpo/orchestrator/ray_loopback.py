"""A run's own Ray cluster on loopback: a patch of Ray internals, read against ray == 2.60.0.

A run that starts its own Ray (`cluster.ray_address` unset) is one host: nothing outside it is meant to join. Ray
binds its servers by the node's address. Measured with `ss -ltnp` during a 4-step run with two learner ranks and an
engine on this host, with the node's address left to Ray (the host's, 192.0.2.2 here): the GCS, the raylet (2
ports), the driver's and every worker's gRPC server on all interfaces (`*`), the runtime-env agent on 192.0.2.2 and
the autoscaler monitor's Prometheus metrics (plain HTTP, no token) on 0.0.0.0:44217. With 127.0.0.1 as the node's
address: every one of them on loopback (the gRPC servers on `::ffff:127.0.0.1`, the rest on 127.0.0.1).

`ray.init(_node_ip_address="127.0.0.1")` does not get there: ray/_private/worker.py passes it through
`services.resolve_ip_for_localhost`, which replaces a loopback address with the host's. The one rule in Ray that
gives 127.0.0.1 is `services.get_node_ip_address`'s, which returns the loopback address when
`ray_constants.ENABLE_RAY_CLUSTER` is false (Ray's own setting on macOS and Windows, from
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, read once at import); node.py asks it for the node's address when none is
given. `loopback_node()` sets that constant false for the duration of `ray.init` and gives the old value back: the
processes Ray starts get the address on their command lines (`--node-ip-address=127.0.0.1`), not from the constant.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

RAY_VERSION = "2.60.0"
LOOPBACK = "127.0.0.1"


def _check_version() -> None:
    import ray

    if ray.__version__ != RAY_VERSION:
        raise RuntimeError(f"moe_grpo.orchestrator.ray_loopback was read against ray=={RAY_VERSION}, found "
                           f"ray=={ray.__version__}: check that services.get_node_ip_address still returns "
                           "the loopback address when ray_constants.ENABLE_RAY_CLUSTER is false, then update it")


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """Within it, a Ray cluster started by `ray.init(address="local")` takes 127.0.0.1 as its node's address."""
    from ray._private import ray_constants

    _check_version()
    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before
