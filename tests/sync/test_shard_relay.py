"""Transport 'relay': a learner split across hosts, each sync host assembling every version from every rank's
shards (hosts simulated by distinct shared-memory roots, as two `ray start` nodes on one machine are)."""

import secrets
import threading

import pytest
import torch

import layout_scenarios as S
import lora_scenarios as L
from moe_grpo.checkpoint.peft import write_peft_adapter
from moe_grpo.learner.rendezvous import RunStoreServer
from moe_grpo.learner.spawn import run_distributed
from moe_grpo.sync.layout import SyncLayout, resolve_transport
from moe_grpo.sync.shard_relay import ShardReceiver
from moe_grpo.sync.transport import SharedMemoryTransport
from test_gather import QWEN


def test_layout_names_each_ranks_host_its_receivers_and_who_claims():
    layout = SyncLayout("relay", "run-1-2", rank_hosts=("B", "A", "B", "C"), engine_hosts=("A", "A", "D"),
                        secret=secrets.token_hex(32))
    assert layout.hosts == ("B", "A", "D"), "rank 0's host first, then each engine host once"
    assert [layout.local_rank(r) for r in range(4)] == [0, 0, 1, 0]
    assert [layout.writes_locally(r) for r in range(4)] == [True, True, True, False]
    assert layout.stream_targets(0) == ("A", "D") and layout.stream_targets(3) == ("B", "A", "D")
    assert layout.streams_into("A") == [0, 2, 3] and layout.streams_into("D") == [0, 1, 2, 3]
    assert layout.claimer("B") == 0 and layout.claimer("A") == 1 and layout.claimer("D") == 0
    assert layout.group(3).world == 4 and layout.member(3, "D") == 3 and layout.group(3).prefix == "shards3"
    assert resolve_transport("auto", 1) == "shm" and resolve_transport("auto", 2) == "relay"
    with pytest.raises(ValueError, match="sync.transport=shm: .* placed on 2 hosts"):
        resolve_transport("shm", 2)
    with pytest.raises(ValueError, match="needs every learner rank and engine on one host"):
        SyncLayout("shm", "run-1-2", rank_hosts=("A", "B"), engine_hosts=("A",))


def _receive(transport, layout, rank, host, got, stop):
    receiver = ShardReceiver(transport, layout.group(rank), layout.member(rank, host), rank, layout.world,
                             claims=layout.claimer(host) == rank)
    try:
        if receiver.connect(stop):
            while receiver.receive() is not None:
                pass
    finally:
        got[(host, rank)] = receiver.received


def _relay_across_two_hosts(tmp_path, tp: int, ep: int, versions: list, delta: bool) -> tuple:
    """Rank 0 on host B (no engine), rank 1 on host A (the engine's) publish `versions` through the relay, a
    receiver thread per (host, sending rank); returns (what a one-host sync of the same weights wrote, each
    host's transport, what each receiver received, each rank's bytes per version)."""
    return _relay_two_hosts(tmp_path, S.publish_versions, (tp, ep, versions), (delta,))


def _relay_two_hosts(tmp_path, publish, before: tuple, after: tuple = (), slots: int = 2) -> tuple:
    """`publish(*before, where, roots, *after)` on two ranks, once through one host's shared memory (the
    reference) and once split over hosts B and A as `_relay_across_two_hosts` describes; each host keeps `slots`
    versions."""
    reference = str(tmp_path / "one_host")
    run_distributed(publish, 2, *before, reference, None, *after)
    secret = secrets.token_hex(32)
    server = RunStoreServer("127.0.0.1", 0, secret)
    roots = {"B": str(tmp_path / "hostB"), "A": str(tmp_path / "hostA")}
    layout = SyncLayout("relay", "run-7-7", rank_hosts=("B", "A"), engine_hosts=("A",), store=("127.0.0.1", server.port),
                        secret=secret, timeout_s=60, slots=slots)
    hosts = {h: SharedMemoryTransport(f"{roots[h]}/{layout.run_name}", slots) for h in roots}
    got: dict = {}
    stop = threading.Event()
    threads = [threading.Thread(target=_receive, args=(hosts[h], layout, r, h, got, stop))
               for h in roots for r in layout.streams_into(h)]
    for t in threads:
        t.start()
    try:
        written = run_distributed(publish, 2, *before, layout, [roots["B"], roots["A"]], *after, timeout_s=300)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        server.close()
    return SharedMemoryTransport(reference), hosts, got, written


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 1)], ids=["EP=2", "TP=2"])
def test_a_learner_split_across_hosts_publishes_whole_versions_on_every_sync_host(tmp_path, tp, ep):
    """Rank 0 on host B (no engine), rank 1 on host A (the engine's): each rank writes on its own host and relays
    its shards to the other; both hosts end up with every version bit-exact as a one-host sync writes it."""
    want, hosts, got, written = _relay_across_two_hosts(tmp_path, tp, ep, [1, 2], delta=False)
    assert got == {("A", 0): [1, 2], ("B", 1): [1, 2]}, "each host received each rank's part of each version once"
    assert all(w[1] > 0 and w[1] == w[2] for w in written)
    for h, transport in hosts.items():
        assert transport.latest_complete() == 2
        for version in (1, 2):
            a, b = want.read_version(version), transport.read_version(version)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (h, version)


