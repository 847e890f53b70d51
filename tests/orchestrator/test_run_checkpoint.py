"""Run checkpoints on disk and the driver's state objects: what survives a crash, what is refused, what resumes."""

import os
import pickle
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from moe_grpo.orchestrator import run_checkpoint as rc


def write(run_dir, step, payload=b"weights", keep=2):
    tmp = rc.begin(run_dir, step)
    (tmp / "learner" / "shard.bin").write_bytes(payload * 100)
    return rc.finish(tmp, {"step": step, "groups": list(range(step))}, {"step": step}, keep)


def test_a_checkpoint_is_whole_named_latest_and_pruned_to_keep(tmp_path):
    for step in (2, 4, 6):
        write(tmp_path, step)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert (root / "latest").read_text() == "step_000006"
    path, manifest = rc.newest_valid(tmp_path)
    assert path.name == "step_000006" and manifest["step"] == 6
    assert rc.load_driver_state(path) == {"step": 6, "groups": list(range(6))}


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_checkpoint_is_named_and_the_previous_one_is_used(tmp_path, damage, caplog):
    write(tmp_path, 2)
    newest = write(tmp_path, 4)
    target = newest / "learner" / "shard.bin"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:10])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[5] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    else:
        target = newest / "manifest.json"
        target.unlink()
    with pytest.raises(rc.CheckpointError, match=str(target)):
        rc.verify(newest)
    path, _ = rc.newest_valid(tmp_path)
    assert path.name == "step_000002"
    assert str(target) in caplog.text


def test_a_file_over_256_mib_changed_in_place_is_caught(tmp_path):
    """Would have caught: files over 256 MiB (a real model's shards) were checked by size only, so bytes changed
    in place (same size) passed the check and were loaded."""
    tmp = rc.begin(tmp_path, 2)
    big = tmp / "learner" / "__0_0.distcp"
    with open(big, "wb") as f:
        f.truncate(257 * 2**20)  # sparse: the test writes no 257 MiB
    path = rc.finish(tmp, {"step": 2}, {"step": 2}, keep=2)
    manifest = rc.verify(path)
    assert len(manifest["files"]["learner/__0_0.distcp"]["sha256"]) == 64
    with open(path / "learner" / "__0_0.distcp", "r+b") as f:
        f.seek(200 * 2**20)
        f.write(b"\1")
    with pytest.raises(rc.CheckpointError, match=r"__0_0.distcp: content differs from the manifest's sha256"):
        rc.verify(path)


def test_every_file_and_directory_is_on_disk_before_latest_names_the_checkpoint(tmp_path, monkeypatch):
    """Would have caught: the renamed directory (and the learner's files and directories) were not fsynced, so
    after a power loss `latest` could name a checkpoint whose entries never reached the disk. Also: the driver's
    state is hashed as it is written, not read back."""
    write(tmp_path, 2)
    events, hashed = [], []
    fsync, replace, sha256 = os.fsync, os.replace, rc._sha256

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    def recording_sha256(path, **kw):
        hashed.append(path.name)
        return sha256(path, **kw)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    monkeypatch.setattr(rc, "_sha256", recording_sha256)
    tmp = rc.begin(tmp_path, 4)
    (tmp / "learner" / "dist").mkdir()
    (tmp / "learner" / "dist" / "__0_0.distcp").write_bytes(b"w" * 1000)
    (tmp / "learner" / "learner_meta.json").write_text("{}")
    final = rc.finish(tmp, {"step": 4}, {"step": 4}, keep=2)
    root = tmp_path / "checkpoints"
    rename = events.index(("replace", str(tmp), str(final)))
    latest = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "latest"))
    synced_before_rename = {e[1] for e in events[:rename] if e[0] == "fsync"}
    synced_before_rename |= {p.removesuffix(".tmp") for p in synced_before_rename if p.endswith(".json.tmp")}
    written = {str(p) for p in tmp_path.rglob("*") if p.is_relative_to(final)}
    want = {p.replace(str(final), str(tmp)) for p in written} | {str(tmp)}
    assert want <= synced_before_rename, sorted(want - synced_before_rename)
    assert ("fsync", str(root)) in events[rename:latest], "the rename itself is durable before latest moves"
    assert ("fsync", str(root)) in events[latest:], "and so is latest"
    assert "driver.pkl" not in hashed and {"__0_0.distcp", "learner_meta.json"} <= set(hashed)
    assert rc.verify(final)["files"]["driver.pkl"]["sha256"]


