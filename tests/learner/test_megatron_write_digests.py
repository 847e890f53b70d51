"""The shard-digest patch: megatron-core's checkpoint writer hashes each shard as it writes it, so a run checkpoint
never reads its learner shards back to hash them (a second pass over a real model's checkpoint costs as long as
writing it)."""

import hashlib
import os

import pytest

from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.learner import megatron_write_digests as digests


def sha256(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_the_patch_refuses_another_megatron_core_version(monkeypatch):
    import moe_grpo.learner.megatron_cpu as megatron_cpu

    monkeypatch.setattr(megatron_cpu, "megatron_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError, match=r"megatron-core==0\.16\.1, found 0\.17\.0"):
        digests.apply()


def test_only_files_written_under_a_recorded_directory_leave_digests(tmp_path):
    """Would have caught: conversion tools and exports in the same process leaving digest files in their output."""
    digests.apply()
    writer_open = digests._writer_module().open
    outside = tmp_path / "export.distcp"
    with digests.recording(tmp_path / "ckpt"):
        os.makedirs(tmp_path / "ckpt")
        with writer_open(tmp_path / "ckpt" / "a.distcp", "wb") as f:
            f.write(b"abc")
            f.write(memoryview(b"defg"))
            assert f.tell() == 7
        with writer_open(outside, "wb") as f:
            f.write(b"xyz")
    got = digests.read_digest(tmp_path / "ckpt" / ("a.distcp" + digests.DIGEST_SUFFIX))
    assert got == digests.Digest(7, hashlib.sha256(b"abcdefg").hexdigest())
    assert not os.path.exists(str(outside) + digests.DIGEST_SUFFIX)


@pytest.mark.slow
def test_a_learner_s_run_state_shards_carry_the_digest_of_what_was_written(tmp_path):
    """Would have caught: the run checkpoint reading every learner shard a second time to hash it (no digest file
    is left without the patch: this test fails with `digests.revert()` before the save)."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    digests.revert()  # (an earlier test in this process may have applied it)
    spec = tiny_spec()
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    learner.train_step(make_sequences(spec, n=2))
    assert digests.applied(), "the learner's start applies the patch"
    learner.save_run_state(str(tmp_path / "state"))
    shards = sorted((tmp_path / "state" / "dist").glob("*.distcp"))
    assert shards
    for shard in shards:
        got = digests.read_digest(str(shard) + digests.DIGEST_SUFFIX)
        assert got == digests.Digest(shard.stat().st_size, sha256(shard)), shard
    # The learner's own list of its files leaves the digest files out (the run checkpoint takes them away).
    import json

    listed = json.loads((tmp_path / "state" / "learner_meta.json").read_text())["files"]
    assert not [f for f in listed if f.endswith(digests.DIGEST_SUFFIX)]
    learner.load_run_state(str(tmp_path / "state"))

    digests.revert()
    try:
        learner.save_run_state(str(tmp_path / "unpatched"))
        assert not list((tmp_path / "unpatched" / "dist").glob("*" + digests.DIGEST_SUFFIX))
    finally:
        digests.apply()
