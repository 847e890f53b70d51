"""The GCS watch (orchestrator/cluster_watch.py) on a real socket: a GCS gone for the grace is reported once, naming
its address; one that comes back within it, or a watch turned off, reports nothing."""

import socket
import threading
import time

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
        assert watch.lost_at is not None and watch.seconds_left() < 60
    finally:
        watch.stop()
        server.close()


def test_a_gcs_back_within_the_grace_costs_nothing_and_a_watch_turned_off_never_starts():
    server, address = listening()
    port = int(address.rsplit(":", 1)[1])
    reports = []
    watch = GcsWatch(address, lost_after_s=1.0, period_s=0.1, on_lost=reports.append)
    watch.start()
    try:
        server.close()
        time.sleep(0.4)  # a GCS restarting (Ray's fault tolerance): back on the same port
        server = socket.create_server(("127.0.0.1", port))
        time.sleep(1.3)
        assert reports == [] and watch.lost_at is None and watch.seconds_left() == float("inf")
    finally:
        watch.stop()
        server.close()
    off = GcsWatch(address, lost_after_s=0, on_lost=reports.append)
    off.start()
    assert off._thread is None
    time.sleep(0.3)
    assert reports == []