def test_learner_shards_hashed_as_they_were_written_are_not_read_back(tmp_path, monkeypatch):
    """Would have caught: finish() reading every learner shard a second time to hash it, though the writer had
    hashed it on the way out (learner/megatron_write_digests.py). A digest file that names another size is not
    trusted (the shard is hashed), and no digest file is left in the checkpoint."""
    import hashlib

    from moe_grpo.learner import megatron_write_digests as digests

    hashed, fsynced = [], []
    sha256, fsync_file = rc._sha256, rc._fsync_file
    monkeypatch.setattr(rc, "_sha256", lambda path, **kw: hashed.append(path.name) or sha256(path, **kw))
    monkeypatch.setattr(rc, "_fsync_file", lambda path: fsynced.append(path.name) or fsync_file(path))
    tmp = rc.begin(tmp_path, 4)
    dist = tmp / "learner" / "dist"
    dist.mkdir()
    for name, payload in (("__0_0.distcp", b"a" * 1000), ("__0_1.distcp", b"b" * 1000)):
        (dist / name).write_bytes(payload)
        digests._write_digest(str(dist / name), digests.Digest(1000, hashlib.sha256(payload).hexdigest()))
    (dist / "__1_0.distcp").write_bytes(b"c" * 10)
    digests._write_digest(str(dist / "__1_0.distcp"), digests.Digest(11, "0" * 64))  # another size: not trusted
    (dist / ".metadata").write_bytes(b"m")  # written by torch, not by the shard writer: no digest file
    final = rc.finish(tmp, {"step": 4}, {"step": 4}, keep=2)
    assert "__0_0.distcp" not in hashed and "__0_1.distcp" not in hashed
    assert {"__0_0.distcp", "__0_1.distcp"} <= set(fsynced), "not read, but still made durable"
    assert {"__1_0.distcp", ".metadata"} <= set(hashed)
    assert not list(final.rglob("*" + digests.DIGEST_SUFFIX))
    files = rc.verify(final)["files"]  # (verify reads every byte, as a load does)
    assert files["learner/dist/__0_1.distcp"]["sha256"] == hashlib.sha256(b"b" * 1000).hexdigest()
    assert not [f for f in files if f.endswith(digests.DIGEST_SUFFIX)]


def test_a_crash_mid_write_leaves_the_previous_checkpoint_latest(tmp_path):
    """A writer SIGKILLed while its checkpoint is half written: `latest` and the previous checkpoint are untouched."""
    write(tmp_path, 2)
    script = (f"import time, sys; sys.path.insert(0, {os.getcwd()!r});"
              "from moe_grpo.orchestrator import run_checkpoint as rc;"
              f"tmp = rc.begin({str(tmp_path)!r}, 4);"
              "open(tmp / 'learner' / 'big.bin', 'wb').write(b'x' * 1000);"
              "print('written', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000002"
    path, _ = rc.newest_valid(tmp_path)
    assert path.name == "step_000002"
    write(tmp_path, 4)  # the next writer starts over where the dead one left a .tmp
    assert not (tmp_path / "checkpoints" / "step_000004.tmp").exists()


def test_no_checkpoint_means_none(tmp_path):
    assert rc.newest_valid(tmp_path) is None


def test_the_rollback_target_is_the_newest_checkpoint_written_before_the_jump_began(tmp_path):
    """Would have caught: the collapse guard restored the newest checkpoint, which for a jump seen at steps 9-10
    (`routing.jump_sustain=2`) with a checkpoint every 3 steps is step 9's, written on the jump's first step from
    weights trained on the jumped batch; and it spent one of `routing.max_rollbacks` on it."""
    def checkpoint(step, in_a_row):
        tmp = rc.begin(tmp_path, step)
        (tmp / "learner" / "shard.bin").write_bytes(bytes([step]) * 100)
        return rc.finish(tmp, {"step": step}, {"step": step, "jump_in_a_row": in_a_row}, keep=10)

    three, six, nine = checkpoint(3, 0), checkpoint(6, 0), checkpoint(9, 1)
    assert rc.rollback_target(tmp_path, jump_began=9) == six
    assert rc.rollback_target(tmp_path, jump_began=4) == three
    assert rc.rollback_target(tmp_path, jump_began=3) is None, "nothing written before step 3"
    # After that rollback, step 10's checkpoint holds the restored weights; a later jump (steps 14-15) goes back to
    # it, and never to step 9's, written inside the first jump's window.
    ten = checkpoint(10, 0)
    assert rc.rollback_target(tmp_path, jump_began=14) == ten
    (ten / "driver.pkl").unlink()
    assert rc.rollback_target(tmp_path, jump_began=14) == six, "a damaged checkpoint is no target either"


def record(run_dir, steps):
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, steps + 1)))


