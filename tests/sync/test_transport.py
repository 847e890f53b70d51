"""The bucket plan and the shared-memory transport on their own (no learner, no engine)."""

import math
import os
import stat
import subprocess
import sys

import pytest
import torch

from layout_scenarios import tiny_spec, tiny_v3_spec
from moe_grpo.models.hf_names import hf_shapes
from moe_grpo.sync.plan import ALIGN, BucketPlan, check_plan, plan_buckets
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError, UnsafeRootError


def test_plan_covers_every_tensor_once_in_aligned_byte_bounded_buckets_of_whole_layers():
    spec = tiny_spec()
    plan = plan_buckets(spec, torch.bfloat16, max_bucket_bytes=300_000)
    assert plan.shapes() == hf_shapes(spec)
    for b in plan.buckets:
        assert all(e.offset % ALIGN == 0 for e in b.entries)
        layers = {e.name.split(".")[2] for e in b.entries if e.name.startswith("model.layers.")}
        # a bucket closes at the first layer boundary past the bound
        assert b.nbytes < 300_000 + max(sum(e.numel * 2 for e in b.entries if f"layers.{i}." in e.name) for i in layers or {0})
    owner = {}
    for b in plan.buckets:
        for e in b.entries:
            if e.name.startswith("model.layers."):
                owner.setdefault(e.name.split(".")[2], set()).add(b.index)
    assert all(len(v) == 1 for v in owner.values())  # no layer is split across buckets
    assert BucketPlan.from_json(plan.to_json()) == plan


def test_a_plans_tensor_bytes_leave_out_the_alignment_padding_that_its_buffers_hold():
    """`sync/bytes` of a full version adds up to `tensor_bytes` (ranks write tensors, never padding); a test that
    expected `total_bytes` failed whenever a run's row showed a full version of a model with unaligned tensors."""
    spec = tiny_v3_spec()  # its expert bias, 8 experts x 2 bytes, ends off a 64-byte boundary
    plan = plan_buckets(spec, torch.bfloat16)
    assert plan.tensor_bytes == sum(math.prod(s) * 2 for s in hf_shapes(spec).values())
    assert plan.tensor_bytes < plan.total_bytes <= plan.tensor_bytes + (ALIGN - 1) * len(hf_shapes(spec))


def test_plan_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="sync dtype 'int8'"):
        plan_buckets(tiny_spec(), "int8")
    with pytest.raises(ValueError, match="max_bucket_bytes=0"):
        plan_buckets(tiny_spec(), torch.float32, 0)
    with pytest.raises(ValueError, match="sync is for model 'other'"):
        check_plan(plan_buckets(tiny_spec(name="other"), torch.float32), tiny_spec())


def _publish(transport, version, plan, world=1, skip_rank=None, counts_off=0):
    slot = transport.claim(version, plan, 0, world)
    for rank in range(world):
        if rank == skip_rank:
            continue
        counts = {b.index: sum(e.numel for e in b.entries) // world + (counts_off if rank == 0 else 0)
                  for b in plan.buckets}
        with transport.bucket_views(slot, plan.buckets[0], torch.float32) as views:
            next(iter(views.values())).fill_(float(version))
        transport.mark_done(slot, version, rank, counts)
    return slot


@pytest.fixture
def small():
    return plan_buckets(tiny_spec(), torch.float32, 1 << 20)


def test_slots_are_recycled_unless_an_engine_pins_them(tmp_path, small):
    t = SharedMemoryTransport(str(tmp_path), slots=2)
    a, b = _publish(t, 1, small), _publish(t, 2, small)
    assert a != b and _publish(t, 3, small) == a  # the least recently written slot: its pages are warm
    t.pin("engine-x", {a: 3})
    assert _publish(t, 4, small) == b  # the only slot nobody pins
    t.pin("engine-y", {b: 4})
    c = _publish(t, 5, small)  # every slot pinned: a new one rather than waiting for the engines
    assert c not in (a, b) and t.latest_complete() == 5
    t.unpin("engine-x")
    t.unpin("engine-y")
    _publish(t, 6, small)
    assert len(list(tmp_path.glob("slot*"))) == 2  # the extra slot goes once nobody pins it


def test_pins_of_dead_processes_do_not_hold_buffers(tmp_path, small):
    t = SharedMemoryTransport(str(tmp_path), slots=1)
    slot = _publish(t, 1, small)
    code = (f"from moe_grpo.sync.transport import SharedMemoryTransport as T; "
            f"T({str(tmp_path)!r}).pin('gone', {{{slot!r}: 1}})")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert _publish(t, 2, small) == slot


