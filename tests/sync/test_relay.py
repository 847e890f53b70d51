"""Relaying published versions to other hosts' transports over a private gloo group (hosts simulated by roots)."""

import datetime
import multiprocessing as mp
import os
import secrets
import sys
import time

import pytest
import torch

import layout_scenarios as S
from moe_grpo.learner.spawn import free_port
from moe_grpo.sync.plan import plan_buckets
from moe_grpo.sync.relay import RelayGroup
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from whole_relay import RelaySender  # noqa: E402  (the whole-version relay lives beside the bench that times it)

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


def start_receivers(tmp_path, port, world, secret, die_after=-1):
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world):
        p = ctx.Process(target=S.relay_receive, args=("127.0.0.1", port, world, secret, rank,
                                                      str(tmp_path / f"host{rank}"), die_after if rank == 1 else -1))
        p.start()
        procs.append(p)
    return procs


def test_every_host_gets_each_version_bit_exact(tmp_path):
    source = SharedMemoryTransport(str(tmp_path / "learner_host"))
    port, secret = free_port(), secrets.token_hex(32)
    procs = start_receivers(tmp_path, port, 3, secret)
    sender = RelaySender(source, RelayGroup("127.0.0.1", port, 3, secret, timeout_s=30))
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
    port, secret = free_port(), secrets.token_hex(32)
    procs = start_receivers(tmp_path, port, 2, secret, die_after=2)
    sender = RelaySender(source, RelayGroup("127.0.0.1", port, 2, secret, timeout_s=20))
    t0 = time.monotonic()
    with pytest.raises(SyncError, match=r"relay sender \(rank 0 of 2 at 127.0.0.1:\d+\) failed while broadcasting bucket"):
        sender.send(1)
    assert time.monotonic() - t0 < 25
    procs[0].join(10)
    assert procs[0].exitcode == -9
    assert SharedMemoryTransport(str(tmp_path / "host1")).latest_complete() is None


def _intrude(port, result):
    """Another local process that reaches the relay's port but lacks the secret: torch's own store client and a
    member's client with a wrong secret."""
    import torch.distributed as dist

    from moe_grpo.learner.rendezvous import RunStore

    outcomes = []
    try:
        outcomes.append(("tcpstore", dist.TCPStore("127.0.0.1", port, None, False,
                                                   datetime.timedelta(seconds=3)).list_keys()))
    except Exception as e:  # noqa: BLE001
        outcomes.append(("tcpstore", type(e).__name__))
    try:
        outcomes.append(("runstore", RunStore("127.0.0.1", port, secrets.token_hex(32),
                                              datetime.timedelta(seconds=3)).num_keys()))
    except Exception as e:  # noqa: BLE001
        outcomes.append(("runstore", type(e).__name__))
    result.extend(outcomes)


def test_a_process_without_the_secret_cannot_join_and_the_relay_goes_on(tmp_path):
    import psutil

    source = SharedMemoryTransport(str(tmp_path / "learner_host"))
    port, secret = free_port(), secrets.token_hex(32)
    procs = start_receivers(tmp_path, port, 2, secret)
    sender = RelaySender(source, RelayGroup("127.0.0.1", port, 2, secret, timeout_s=30))
    listening = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}
    assert listening == {"127.0.0.1"}
    tried: list = []
    intruder = __import__("threading").Thread(target=_intrude, args=(port, tried))
    intruder.start()
    publish_random(source, 1, seed=1)
    sender.send(1)
    intruder.join(30)
    sender.close()
    procs[0].join(60)
    assert procs[0].exitcode == 0
    assert [who for who, what in tried if not isinstance(what, str)] == []  # no keys, no key count
    assert sender.broadcast.server.rejected >= 2  # torch's client retries: one rejection per try
    want, got = source.read_version(1), SharedMemoryTransport(str(tmp_path / "host1")).read_version(1)
    assert all(torch.equal(got[k], want[k]) for k in want)