def test_resume_starts_fresh_only_where_no_earlier_run_left_steps_or_checkpoints(tmp_path):
    """Would have caught: `resume=true` after a run that wrote no checkpoint (checkpoint.every=0,
    checkpoint.at_end=false) started again from step 0 and appended steps [1, 2] to the record's [1, 2]."""
    assert rc.resume_point(tmp_path) is None, "a requeued job's first start: nothing here yet"
    (tmp_path / "metrics.jsonl").write_text("")
    assert rc.resume_point(tmp_path) is None, "a record with no step yet: nothing to repeat"
    record(tmp_path, 2)
    with pytest.raises(rc.CheckpointError) as err:
        rc.resume_point(tmp_path)
    assert "metrics.jsonl records 2 step(s)" in str(err.value)
    assert "the earlier run ended before its first (written at step checkpoint.every" in str(err.value)
    newest = write(tmp_path, 2)
    assert rc.resume_point(tmp_path)[0] == newest


def test_resume_with_every_checkpoint_damaged_stops_naming_each_and_why(tmp_path):
    """Would have caught: where every checkpoint was damaged, `resume=true` logged a line and started from step 0,
    appending a second step 1 to the record."""
    record(tmp_path, 4)
    first, second = write(tmp_path, 2), write(tmp_path, 4)
    (first / "driver.pkl").unlink()
    with open(second / "learner" / "shard.bin", "r+b") as f:
        f.truncate(10)
    rc.begin(tmp_path, 6)  # a write that never finished
    with pytest.raises(rc.CheckpointError) as err:
        rc.resume_point(tmp_path)
    text = str(err.value)
    assert "records 4 step(s)" in text
    assert f"step_000004: {second / 'learner' / 'shard.bin'}: 10 bytes" in text
    assert f"step_000002: {first / 'driver.pkl'}: missing" in text
    assert "step_000006.tmp: its write did not finish" in text
    (tmp_path / "metrics.jsonl").unlink()  # checkpoints without a record are an earlier run's too
    with pytest.raises(rc.CheckpointError, match="holds checkpoints of an earlier run"):
        rc.resume_point(tmp_path)


def test_the_buffer_keeps_its_groups_with_versions_and_traces_and_refuses_what_does_not_fit():
    from moe_grpo.orchestrator.buffer import Group, RolloutBuffer
    from moe_grpo.routing.trace import RoutingTrace

    c = SimpleNamespace(versions=np.array([3, 4]), routing=RoutingTrace.from_array(np.ones((4, 2, 2), np.uint8), 8))
    buf = RolloutBuffer(4, 1)
    for _ in range(3):
        buf.put(Group("ex", [c], np.ones(1, np.float32), np.zeros(1, np.float32)))
    buf.drop_stale(10)
    assert len(buf) == 0 and buf.dropped_stale == 3
    buf.put(Group("ex", [c], np.ones(1, np.float32)))
    state = pickle.loads(pickle.dumps(buf.state_dict()))  # as a checkpoint stores it
    again = RolloutBuffer(4, 1)
    again.load_state_dict(state)
    assert len(again) == 1 and again.dropped_stale == 3
    group = again.take(1, 4)[0]
    assert group.completions[0].versions.tolist() == [3, 4]
    assert group.completions[0].routing.expert_ids.shape == (4, 2, 2)
    state["groups"] = state["groups"] * 5
    with pytest.raises(OverflowError, match="holds 5 groups, this run's capacity is 4"):
        RolloutBuffer(4, 1).load_state_dict(state)


def test_the_prompt_source_continues_where_it_stood():
    from moe_grpo.data.prompts import TaskPrompts
    from moe_grpo.data.tasks import TaskConfig
    from moe_grpo.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer(512)
    a = TaskPrompts(TaskConfig(), tok, np.random.default_rng(0))
    a.take(5)
    state = a.state_dict()
    want = [e.prompt for e in a.take(5)]
    b = TaskPrompts(TaskConfig(), tok, np.random.default_rng(123))
    b.load_state_dict(state)
    assert [e.prompt for e in b.take(5)] == want


def test_the_jump_watch_keeps_its_level_and_a_lasting_jump_is_seen_every_step():
    from moe_grpo.orchestrator.watch import JumpWatch

    w = JumpWatch(5.0, 20)
    for step in range(8):
        w.update({"step": step, "train/rollout_kl": 1e-3})
    assert w.update({"step": 8, "train/rollout_kl": 0.5}) and w.update({"step": 9, "train/rollout_kl": 0.5})
    assert w.in_a_row == 2 and w.jumps == 2
    again = JumpWatch(5.0, 20)
    again.load_state_dict(w.state_dict())
    assert again.update({"step": 10, "train/rollout_kl": 0.5}) and again.in_a_row == 3
    assert not again.update({"step": 11, "train/rollout_kl": 1e-3}) and again.in_a_row == 0