@pytest.mark.multiprocess
def test_delta_versions_cross_hosts_as_their_changes_only_and_land_bit_exact(tmp_path):
    """sync.delta over the relay: each rank sends a version's encoded changes once; the other host brings its
    buffers forward (a chain through its recycled slots, or its shards copied from the slot of its previous
    version then the changes) to exactly what a one-host sync of the same weights writes."""
    versions = [1, 2, 3, 4, 5]
    want, hosts, got, written = _relay_across_two_hosts(tmp_path, 2, 1, versions, delta=True)
    assert got == {("A", 0): versions, ("B", 1): versions}
    full = sum(w[1] for w in written)  # version 1 goes whole
    for v in versions[1:]:
        sent = sum(w[v] for w in written)
        assert 0 < sent < full / 20, (v, sent, full)  # ~50 changed elements per moved parameter
    for h, transport in hosts.items():
        assert transport.latest_complete() == versions[-1]
        for version in versions[-2:]:  # the two slots a host keeps
            a, b = want.read_version(version), transport.read_version(version)
            assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
                                                for k in a), (h, version)
        assert transport.changed_since(versions[-2], versions[-1]) not in (None, set())


@pytest.mark.multiprocess
def test_a_lora_learner_split_across_hosts_relays_its_base_version_then_adapters_only(tmp_path):
    """lora.rank > 0 over the relay: version 0 crosses whole (base and adapters), versions after it carry the
    adapters only (their own plan, named in each version's header); both hosts hold every version bit-exact as a
    one-host sync writes it, and an adapter version's bytes are the adapters' only."""
    spec, lora = S.tiny_spec(**QWEN), L.lora_config()
    write_peft_adapter(tmp_path / "adapter", L.random_adapter_state(spec, lora), spec, lora)
    versions = [0, 1, 2]
    want, hosts, got, written = _relay_two_hosts(
        tmp_path, L.lora_publish_versions, (2, 1, QWEN, str(tmp_path / "adapter"), versions), slots=3)
    assert got == {("A", 0): versions, ("B", 1): versions}, "each host received each rank's part of each version"
    base, adapters = sum(w[0] for w in written), sum(w[1] for w in written)
    assert adapters == sum(w[2] for w in written) and 0 < adapters < base / 5, (base, adapters)
    # Each host wrote its own rank's shards and received the other's: equal hosts mean each relayed half equals
    # what the other rank wrote locally; the one-host reference keeps the last two versions.
    on_a, on_b = ({v: t.read_version(v) for v in versions} for t in (hosts["A"], hosts["B"]))
    for version in versions:
        a, b = on_a[version], on_b[version]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), version
        plan = hosts["A"].wait_complete(version, 5)[1]
        assert plan.lora is not None and plan.lora.base == (version == 0), version
    for version in versions[-2:]:
        want_v = want.read_version(version)
        assert want_v.keys() == on_a[version].keys()
        assert all(torch.equal(want_v[k], on_a[version][k]) for k in want_v), version
    assert set(on_a[2]) < set(on_a[0]), "versions after the first carry the adapters only"
    assert not any(torch.equal(on_a[0][k], on_a[2][k]) for k in on_a[2]), "every adapter moved between versions"
