"""The run's rendezvous store admits only holders of the run's secret and listens on one address."""

import datetime
import secrets
import socket
import threading
import time

import pytest

from moe_grpo.learner.rendezvous import RunStore, RunStoreServer, StoreAuthError

T = datetime.timedelta(seconds=5)


@pytest.fixture
def served():
    secret = secrets.token_hex(32)
    server = RunStoreServer("127.0.0.1", 0, secret)
    yield server, secret
    server.close()


def _wait_rejected(server, n, limit_s=5.0):
    deadline = time.monotonic() + limit_s
    while server.rejected < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.rejected


def test_members_share_keys_and_counters(served):
    server, secret = served
    a, b = RunStore("127.0.0.1", server.port, secret, T), RunStore("127.0.0.1", server.port, secret, T)
    a.set("addr/0", b"10.0.0.1:1234")
    assert b.get("addr/0") == b"10.0.0.1:1234"
    assert [a.add("n", 1), b.add("n", 1)] == [1, 2]
    assert b.compare_set("k", "", "v") == b"v" and a.compare_set("k", "x", "w") == b"v"
    assert a.check(["addr/0", "n"]) and not a.check(["missing"])
    later = threading.Timer(0.3, lambda: a.set("late", b"1"))
    later.start()
    assert b.get("late") == b"1"  # get waits for the key
    with pytest.raises(TimeoutError, match="missing"):
        b.wait(["missing"], datetime.timedelta(seconds=0.3))


def test_a_process_without_the_secret_gets_no_key_and_members_go_on(served):
    server, secret = served
    member = RunStore("127.0.0.1", server.port, secret, T)
    member.set("gloo/rank0", b"127.0.0.1:5555")
    with pytest.raises(StoreAuthError, match="handshake failed"):
        RunStore("127.0.0.1", server.port, secrets.token_hex(32), T)
    # torch's own TCPStore client (what read the keys of the old store) gets no answer at all
    import torch.distributed as dist

    with pytest.raises(Exception):
        intruder = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=2))
        intruder.list_keys()
    assert _wait_rejected(server, 2) >= 2
    assert member.get("gloo/rank0") == b"127.0.0.1:5555" and member.num_keys() == 1


def test_a_silent_connection_does_not_hold_up_members(served):
    server, secret = served
    silent = socket.create_connection(("127.0.0.1", server.port))  # connects, never answers the challenge
    try:
        t0 = time.monotonic()
        RunStore("127.0.0.1", server.port, secret, T).set("k", b"v")
        assert time.monotonic() - t0 < 2
    finally:
        silent.close()


def test_a_member_refuses_a_server_without_the_secret():
    """Someone who took the port first cannot pose as the run's store (the handshake is mutual)."""
    impostor = RunStoreServer("127.0.0.1", 0, secrets.token_hex(32))
    try:
        with pytest.raises(StoreAuthError, match="not this run's store"):
            RunStore("127.0.0.1", impostor.port, secrets.token_hex(32), T)
    finally:
        impostor.close()


def _non_loopback_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent, it only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def test_the_store_listens_on_loopback_only(served):
    import psutil

    server, _ = served
    listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == server.port]
    assert [a.ip for a in listening] == ["127.0.0.1"]
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback address to try")
    with pytest.raises(OSError):
        socket.create_connection((ip, server.port), timeout=2).close()


def test_a_short_secret_is_refused():
    with pytest.raises(ValueError, match="at least 32"):
        RunStoreServer("127.0.0.1", 0, "short")


@pytest.mark.multiprocess
def test_learner_ranks_meet_on_loopback_and_a_process_without_the_secret_cannot_join():
    import layout_scenarios as S

    from moe_grpo.learner.spawn import run_distributed

    rank0, rank1 = run_distributed(S.intrude_on_the_learner_store, 2, timeout_s=300)
    assert rank0["tcpstore"] == "DistNetworkError" and rank0["runstore"] == "StoreAuthError"
    assert rank0["store_port_listening"] and rank0["listening"] == ["127.0.0.1"]  # gloo's pair sockets too
    assert rank0["sum"] == rank1["sum"] == 3.0  # the run goes on
