"""Fake `ray` for the join check (examples/slurm/wait_for_nodes.py): the nodes whose fake `ray start` marked
themselves joined in $FAKE_STATE/joined are the cluster's live nodes."""

import os


def init(address, **kwargs):
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"bad address {address!r}")
    with open(os.path.join(os.environ["FAKE_STATE"], "ray_init.log"), "a") as f:
        f.write(address + "\n")


def nodes():
    joined = os.path.join(os.environ["FAKE_STATE"], "joined")
    return [{"NodeManagerHostname": f"{name}.cluster", "Alive": True} for name in sorted(os.listdir(joined))]
