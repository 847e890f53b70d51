"""The shared-memory transport's part in delta versions: which version a recycled slot still holds whole, and
which tensors changed between two versions (moe_grpo/sync/transport.py)."""

import torch

from layout_scenarios import tiny_spec
from moe_grpo.sync.plan import plan_buckets
from moe_grpo.sync.transport import CHANGE_LOG, SharedMemoryTransport, sources_of


def _publish(transport: SharedMemoryTransport, version: int, plan, world: int = 1) -> str:
    slot = transport.claim(version, plan, 0, world)
    for rank in range(world):
        transport.mark_done(slot, version, rank, {b.index: sum(e.numel for e in b.entries) // world
                                                  for b in plan.buckets})
    return slot


def test_a_recycled_slot_names_the_version_it_held_whole_and_a_new_or_unfinished_one_names_none(tmp_path) -> None:
    """A delta is applied onto what the slot holds: a wrong base would give engines a mix of two versions."""
    transport = SharedMemoryTransport(str(tmp_path / "sync"), slots=2)
    plan = plan_buckets(tiny_spec(), torch.bfloat16, 1 << 20)
    s1 = _publish(transport, 1, plan)
    s2 = _publish(transport, 2, plan)
    assert transport.slot_base(s1) is None and transport.slot_base(s2) is None  # new slots
    s3 = _publish(transport, 3, plan)
    assert s3 == s1 and transport.slot_base(s3) == 1
    transport.pin("engine0", {s2: 2})
    s4 = transport.claim(4, plan, 0, 2)  # slot of 3 is the only free one; rank 1 never finishes version 4
    assert s4 == s1 and transport.slot_base(s4) == 3
    transport.mark_done(s4, 4, 0, {b.index: 1 for b in plan.buckets})
    s5 = transport.claim(5, plan, 0, 1)  # the half-written slot is not free, the pinned one neither: a new slot
    assert s5 not in (s1, s2) and transport.slot_base(s5) is None
    transport.forget_base(s2)
    assert transport.slot_base(s2) is None


def test_changed_since_unites_every_ranks_changes_along_the_chain_and_knows_when_it_does_not_know(tmp_path) -> None:
    """An engine two versions behind must reload what either version changed on any rank; where a link is
    missing or a version changed everything it must reload everything, never too little."""
    transport = SharedMemoryTransport(str(tmp_path / "sync"))
    transport.log_changes(1, 0, None, None)
    transport.log_changes(1, 1, None, None)
    transport.log_changes(2, 0, 1, ["a"])
    transport.log_changes(2, 1, 1, [])
    transport.log_changes(3, 0, 2, ["b"])
    transport.log_changes(3, 1, 2, ["c"])
    assert transport.changed_since(2, 3, world=2) == {"b", "c"}
    assert transport.changed_since(1, 3, world=2) == {"a", "b", "c"}
    assert transport.changed_since(0, 3, world=2) is None  # version 1 changed everything
    assert transport.changed_since(1, 3, world=3) is None  # rank 2 logged nothing
    for v in range(4, 5 + CHANGE_LOG):
        transport.log_changes(v, 0, v - 1, [f"t{v}"])
    assert transport.changed_since(3, 4 + CHANGE_LOG, world=1) is None  # older than the log keeps
    assert transport.changed_since(10, 12, world=1) == {"t11", "t12"}


def test_an_engine_behind_by_a_delta_gets_only_the_changed_tensors_of_each_bucket(tmp_path) -> None:
    transport = SharedMemoryTransport(str(tmp_path / "sync"))
    plan = plan_buckets(tiny_spec(), torch.bfloat16, 1 << 16)
    sources = transport.bucket_sources(str(tmp_path / "slot0"), plan)
    last = plan.buckets[-1].entries[-1].name
    first = plan.buckets[0].entries[0].name
    cut = sources_of(sources, {first, last})
    assert [[e[0] for e in s["entries"]] for s in cut] == [[first], [last]]
    assert cut[0]["path"] == sources[0]["path"] and cut[1]["path"] == sources[-1]["path"]
    assert sources_of(sources, set()) == []