def test_a_resume_that_changes_what_the_checkpoint_means_is_refused():
    import dataclasses

    from moe_grpo.config import from_hydra, load_model_spec
    from moe_grpo.orchestrator.resume import check_resumable

    def run(**algo):
        return from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "algo": algo})

    saved = dataclasses.asdict(run(group_size=4))
    check_resumable(from_hydra({"model": saved["model"], "algo": {"group_size": 4}, "steps": 999,
                                "learner": {"lr_decay_steps": 300}, "parallel": {"expert_parallel": 2}}), saved)
    # The key and both values, not the section (it said "in ['algo']": a user's trial, 2026-11-28).
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in algo.group_size=8 \(checkpoint: 4\); "):
        check_resumable(run(group_size=8), saved)


def test_a_resume_keeps_the_saved_learning_rate_schedule_and_extending_it_is_a_choice(caplog):
    """Would have caught: a resume with more `steps` stretched the cosine decay over the new length, so the learning
    rate jumped (a finished run's from 0 back up; its learner then refused lr=0.0 at load), and a resume with another
    `learner.lr`, warmup, decay style or `min_lr` was taken silently."""
    import dataclasses

    from moe_grpo.config import from_hydra, load_model_spec
    from moe_grpo.orchestrator.resume import check_resumable

    model = dataclasses.asdict(load_model_spec("deepseek_moe"))

    def run(steps=4, **learner):
        return from_hydra({"model": model, "steps": steps, "learner": learner})

    first = run(steps=2)
    saved, schedule = dataclasses.asdict(first), first.learner.schedule(first.steps)
    assert schedule == {"lr": 1e-3, "lr_warmup_steps": 0, "lr_decay": "cosine", "min_lr": 0.0, "lr_decay_steps": 2}
    check_resumable(run(steps=2), saved, schedule)
    for key, value in (("lr", 2e-3), ("lr_warmup_steps", 1), ("lr_decay", "linear"), ("min_lr", 1e-4)):
        with pytest.raises(ValueError, match=rf"differs from the checkpoint's in learner.{key}={value!r} "):
            check_resumable(run(steps=2, **{key: value}), saved, schedule)
    for saved_schedule in (schedule, None):  # a checkpoint written before checkpoints saved their schedule
        with pytest.raises(ValueError, match=r"steps=4: the checkpoint's learning rate decays \(cosine\) to "
                                             r"learner.min_lr=0 at step 2, this run's would at step 4.*"
                                             r"learner.lr_decay_steps=2 keeps.*learner.lr_decay_steps=4 stretches"):
            check_resumable(run(steps=4), saved, saved_schedule)
    check_resumable(run(steps=4, lr_decay_steps=2), saved, schedule)  # keep the saved schedule
    check_resumable(run(steps=4, lr_decay_steps=4), saved, schedule)  # stretch it, said so
    assert "learner.lr_decay_steps=4, the checkpoint's schedule reached learner.min_lr at step 2" in caplog.text
    constant = run(steps=2, lr_decay="constant")
    check_resumable(run(steps=4, lr_decay="constant"), dataclasses.asdict(constant), constant.learner.schedule(2))


def test_the_run_record_writes_null_for_values_not_measured_and_strict_readers_accept_every_line(tmp_path):
    """NaN is not JSON: jq and JavaScript's JSON.parse refuse it. A value not measured is written as null."""
    import json
    import math
    import shutil
    import subprocess

    from moe_grpo.orchestrator.run_record import REQUIRED_KEYS, RunRecord, read_rows

    record = RunRecord(tmp_path, 2, progress=False)
    for step in (1, 2):
        row = {k: 0.5 for k in REQUIRED_KEYS}
        row.update({"step": step, "kl/reference": float("nan"), "mismatch/kl": float("inf") if step == 2 else 1e-9})
        record.log(row)
    record.close()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["kl/reference"] for r in rows] == [None, None] and rows[1]["mismatch/kl"] is None
    assert rows[0]["mismatch/kl"] == 1e-9
    assert math.isnan(read_rows(tmp_path / "metrics.jsonl")[0]["kl/reference"])
    if shutil.which("jq"):
        out = subprocess.run(["jq", "-c", ".step"], input="\n".join(lines), capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.split() in (["1.0", "2.0"], ["1", "2"]), out.stderr
    # A resumed run keeps the rows up to its checkpoint: read back as NaN, written again as null.
    resumed = RunRecord(tmp_path, 2, progress=False, resume_step=1)
    assert len(resumed.rows) == 1 and math.isnan(resumed.rows[0]["kl/reference"])
    assert resumed.close() is not None  # the PNG is drawn from rows that hold NaN
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0], parse_constant=refuse)["kl/reference"] is None
