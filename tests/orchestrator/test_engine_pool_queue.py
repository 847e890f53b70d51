"""The engine pool's queue of requests to send, changed only through its own methods (pure logic: plain objects
stand in for the engine actors; tests/orchestrator/test_engine_pool.py runs the repair on Ray actors).

What a user would notice: a prompt admitted while no engine is up is sent once one is, not lost; prompts sampled
for weights a rollback threw away are never sent; a probe request that failed is reported to the probe once."""

from types import SimpleNamespace

from moe_grpo.orchestrator.engine_pool import EnginePool, EngineSlot, Request


class Handle:
    """An engine actor's handle: `generate.remote` records the prompt it was sent."""

    def __init__(self):
        self.sent = []
        self.generate = self

    def remote(self, prompt_ids, sampling):
        self.sent.append((tuple(prompt_ids), sampling))
        return object()  # the request's reference


def pool(*statuses):
    rollout = SimpleNamespace(request_timeout_s=30.0, max_restarts=2, restart_window_s=600.0)
    slots = [EngineSlot(f"engine{i}", i, Handle(), status=status) for i, status in enumerate(statuses)]
    return EnginePool(slots, rollout, make_engine=lambda bundle: None, start_timeout_s=60.0)


def request(i, kind="train", epoch=0):
    return Request(kind, SimpleNamespace(prompt_ids=(i,)), seed=i, epoch=epoch)


def test_a_request_sent_while_no_engine_is_up_waits_and_goes_out_once_one_is_unless_a_rollback_came_between():
    p = pool("restarting")
    for r in (request(1), request(2, epoch=1), request(3, kind="eval", epoch=1)):
        p.send(r, sampling="s")
    assert p.in_flight_count("train") == 2 and not p.in_flight, "queued, not lost"
    p.resend(lambda r: f"sampling of {r.seed}", epoch=1)
    assert list(p.retry) == [request(1), request(2, epoch=1), request(3, kind="eval", epoch=1)], "no engine is up"
    p.slots["engine0"].status = "up"
    p.drop_queued("train")  # a rollback: fresh prompts replace the train requests
    p.queue(request(4, epoch=1))
    p.resend(lambda r: f"sampling of {r.seed}", epoch=1)
    assert p.slots["engine0"].handle.sent == [((3,), "sampling of 3"), ((4,), "sampling of 4")]
    assert not p.retry and p.slots["engine0"].load == 2
    p.send(request(5, epoch=1), sampling="s")
    assert p.slots["engine0"].handle.sent[-1] == ((5,), "s") and not p.retry


def test_failed_probe_requests_and_a_changed_engine_process_are_reported_once():
    p = pool("up")
    assert p.take_changed() and not p.take_changed(), "the start's processes are written once"
    p.failed_probes.append((request(1, kind="probe"), "engine0"))  # what `result` records for a failed probe
    assert p.take_failed_probes() == [(request(1, kind="probe"), "engine0")]
    assert p.take_failed_probes() == []
