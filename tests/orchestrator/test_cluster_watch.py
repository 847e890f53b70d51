"""The Ray cluster's GCS (orchestrator/cluster_watch.py), on real sockets: a GCS gone for the grace is reported once,
naming its address; one that comes back within it, or a watch turned off, reports nothing. Joining: an address
where nothing answers is named instead of waited on; a token at hand is presented, a cluster with token
authentication joined without RAY_AUTH_MODE in the environment."""

import socket
import threading
import time

import pytest

from moe_grpo.orchestrator.cluster_watch import GcsWatch, gcs_answers


def listening() -> tuple[socket.socket, str]:
    server = socket.create_server(("127.0.0.1", 0))
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def test_a_gcs_gone_for_the_grace_is_reported_once_naming_its_address():
    server, address = listening()
    reports, reported = [], threading.Event()
    watch = GcsWatch(address, lost_after_s=0.5, period_s=0.1,
                     on_lost=lambda why: (reports.append(why), reported.set()))
    watch.start()
    try:
        assert gcs_answers(address)
        time.sleep(0.4)
        assert not reports and watch.lost_at is None, "a GCS that answers is never reported"
        server.close()
        t0 = time.monotonic()
        assert reported.wait(5), "the GCS went and nothing was reported"
        assert 0.3 <= time.monotonic() - t0 < 3, "reported after about lost_after_s"
        time.sleep(0.3)
        assert len(reports) == 1 and address in reports[0] and "stopped answering" in reports[0]
        assert watch.lost_at is not None
    finally:
        watch.stop()
        server.close()


def test_a_gcs_back_within_the_grace_costs_nothing_and_a_watch_turned_off_never_starts():
    server, address = listening()
    port = int(address.rsplit(":", 1)[1])
    reports = []
    watch = GcsWatch(address, lost_after_s=2.0, period_s=0.1, on_lost=reports.append)
    watch.start()
    try:
        server.close()
        time.sleep(0.3)  # a GCS restarting (Ray's fault tolerance): back on the same port
        server = socket.create_server(("127.0.0.1", port))
        time.sleep(2.2)  # past the grace counted from the first refusal
        assert reports == [] and watch.lost_at is None
    finally:
        watch.stop()
        server.close()
    off = GcsWatch(address, lost_after_s=0, on_lost=reports.append)
    off.start()
    assert off._thread is None
    time.sleep(0.3)
    assert reports == []


def closed_address() -> str:
    server, address = listening()
    server.close()
    return address


def test_joining_an_address_where_no_cluster_answers_fails_naming_it_instead_of_waiting_without_end(monkeypatch):
    """`ray.init(address=...)` where nothing listens waited without end (a run still waiting after 400 s, printing
    Ray's retries); now the run gives it `JOIN_WAIT_S` and stops in one line naming the address."""
    import ray

    from moe_grpo.orchestrator import cluster_watch, pools

    address = closed_address()
    monkeypatch.setattr(cluster_watch, "JOIN_WAIT_S", 0.5)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called: it would wait without end"))
    t0 = time.monotonic()
    with pytest.raises(cluster_watch.ClusterUnreachable, match=f"no Ray cluster answers at cluster.ray_address="
                                                               f"{address} .*for 0 s"):
        pools.join_ray(address)
    assert time.monotonic() - t0 < 5


def test_a_token_at_hand_turns_token_authentication_on_for_a_join_and_a_set_mode_is_left_alone(tmp_path):
    """In a process of its own (Ray's token loader and config are process-wide): Ray 2.60's `ray start --head`
    turns authentication on when the user has a token, and `ray.init(address=...)` does not, so a run joining such a
    cluster was refused for 20 s and failed without saying why (a user's trial, 2026-11-28)."""
    import os
    import subprocess
    import sys

    check = ("import os; from moe_grpo.orchestrator.pools import token_auth_for_join; "
             "print(token_auth_for_join(), os.environ.get('RAY_AUTH_MODE'))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(tmp_path)}

    def answer(**env: str) -> str:
        out = subprocess.run([sys.executable, "-c", check], env=base | env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split("\n")[-2]

    assert answer() == "False None", "no token at hand: nothing to present"
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef0123456789abcdef")
    assert answer() == "True token"
    assert answer(RAY_AUTH_MODE="disabled") == "False disabled", "a mode the user set is theirs"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_session_cluster_with_token_authentication_is_joined_without_ray_auth_mode_set(session_ray_address):
    """The session's cluster starts as a run's own does (Ray 2.60 turns token authentication on); a process
    joining it by address without RAY_AUTH_MODE in its environment was refused for 20 s, then failed."""
    import os
    import subprocess
    import sys

    join = ("import ray; from moe_grpo.orchestrator.pools import join_ray; "
            f"join_ray({session_ray_address!r}); print('CPUs', ray.cluster_resources()['CPU'])")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    out = subprocess.run([sys.executable, "-c", join], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "CPUs" in out.stdout, out.stderr[-3000:]  # refused: it failed after 20 s
