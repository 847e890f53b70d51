"""Wait until every node of the SLURM job has joined the Ray cluster: `python wait_for_nodes.py HEAD:PORT TIMEOUT_S
NODE...`. Exit 0 once each named node has a live raylet; 1 after TIMEOUT_S naming the nodes still missing (or when
the head cannot be reached at all). Ray's nodes are matched by host name, whole or up to its first dot."""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> int:
    address, timeout_s, expected = argv[0], float(argv[1]), argv[2:]
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except ConnectionError as e:  # the head is not up yet
            if time.monotonic() > deadline:
                print(f"[ray_cluster] the Ray head at {address} did not answer within {timeout_s:.0f} s: {e}",
                      file=sys.stderr)
                return 1
            time.sleep(0.5)
    while True:
        joined = set()
        for node in ray.nodes():
            if node.get("Alive"):
                name = str(node.get("NodeManagerHostname", ""))
                joined.update((name, name.split(".")[0]))
        missing = [n for n in expected if n not in joined and n.split(".")[0] not in joined]
        if not missing:
            print(f"[ray_cluster] all {len(expected)} node(s) joined the Ray cluster at {address}", flush=True)
            return 0
        if time.monotonic() > deadline:
            print(f"[ray_cluster] {len(expected) - len(missing)} of {len(expected)} node(s) joined the Ray cluster "
                  f"at {address} within {timeout_s:.0f} s; not joined: {' '.join(missing)}", file=sys.stderr)
            return 1
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