def test_an_engine_reloads_whole_parts_of_a_layer_never_part_of_a_vllm_module() -> None:
    """vLLM rebuilds a module that gets only some of its weights from fresh storage: reloading q_proj without k/v
    (one qkv module) or one expert without the rest of its FusedMoE gave NaN log-probs in
    tests/sync/test_delta_engine.py before whole parts were reloaded."""
    from moe_grpo.sync.deliver import reload_groups

    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(3) for p in ("gate", "up", "down")]
    names += ["model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
              "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
              "model.layers.1.input_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"]
    got = reload_groups({"model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
                         "model.layers.1.mlp.gate.e_score_correction_bias", "lm_head.weight"}, names)
    assert got == ({f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"}
                   | {n for n in names if ".experts." in n}
                   | {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                      "lm_head.weight"})


def test_a_slot_rewritten_within_one_clock_tick_is_read_anew(tmp_path) -> None:
    """On a disk-backed root a replaced version.json can come back with the same inode number, size and (coarse)
    mtime; a cache keyed by those served the old version, and a relay receiver waited 60 s for a version that was
    there (seen in tests/sync/test_shard_relay.py's delta test, about one run in four)."""
    import os
    from pathlib import Path

    transport = SharedMemoryTransport(str(tmp_path / "sync"))
    plan = plan_buckets(tiny_spec(), torch.bfloat16, 1 << 20)
    slot = _publish(transport, 3, plan)
    assert transport.find(3) == slot
    path = Path(slot) / "version.json"
    st = os.stat(path)
    path.write_text(path.read_text().replace('"version": 3', '"version": 5', 1))  # same inode, same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert transport.find(5) == slot and transport.find(3) is None


def test_an_extra_slot_still_being_written_is_never_removed(tmp_path) -> None:
    """A relay receiver fills the slot it found for a version before it pins it; removing that slot (it was an
    extra one, unpinned) failed the receiver with FileNotFoundError and stalled every later version."""
    import os

    transport = SharedMemoryTransport(str(tmp_path / "sync"), slots=2)
    plan = plan_buckets(tiny_spec(), torch.bfloat16, 1 << 20)
    s1, s2 = _publish(transport, 1, plan), _publish(transport, 2, plan)
    transport.pin("engine0", {s1: 1, s2: 2})  # both pinned: version 3 opens an extra slot
    s3 = transport.claim(3, plan, 0, 2)
    transport.mark_done(s3, 3, 0, {b.index: 1 for b in plan.buckets})  # rank 1's receiver is still writing
    transport.unpin("engine0")
    s4 = transport.claim(4, plan, 0, 2)
    assert os.path.isdir(s3) and transport.find(3) == s3, "the version in progress was removed"
    assert s4 == s1 and len(transport._slots()) == 2  # the oldest finished slot reused, the other one removed
    for rank in (0, 1):
        transport.mark_done(s4, 4, rank, {b.index: 1 for b in plan.buckets})
    transport.pin("engine0", {s4: 4})
    s5 = transport.claim(5, plan, 0, 1)  # rank 1 never finished version 3, and version 4 is complete
    assert not os.path.exists(s3) and {str(p) for p in transport._slots()} == {s4, s5}


def test_a_version_claimed_again_after_an_unfinished_attempt_is_found_in_its_new_slot(tmp_path) -> None:
    """A learner killed while writing version 3 leaves a slot labelled 3 that never completes; the next claim of
    version 3 (the engine still serves 2) must not leave that slot for find() to answer with (engines then waited
    120 s for 'rank 0' on the abandoned slot: tests/sync/test_sync.py after ac6a064)."""
    transport = SharedMemoryTransport(str(tmp_path / "sync"), slots=2)
    plan = plan_buckets(tiny_spec(), torch.bfloat16, 1 << 20)
    s1, s2 = _publish(transport, 1, plan), _publish(transport, 2, plan)
    transport.pin("engine0", {s1: 1, s2: 2})
    dead = transport.claim(3, plan, 0, 1)  # never marked done
    again = _publish(transport, 3, plan)
    assert transport.find(3) == again
    assert transport.wait_complete(3, timeout_s=1)[0] == again
    assert dead == again or not __import__("os").path.exists(dead)
