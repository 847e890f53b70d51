"""Relaying published versions to other hosts' transports over a private gloo group (hosts simulated by roots)."""

import multiprocessing as mp
import time

import pytest
import torch

import layout_scenarios as S
from moe_grpo.learner.spawn import free_port
from moe_grpo.sync.plan import plan_buckets
from moe_grpo.sync.relay import RelayGroup, RelaySender
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError

pytestmark = [pytest.mark.multiprocess]


def publish_random(transport, version, seed):
    """A whole version of random tensors, written as one learner rank would."""
    plan = plan_buckets(S.tiny_spec(), torch.float32, 1 << 18)
    slot = transport.claim(version, plan, 0, 1)
    g = torch.Generator().manual_seed(seed)
    for b in plan.buckets:
        with transport.bucket_views(slot, b, torch.float32) as views:
            for t in views.values():
                t.copy_(torch.randn(t.shape, generator=g))
    transport.mark_done(slot, version, 0, {b.index: sum(e.numel for e in b.entries) for b in plan.buckets})


def start_receivers(tmp_path, port, world, die_after=-1):
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=S.relay_receive,
                        args=("127.0.0.1", port, world, rank, str(tmp_path / f"host{rank}"), die_after if rank == 1 else -1))
        p.start()
        procs.append(p)
    return procs


def test_every_host_gets_each_version_bit_exact(tmp_path):
    source = SharedMemoryTransport(str(tmp_path / "learner_host"))
    port = free_port()
    procs = start_receivers(tmp_path, port, 3)
    sender = RelaySender(source, RelayGroup("127.0.0.1", port, 3, timeout_s=30))
    for version in (1, 2, 3):
        publish_random(source, version, seed=version)
        report = sender.send(version)
        assert report["relay/bytes"] > 4e6
    sender.close()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in (1, 2):
        host = SharedMemoryTransport(str(tmp_path / f"host{rank}"))
        assert host.latest_complete() == 3
        for version in (2, 3):  # the two slots each host keeps
            want, got = source.read_version(version), host.read_version(version)
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_receiver_killed_mid_version_fails_the_sender_by_name_and_leaves_nothing_to_apply(tmp_path):
    source = SharedMemoryTransport(str(tmp_path / "learner_host"))
    publish_random(source, 1, seed=1)
    port = free_port()
    procs = start_receivers(tmp_path, port, 2, die_after=2)
    sender = RelaySender(source, RelayGroup("127.0.0.1", port, 2, timeout_s=20))
    t0 = time.monotonic()
    with pytest.raises(SyncError, match=r"relay sender \(rank 0 of 2 at 127.0.0.1:\d+\) failed while broadcasting bucket"):
        sender.send(1)
    assert time.monotonic() - t0 < 25
    procs[0].join(10)
    assert procs[0].exitcode == -9
    assert SharedMemoryTransport(str(tmp_path / "host1")).latest_complete() is None
