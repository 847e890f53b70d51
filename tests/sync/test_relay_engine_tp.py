"""Over the relay, an engine host receives one copy of each version however many workers its engine has (issue 32,
Build item 3: "over the relay one copy per engine host, never one per worker").

A one-rank learner on host B publishes two versions with `sync.transport=relay`; host A (hosts simulated by
distinct shared-memory roots, as two `ray start` nodes on one machine are) holds a TP=2 `VllmEngine` and, as in a
run (orchestrator/sync_hosts.py), one `ShardReceiver` per sending learner rank writing into A's own buffers. The
receiver counts the bucket bytes that reach host A; the engine then applies each version from A's buffers
(`deliver.apply_version`), each of its two workers mapping the same bucket files.

What it would catch: a relay that sent a copy per engine worker (2x the bytes into the host), or an engine
whose workers read anything but their own host's buffers (a path outside A's root), or a version that reached
only one of the two workers.
"""

from __future__ import annotations

import secrets
import threading

import pytest

import layout_scenarios as S
from moe_grpo.learner.rendezvous import RunStoreServer
from moe_grpo.learner.spawn import run_distributed
from moe_grpo.sync.layout import SyncLayout
from moe_grpo.sync.shard_relay import ShardReceiver
from moe_grpo.sync.transport import SharedMemoryTransport

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.slow]

VERSIONS = [1, 2]


def _receive_counting(transport, layout: SyncLayout, rank: int, host: str, arrived: list, stop) -> None:
    """The host's receiver of `rank`'s shards, as the host agent runs it; every broadcast it takes part in is
    recorded in `arrived` as (what, bytes)."""
    receiver = ShardReceiver(transport, layout.group(rank), layout.member(rank, host), rank, layout.world,
                             claims=layout.claimer(host) == rank)
    if not receiver.connect(stop):
        return
    real = receiver.broadcast

    def counted(tensor, what):
        real(tensor, what)
        arrived.append((what, tensor.numel() * tensor.element_size()))

    receiver.broadcast = counted
    while receiver.receive() is not None:
        pass


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    """Versions relayed B -> A, then applied by a TP=2 engine on A: what arrived on A, the engine's reloads."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_learner
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.deliver import apply_version

    root = tmp_path_factory.mktemp("relay_tp2")
    spec = S.tiny_spec()
    start = export_learner(MegatronLearner(spec, config=LearnerConfig(seed=3)), str(root / "start"))
    secret = secrets.token_hex(32)
    server = RunStoreServer("127.0.0.1", 0, secret)
    roots = {"B": str(root / "hostB"), "A": str(root / "hostA")}
    layout = SyncLayout("relay", "run-8-8", rank_hosts=("B",), engine_hosts=("A",), store=("127.0.0.1", server.port),
                        secret=secret, timeout_s=120)
    host_a = SharedMemoryTransport(f"{roots['A']}/{layout.run_name}")
    arrived: list = []
    stop = threading.Event()
    receivers = [threading.Thread(target=_receive_counting, args=(host_a, layout, r, "A", arrived, stop))
                 for r in layout.streams_into("A")]
    for t in receivers:
        t.start()
    try:
        run_distributed(S.publish_versions, 1, 1, 1, VERSIONS, layout, [roots["B"]], False, timeout_s=300)
    finally:
        stop.set()
        for t in receivers:
            t.join(60)
        server.close()
    engine = VllmEngine(start, spec, max_model_len=128, max_num_seqs=4, tensor_parallel=2, name="tp2_relay")
    try:
        real, calls = engine._collective_rpc, []

        async def recorded(method, args=()):
            answers = await real(method, args)
            calls.append((method, args, list(answers or [])))
            return answers

        engine._collective_rpc = recorded
        applied = {}
        for version in VERSIONS:
            del calls[:]
            apply_version(engine, host_a, version)
            applied[version] = {"served": engine.policy_version,
                                "reloads": [(args, answers) for method, args, answers in calls
                                            if method == "moe_grpo_reload_bucket"]}
        yield {"layout": layout, "arrived": arrived, "applied": applied, "root_a": roots["A"],
               "version_bytes": {v: _tensor_bytes(host_a.wait_complete(v, 10)[1]) for v in VERSIONS},
               "workers": engine.tensor_parallel}
    finally:
        engine.shutdown()
        host_a.close()


def _tensor_bytes(plan) -> int:
    """A whole version's bytes: every tensor's elements (bucket files also hold alignment padding, never sent)."""
    return sum(e.numel for b in plan.buckets for e in b.entries) * plan.torch_dtype.itemsize


def test_the_engine_host_receives_one_copy_of_each_version_for_its_two_workers(relayed):
    layout = relayed["layout"]
    assert relayed["workers"] == 2
    assert layout.streams_into("A") == [0] and layout.group(0).world == 2, "one receiver on A, not one per worker"
    buckets = [(what, n) for what, n in relayed["arrived"] if what.startswith("bucket ")]
    for version in VERSIONS:
        got = sum(n for what, n in buckets if what.endswith(f"of version {version}"))
        assert got == relayed["version_bytes"][version], (version, got, relayed["version_bytes"][version])
    assert sum(n for _, n in buckets) == sum(relayed["version_bytes"].values())


def test_both_workers_load_each_relayed_version_from_the_engine_hosts_own_buffers(relayed):
    for version in VERSIONS:
        got = relayed["applied"][version]
        assert got["served"] == version
        assert got["reloads"], f"version {version}: no bucket reloaded"
        for args, answers in got["reloads"]:
            assert len(answers) == 2 and answers[0] == answers[1] > 0, answers  # both workers, same tensor count
            paths = [s["path"] for s in _sources(args)]
            assert paths and all(p.startswith(relayed["root_a"]) for p in paths), paths


def _sources(args) -> list[dict]:
    """The bucket sources handed to the workers in one reload call's arguments (wherever they sit in it)."""
    found = []
    for a in args:
        if isinstance(a, dict) and "path" in a:
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found += _sources(a)
    return found