def test_receiver_names_missing_ranks_and_miscounted_elements(tmp_path, small):
    t = SharedMemoryTransport(str(tmp_path))
    _publish(t, 1, small, world=2, skip_rank=1)
    with pytest.raises(SyncError, match=r"version 1 incomplete after 0 s: learner rank\(s\) \[1\] did not finish"):
        t.wait_complete(1, timeout_s=0.2)
    with pytest.raises(SyncError, match="no learner rank started it"):
        t.wait_complete(9, timeout_s=0.1)
    _publish(t, 2, small, counts_off=1)
    with pytest.raises(SyncError, match=r"bucket 0 got \d+ elements .* expected \d+ \(a shard is missing or written twice\)"):
        t.wait_complete(2, timeout_s=1)
    with pytest.raises(SyncError, match="version 5 is gone"):
        t.pin("e", {str(tmp_path / "slot0"): 5})


def test_a_slot_still_being_written_is_not_reused(tmp_path, small):
    t = SharedMemoryTransport(str(tmp_path), slots=2)
    a = _publish(t, 1, small)
    b = _publish(t, 2, small, world=2, skip_rank=1)  # rank 1 has not finished version 2 yet
    assert _publish(t, 3, small) == a and _publish(t, 4, small) == a  # b is skipped while it is being written
    assert t.find(2) == b


# ---------------------------------------------------------------------- a private root (another local user must not
# be able to write, plant or swap the buffers the engines load)


@pytest.mark.parametrize("mode,who", [(0o777, "group and others"), (0o770, "group"), (0o757, "others")],
                         ids=["world-writable", "group-writable", "other-writable"])
def test_a_root_writable_by_group_or_others_is_refused(tmp_path, mode, who):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, mode)
    with pytest.raises(UnsafeRootError, match=rf"root {root} has mode {oct(mode)}, writable by {who}; expected 0700"):
        SharedMemoryTransport(str(root))
    assert not (root / "pins").exists()  # refused before anything was written into it


def test_a_symlinked_root_is_refused_even_when_its_target_looks_private(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "root"
    link.symlink_to(target)
    with pytest.raises(UnsafeRootError, match=rf"root {link} is a symlink \(to {target}\), expected a real directory"):
        SharedMemoryTransport(str(link))
    open_target = tmp_path / "world"
    open_target.mkdir()
    os.chmod(open_target, 0o777)
    (tmp_path / "root2").symlink_to(open_target)
    with pytest.raises(UnsafeRootError, match="is a symlink"):
        SharedMemoryTransport(str(tmp_path / "root2"))
    assert list(target.iterdir()) == [] and list(open_target.iterdir()) == []


def test_a_root_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)  # the tests run as root; 65534 is "nobody"
    with pytest.raises(UnsafeRootError, match=rf"root {root} is owned by uid 65534, expected uid {os.geteuid()}"):
        SharedMemoryTransport(str(root))


def test_a_root_whose_parent_another_user_can_write_is_refused(tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)  # no sticky bit: anyone could rename the root away and put theirs in its place
    with pytest.raises(UnsafeRootError, match=rf"parent directory {parent} has mode 0o777, writable by group or others "
                                              r"without the sticky bit"):
        SharedMemoryTransport(str(parent / "root"))
    os.chmod(parent, 0o1777)  # like /dev/shm: others cannot touch what is ours
    t = SharedMemoryTransport(str(parent / "root"))
    assert stat.S_IMODE(os.stat(t.root).st_mode) == 0o700


def test_everything_the_transport_creates_is_private_even_under_umask_000(tmp_path, small):
    old = os.umask(0)
    try:
        t = SharedMemoryTransport(str(tmp_path / "made" / "here"), slots=1)
        slot = _publish(t, 1, small)
        t.pin("engine-x", {slot: 1})
        _publish(t, 2, small)  # every slot pinned: an extra slot is created
        with t.raw_bucket(slot, small.buckets[-1], writable=True):
            pass
    finally:
        os.umask(old)
    made = [tmp_path / "made", *(tmp_path / "made").rglob("*")]
    assert len([p for p in made if p.is_file()]) >= 6  # lock, pin, versions, done markers, buckets
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(os.lstat(p).st_mode)) for p in made}
    assert modes == {k: ("0o700" if (tmp_path / k).is_dir() else "0o600") for k in modes}


def test_an_existing_root_of_ours_is_narrowed_to_0700(tmp_path):
    root = tmp_path / "old"
    root.mkdir()
    os.chmod(root, 0o755)  # what earlier versions created
    SharedMemoryTransport(str(root))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


# ---------------------------------------------------------------------- a root too small (Docker's /dev/shm is 64 MiB
# unless told --shm-size)

_SMALL_ROOT = """
import os, sys, torch
from moe_grpo.sync.plan import plan_buckets
from moe_grpo.sync.transport import SharedMemoryTransport, SyncRootFull
from layout_scenarios import tiny_spec
plan = plan_buckets(tiny_spec(), torch.float32, 1 << 30)  # one bucket, the whole version
t = SharedMemoryTransport(os.path.join(sys.argv[1], "sync"), slots=2)
need = plan.total_bytes
print("version", need, "free", os.statvfs(t.root).f_bavail * os.statvfs(t.root).f_frsize, flush=True)
try:
    t.check_room(need)
except SyncRootFull as e:
    print("at start:", e, flush=True)
for version in (1, 2):
    slot = t.claim(version, plan, 0, 1)
    try:
        with t.bucket_views(slot, plan.buckets[0], torch.float32) as views:
            for view in views.values():
                view.fill_(1.0)
    except SyncRootFull as e:
        print(f"version {version}:", e, flush=True)
        break
    print(f"version {version}: written", flush=True)
"""


