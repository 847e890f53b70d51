"""Weight versions into an engine whose vLLM workers are on two hosts (pipeline stages across nodes, issue 32, PP),
without Ray: every host of the engine is a sync host that receives each version once, the engine's actor waits
for the version on each host and pins it there, and each worker opens its own host's copy.

Hosts are simulated by distinct shared-memory roots (as two `ray start` nodes on one machine are); the other
host's `SyncHostAgent` is the real class, called in-process instead of through Ray. Before sync/engine_hosts.py an
engine's second host was no sync host (nothing was relayed to it) and every worker was handed the actor's host's
file paths, which do not exist on another machine."""

import pytest
import torch

from moe_grpo.config import load_model_spec
from moe_grpo.orchestrator.sync_hosts import SyncHostAgent, engine_host_agents
from moe_grpo.sync.engine_hosts import EngineHostsReceiver, own_path
from moe_grpo.sync.layout import SyncLayout
from moe_grpo.sync.transport import read_bucket
from moe_grpo.sync.transports import make_receiver, shared_memory
from moe_grpo.sync.plan import Bucket, BucketEntry, DTYPES
from publishing import publish_version

SPEC = load_model_spec("deepseek_moe")


def _layout(**kw):
    """Learner rank 0 on host L; engine0's actor (stage 0) on A, its stage-1 workers on B (8 bundles there)."""
    return SyncLayout("relay", "run-test", ("L",), ("A",), engine_worker_hosts=(("A",) * 8 + ("B",) * 8,), **kw)


def test_every_host_of_a_spanning_engine_is_a_sync_host_served_once():
    """B is a sync host once however many of the engine's workers it holds; learner rank 0 relays to A and B."""
    layout = _layout()
    assert layout.hosts == ("L", "A", "B")
    assert layout.stream_targets(0) == ("A", "B")
    assert layout.streams_into("B") == [0]
    assert layout.worker_hosts(0) == ("B",)
    one_host = SyncLayout("relay", "run-test", ("L",), ("A",))
    assert one_host.hosts == ("L", "A") and one_host.worker_hosts(0) == ()
    with pytest.raises(ValueError, match=r"sync.transport=shm needs every learner rank and engine on one host "
                                         r"\(each engine's workers too\); this run spans 2 hosts"):
        SyncLayout("shm", "run-test", ("A",), ("A",), engine_worker_hosts=(("A", "B"),))


def test_the_engine_gets_the_agent_of_each_other_host_and_a_missing_one_is_named():
    layout = _layout()
    assert engine_host_agents(layout, ["agent-L", "agent-A", "agent-B"], 0) == {"B": "agent-B"}
    assert engine_host_agents(SyncLayout("relay", "run-test", ("L",), ("A",)), ["agent-L", "agent-A"], 0) is None
    with pytest.raises(RuntimeError, match=r"engine0's workers are on host\(s\) B without a weight relay agent"):
        engine_host_agents(layout, ["agent-L", "agent-A"], 0)


def _agent(tmp_path, name):
    layout = SyncLayout("relay", "run-test", ("L",), ("A",), root=str(tmp_path / name), slots=2)
    return SyncHostAgent(layout, name, serve_store=False)


def _read(source, node):
    bucket = Bucket(0, tuple(BucketEntry(n, tuple(s), o) for n, s, o in source["entries"]), int(source["nbytes"]))
    with read_bucket(own_path(source, lambda: node), bucket, DTYPES[source["dtype"]]) as tensors:
        return {k: v.clone() for k, v in tensors.items()}


def test_each_worker_reads_its_own_hosts_copy_pinned_there_for_the_engine(tmp_path):
    """Version 1 is published into A (fill 1.0) and into B, whose slot differs (B already held version 0; fill 2.0,
    so the test can tell which host's file a worker opened). The receiver waits for it on both, hands workers
    each host's file (`paths`), a worker on B reads B's and one outside Ray A's; the pin holds B's slot for the
    engine while versions 2 and 3 arrive on B (2 slots: unpinned, version 3 would take version 1's)."""
    local = shared_memory(str(tmp_path / "A"), 2)
    agent_b = _agent(tmp_path, "B")
    publish_version(agent_b.transport, 0, SPEC, fill=9.0)
    slot_b, _ = publish_version(agent_b.transport, 1, SPEC, fill=2.0)
    slot_a, plan = publish_version(local, 1, SPEC, fill=1.0)
    calls = []

    def call(agent, method, args):
        calls.append(method)
        return getattr(agent, method)(*args)

    receiver = make_receiver(str(tmp_path / "A"), {"B": agent_b}, "A")
    assert isinstance(receiver, EngineHostsReceiver)
    receiver._call = call
    slot, got_plan = receiver.wait_complete(1, timeout_s=5)
    assert slot == slot_a and got_plan == plan and slot_b != slot_a.replace(str(tmp_path / "A"), str(tmp_path / "B"))
    sources = receiver.bucket_sources(slot, plan)
    assert len(sources) == len(plan.buckets)
    for source in sources:
        assert source["paths"]["A"].startswith(slot_a) and source["paths"]["B"].startswith(slot_b)
    assert all(bool((t == 2.0).all()) for t in _read(sources[0], "B").values())
    assert all(bool((t == 1.0).all()) for t in _read(sources[0], "A").values())
    assert all(bool((t == 1.0).all()) for t in _read(sources[0], None).values())  # no Ray: the actor's host

    receiver.pin("engine0", {slot: 1})
    publish_version(agent_b.transport, 2, SPEC, fill=3.0)
    publish_version(agent_b.transport, 3, SPEC, fill=4.0)  # both into B's other slot: version 1's is pinned
    assert agent_b.transport.find(1) == slot_b
    receiver.unpin("engine0")
    publish_version(agent_b.transport, 4, SPEC, fill=5.0)
    publish_version(agent_b.transport, 5, SPEC, fill=6.0)
    assert agent_b.transport.find(1) is None  # unpinned on B too: its slot was reused
    assert calls == ["complete", "pin", "unpin"]
    agent_b.close()


def test_an_engine_on_one_host_is_handed_no_per_host_paths(tmp_path):
    """The multiprocessing path is unchanged: its receiver is the host's buffers and its sources carry no
    `paths` (a worker never asks which Ray node it is on)."""
    receiver = make_receiver(str(tmp_path / "A"))
    slot, plan = publish_version(receiver, 1, SPEC, fill=1.0)
    sources = receiver.bucket_sources(slot, plan)
    assert "paths" not in sources[0]
    assert own_path(sources[0], lambda: pytest.fail("asked for a node")) == sources[0]["path"]