def _on_small_tmpfs(tmp_path, size: str, script: str, paths: list[str] = ()) -> subprocess.CompletedProcess:
    """`script` run with argv[1] a tmpfs of `size` mounted in a mount namespace of its own (`unshare`: as root, or
    as a user where user namespaces are allowed), this directory and `paths` on its import path; skips where
    neither works."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(parents=True)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a namespace here: {probe.stderr.strip()}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *paths,
                                                        os.environ.get("PYTHONPATH", "")])}
    mount_then_run = f'mount -t tmpfs -o size={size} tmpfs "$0" && exec "$1" -c "$2" "$0"'
    return subprocess.run(["unshare", "-rm", "sh", "-c", mount_then_run, str(mnt), sys.executable, script],
                          capture_output=True, text=True, env=env, timeout=120)


def test_a_root_too_small_for_the_versions_is_named_at_the_start_and_a_full_one_at_the_write(tmp_path):
    """A version of the tests' tiny model in fp32 is 4.4 MiB: a 5 MiB tmpfs holds one of the two slots. Before,
    nothing looked at the room and the second version's write through its map of a sparse file was a SIGBUS that
    killed the writer (a run: "learner rank 0 died during step 2")."""
    out = _on_small_tmpfs(tmp_path, "5m", _SMALL_ROOT)
    assert out.returncode == 0, f"exit {out.returncode} (-7: SIGBUS)\n{out.stdout}\n{out.stderr[-3000:]}"
    lines = out.stdout.splitlines()
    assert lines[1].startswith("at start: weight-sync root ") and "keeps sync.slots=2 versions" in lines[1], lines
    assert "--shm-size" in lines[1] and "sync.root" in lines[1]
    assert lines[2] == "version 1: written", lines
    assert lines[3].startswith("version 2: weight-sync root ") and " is full: a bucket of 4.4 MiB" in lines[3], lines


_LEARNER_ON_SMALL_ROOT = """
import os, sys
from moe_grpo.learner.spawn import DistributedRunError, run_distributed
import layout_scenarios as S
try:
    run_distributed(S.sync_and_save, 1, 1, 1, 1, {}, 1, os.path.join(sys.argv[1], "sync"),
                    os.path.join(sys.argv[1], "ckpt"))
    print("published", flush=True)
except DistributedRunError as e:
    print("refused:", " ".join(str(e).split()), flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_learner_rank_names_a_root_too_small_before_its_first_version(tmp_path):
    """WeightSync asks its transport for the room of `sync.slots` versions when it is made (a run: at the learner
    rank's start, before the warm start), and the rank fails naming the root and the numbers."""
    learner_tests = os.path.join(os.path.dirname(os.path.dirname(__file__)), "learner")  # layout_scenarios
    out = _on_small_tmpfs(tmp_path, "5m", _LEARNER_ON_SMALL_ROOT, paths=[learner_tests])
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    assert out.stdout.startswith("refused:") and "SyncRootFull: weight-sync root " in out.stdout, out.stdout
    assert "keeps sync.slots=2 versions there (8.8 MiB; the first 4.4 MiB)" in out.stdout, out.stdout


_ROOM_CHECKS = """
import os, sys
from moe_grpo.sync.transport import SharedMemoryTransport, SyncRootFull
t = SharedMemoryTransport(os.path.join(sys.argv[1], "sync"), slots=2)
for first, later in ((3 << 20, None), (3 << 20, 1 << 20)):
    try:
        t.check_room(first, later)
        print("fits", flush=True)
    except SyncRootFull:
        print("refused", flush=True)
"""


def test_the_room_check_counts_a_lora_runs_later_versions_as_adapters_and_skips_a_tmpfs_without_a_size(tmp_path):
    """A 5 MiB root, 2 slots: two full versions of 3 MiB do not fit, a 3 MiB base and a 1 MiB adapter version do (a
    LoRA run's later versions are its adapters: refused before, asked for two full versions). A tmpfs mounted
    without a limit (`size=0`) reports no blocks: it was refused as "0.0 MiB free"."""
    sized = _on_small_tmpfs(tmp_path / "sized", "5m", _ROOM_CHECKS)
    assert sized.stdout.split() == ["refused", "fits"], sized.stdout + sized.stderr[-2000:]
    unlimited = _on_small_tmpfs(tmp_path / "unlimited", "0", _ROOM_CHECKS)
    assert unlimited.stdout.split() == ["fits", "fits"], unlimited.stdout + unlimited.stderr[-2000:]
