"""Carrying bucketed weights from learner ranks to engines: the interface and the shared-memory transport.

A transport has a sending side (every learner rank: claim the version's
buffers, write its shards into bucket views, mark itself done) and a
receiving side (an engine: wait until every rank is done, pin the version,
read bucket by bucket). `SharedMemoryTransport` keeps
each host's buffers: buckets are files on /dev/shm that learner ranks and vLLM
workers map into their address space, so the learner's write *is* the
transfer and the engine reads without a copy. Other hosts get their copy
through the relay (`relay.py`, chosen in `transports.py`); engines on the
learner's GPUs can read from CUDA IPC buffers instead (`cuda_ipc.py`).

Buffers are recycled: a transport keeps `slots` full versions (default 2),
and a new version goes into a slot no engine has pinned. Freshly created
shared-memory pages cost ~10x a memcpy to fault in on first touch, reused
pages do not. An engine pins the slot it is applying and the one it serves
(its rollback source); when every slot is pinned, the sender opens an extra
slot rather than wait, so a slow engine never stalls the learner, and
extra slots are removed once nobody pins them.

Whoever can write under the root can hand the engines their own weights, so
the root is private: created 0700 (missing parents too), and an existing one
is refused if it is a symlink, owned by another user, writable by group or
others, or sits in a directory where another user could replace it (writable
by others without the sticky bit, or owned by another non-root user). Every
file and directory the transport creates is 0600 / 0700 whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import shutil
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Collection, Iterator, Protocol

import torch

from moe_grpo.awake_clock import awake_now
from moe_grpo.processes import process_alive
from moe_grpo.sync.errors import SyncError, SyncRootFull, UnsafeRootError  # noqa: F401 - SyncError: its importers
from moe_grpo.sync.plan import Bucket, BucketPlan


class WeightTransport(Protocol):
    """The publishing side: a learner rank writes its shards of a version bucket by bucket, then marks itself done."""

    def claim(self, version: int, plan: BucketPlan, rank: int, world: int, timeout_s: float) -> str: ...

    def bucket_views(self, slot: str, bucket: Bucket, dtype: torch.dtype) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]: ...

    def mark_done(self, slot: str, version: int, rank: int, elements: dict[int, int]) -> None: ...

    def read_version(self, version: int, timeout_s: float) -> dict[str, torch.Tensor]: ...


class WeightReceiver(Protocol):
    """The receiving side (one per engine): wait for a complete version, pin it, and hand the engine's workers a
    description of each bucket (`bucket_sources`) that `transports.open_bucket` turns back into tensors there."""

    def wait_complete(self, version: int, timeout_s: float) -> tuple[str, BucketPlan]: ...

    def bucket_sources(self, slot: str, plan: BucketPlan) -> list[dict]: ...

    def pin(self, engine_id: str, slots: dict[str, int]) -> None: ...

    def unpin(self, engine_id: str) -> None: ...


def bucket_path(slot: str, index: int) -> str:
    """The file of bucket `index` inside a slot."""
    return os.path.join(slot, f"b{index:05d}.bin")


def shm_bucket_sources(slot: str, plan: BucketPlan) -> list[dict]:
    """Each bucket of a shared-memory slot as an engine's worker opens it: its file, size, dtype and tensors."""
    return [{"kind": "shm", "path": bucket_path(slot, b.index), "nbytes": b.nbytes, "dtype": plan.dtype,
             "entries": [(e.name, list(e.shape), e.offset) for e in b.entries]} for b in plan.buckets]


def sources_of(sources: list[dict], names: Collection[str]) -> list[dict]:
    """The bucket sources (`bucket_sources`) cut down to the tensors in `names` (buckets left with none dropped):
    what an engine reloads of a delta version."""
    keep = set(names)
    out = []
    for source in sources:
        entries = [e for e in source["entries"] if e[0] in keep]
        if entries:
            out.append({**source, "entries": entries})
    return out


def default_root() -> str:
    """`/dev/shm/moe_grpo_sync_<uid>` (the temp directory where there is no /dev/shm)."""
    return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"moe_grpo_sync_{os.getuid()}")


_DIR_MODE, _FILE_MODE = 0o700, 0o600

_INFO_HEAD = 96
"""Bytes at the head of a slot's version.json that name its version, world and base (`_slot_info`)."""

CHANGE_LOG = 64
"""Versions whose changed-tensor lists each host keeps (an engine further behind reloads everything)."""


def _mkdir_private(path: Path) -> None:
    """Create `path` as a 0700 directory (umask cannot widen it; an explicit chmod fixes an odd umask)."""
    os.mkdir(path, _DIR_MODE)
    os.chmod(path, _DIR_MODE)


def _open_private(path: Path | str, flags: int) -> int:
    """Open (creating if missing) a file with mode 0600, never through a symlink; a wider mode is narrowed."""
    fd = os.open(path, flags | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), _FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != _FILE_MODE:
            os.fchmod(fd, _FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


ROOM_ADVICE = ("give it more room (a container: docker run --shm-size; Kubernetes: an emptyDir of medium Memory "
               "with a sizeLimit) or point sync.root at a larger tmpfs")


def reserve(fd: int, nbytes: int, root: Path | str) -> None:
    """Grow the open file `fd` to `nbytes` with its memory taken now (`posix_fallocate`), or raise `SyncRootFull`.

    A file only `ftruncate`d is sparse: on a full tmpfs the first write through a map of it is a SIGBUS, which
    killed the learner rank with no word of /dev/shm (a 4 MiB sync root, 2026-11-28: "learner rank 0 died during
    step 2"; Docker gives a container 64 MiB of /dev/shm unless told `--shm-size`). On tmpfs the size becomes
    `nbytes` only once every page is taken, so another rank that finds the file at its size writes into memory
    that is there; ranks growing the same file at once take the same pages."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem that cannot: sparse, as before
            os.ftruncate(fd, nbytes)
            return
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        free = shutil.disk_usage(root).free
        raise SyncRootFull(
            f"weight-sync root {root} is full: a bucket of {nbytes / 2**20:.1f} MiB does not fit in the "
            f"{free / 2**20:.1f} MiB free there (each host keeps sync.slots versions, plus what vLLM and others put "
            f"there); {ROOM_ADVICE}") from e


def _check_parent(root: Path) -> None:
    """Refuse a root inside a directory where another user could rename it away and put their own in its place."""
    parent = root.parent
    st = os.stat(parent)
    me = os.geteuid()
    if st.st_uid not in (0, me):
        raise UnsafeRootError(f"weight-sync root {root}: its parent directory {parent} is owned by uid {st.st_uid}, "
                              f"expected uid {me} (this process) or 0, since its owner could replace the root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeRootError(f"weight-sync root {root}: its parent directory {parent} has mode "
                              f"{oct(stat.S_IMODE(st.st_mode))}, writable by group or others without the sticky bit, "
                              f"so another user could replace the root; use a private directory or one like /dev/shm (1777)")


def secure_root(root: str | os.PathLike[str]) -> Path:
    """Make `root` a private directory for weight buffers, or refuse it with UnsafeRootError.

    A missing root (and its missing parents) is created 0700. An existing one
    must be a real directory (not a symlink), owned by this process's user, and
    not writable by group or others; read bits for group/others are removed.
    """
    root = Path(os.path.abspath(root))
    missing = [p for p in [root, *root.parents] if not os.path.lexists(p)]
    for p in reversed(missing):
        try:
            _mkdir_private(p)
        except FileExistsError:  # another process of the run created it first; checked below like any existing root
            pass
    _check_parent(root)
    if os.path.islink(root):
        raise UnsafeRootError(f"weight-sync root {root} is a symlink (to {os.readlink(root)}), expected a real directory "
                              f"owned by uid {os.geteuid()}: whoever controls the target could hand the engines weights")
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise UnsafeRootError(f"weight-sync root {root} cannot be opened as a directory without following a symlink: {e}") from e
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeRootError(f"weight-sync root {root} is not a directory (mode {oct(st.st_mode)})")
        if st.st_uid != me:
            raise UnsafeRootError(f"weight-sync root {root} is owned by uid {st.st_uid}, expected uid {me} (this "
                                  f"process's user): another user could hand the engines weights through it")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            who = " and ".join(w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit)
            raise UnsafeRootError(f"weight-sync root {root} has mode {oct(stat.S_IMODE(st.st_mode))}, writable by {who}; "
                                  f"expected 0700 (remove it, or chmod 700 it if every file in it is yours)")
        if stat.S_IMODE(st.st_mode) != _DIR_MODE:
            os.fchmod(fd, _DIR_MODE)  # ours and not writable by others: only narrow who can read the weights
    finally:
        os.close(fd)
    return root


def _write_json(path: Path, value: object) -> None:
    """Write `value` to `path` atomically (a 0600 temporary file renamed into place)."""
    _write_text(path, json.dumps(value))


def _write_text(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (a 0600 temporary file renamed into place)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = _open_private(tmp, os.O_WRONLY | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class SharedMemoryTransport:
    """Versioned, recycled bucket files under `root` (a tmpfs such as /dev/shm)."""

    def __init__(self, root: str | None = None, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}, expected at least 1")
        self.root, self.slots = secure_root(root or default_root()), slots
        self._info_cache: dict[str, tuple[tuple[int, bytes], dict]] = {}
        self._plan_json: tuple[BucketPlan | None, str, str] = (None, "", "")
        try:
            _mkdir_private(self.root / "pins")
        except FileExistsError:
            pass

    # ------------------------------------------------------------------ bookkeeping
    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with os.fdopen(_open_private(self.root / ".lock", os.O_RDWR), "r+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _pins(self) -> dict[str, dict[str, int]]:
        """Live engines' pins: engine id -> {slot: version}; pins of dead processes are dropped."""
        out = {}
        for p in (self.root / "pins").glob("*.json"):
            try:
                pin = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if process_alive(int(pin["pid"])):
                out[p.stem] = {k: int(v) for k, v in pin["slots"].items()}
            else:
                p.unlink(missing_ok=True)
        return out

    def _slot_info(self, slot: Path) -> dict | None:
        """The slot's version.json, parsed again only when its head changed (it holds the whole plan: ~0.2 MB
        for a 2400-tensor model, and every claim reads every slot's). The head - version, world and base, written
        first - identifies the file: inode numbers and coarse mtimes repeat on a disk-backed root when versions
        follow each other within a clock tick, and a cache keyed by them served a replaced file's old version."""
        path = Path(slot) / "version.json"
        try:
            with open(path, "rb") as f:
                head = f.read(_INFO_HEAD)
                key = (os.fstat(f.fileno()).st_size, head)
                hit = self._info_cache.get(str(path))
                if hit is not None and hit[0] == key:
                    return hit[1]
                info = json.loads(head + f.read())
        except (OSError, ValueError):
            return None
        self._info_cache[str(path)] = (key, info)
        return info

    def _slots(self) -> list[Path]:
        return sorted(p for p in self.root.glob("slot*") if p.is_dir())

    # ------------------------------------------------------------------ sending side
    def claim(self, version: int, plan: BucketPlan, rank: int, world: int, timeout_s: float = 60.0, *,
              claims: bool | None = None) -> str:
        """The slot this version goes into. One writer picks it (never one an engine pins): `claims`, by default
        rank 0; the others wait for that."""
        if not (rank == 0 if claims is None else claims):
            deadline = awake_now() + timeout_s
            while awake_now() < deadline:
                slot = self.find(version)
                if slot is not None:
                    return slot
                time.sleep(0.002)
            who = "learner rank 0" if claims is None else "the writer that claims this host's slot"
            raise SyncError(f"sync of version {version}: {who} claimed no buffer in {self.root} within {timeout_s:.0f} s")
        with self._lock():
            pinned = {s for pins in self._pins().values() for s in pins}
            for s in self._slots():  # an unfinished attempt at this version or a later one was abandoned (its
                info = self._slot_info(s)  # writers are gone: this version is being claimed anew); left, it would
                if (s.name not in pinned and info is not None and info["version"] >= version  # answer find()
                        and self._missing(s, info)):
                    shutil.rmtree(s, ignore_errors=True)
            slots = self._slots()
            # A slot whose version some rank is still writing is not free either (a slow rank's late
            # writes would land in the new version).
            free = [s for s in slots if s.name not in pinned
                    and ((info := self._slot_info(s)) is None or not self._missing(s, info))]
            base = None
            """The version the slot holds whole (delta versions bring it forward: `delta.py`); None if none."""
            if free and len(slots) >= self.slots:  # least recently written first
                slot = min(free, key=lambda s: (self._slot_info(s) or {"version": -1})["version"])
                base = (self._slot_info(slot) or {}).get("version")
            else:
                slot = self.root / f"slot{len(slots)}"
                while slot.exists():
                    slot = slot.with_name(slot.name + "x")
                _mkdir_private(slot)
            for marker in slot.glob("done.*"):
                marker.unlink()
            if self._plan_json[0] is not plan:  # the plan's JSON text and its quoted form, made once per plan
                text = plan.to_json()
                self._plan_json = (plan, text, json.dumps(text))
            _, text, quoted = self._plan_json
            path = slot / "version.json"
            self._write_version(slot, version, world, base, quoted, text)
            self._drop_extra_slots(keep=slot, pinned=pinned)
        return str(slot)

    def _write_version(self, slot: Path, version: int, world: int, base: int | None, quoted: str, text: str) -> None:
        path = slot / "version.json"
        data = (f'{{"version": {int(version)}, "world": {int(world)}, "base": {json.dumps(base)}, '
                f'"plan": {quoted}}}').encode()
        _write_text(path, data.decode())
        # What we wrote needs no parsing when the next claim looks at this slot.
        self._info_cache[str(path)] = ((len(data), data[:_INFO_HEAD]),
                                       {"version": int(version), "world": int(world), "base": base, "plan": text})

    def forget_base(self, slot: str) -> None:
        """The slot's buffers were made anew (their old contents are gone): no delta may be applied onto them."""
        info = self._slot_info(Path(slot))
        if info is not None and info.get("base") is not None:
            self._write_version(Path(slot), info["version"], info["world"], None, json.dumps(info["plan"]),
                                info["plan"])

    def slot_base(self, slot: str) -> int | None:
        """The version the claimed slot held whole before this claim (None: nothing usable)."""
        info = self._slot_info(Path(slot))
        return None if info is None else info.get("base")

    def _drop_extra_slots(self, keep: Path, pinned: set[str]) -> None:
        """Remove slots beyond `slots` that nobody pins, never one still being written: a version newer than the
        newest complete one has writers at work (a relay receiver fills a slot it found, before it pins it). An
        unfinished version older than that was abandoned (its writers have finished newer ones)."""
        slots = self._slots()
        newest = self.latest_complete()
        for slot in reversed(slots):
            if len(slots) <= self.slots:
                return
            if slot == keep or slot.name in pinned:
                continue
            info = self._slot_info(slot)
            if info is not None and self._missing(slot, info) and (newest is None or info["version"] > newest):
                continue
            shutil.rmtree(slot, ignore_errors=True)
            slots.remove(slot)

    def check_room(self, version_bytes: int, later_bytes: int | None = None) -> None:
        """Before the first version: refuse a root whose filesystem cannot hold the first version (`version_bytes`)
        and `slots` - 1 more of `later_bytes` (default: as large; a LoRA run's later versions are its adapters),
        raising `SyncRootFull`, rather than fail at the version that no longer fits, minutes in. A filesystem that
        reports no size (ramfs, a tmpfs mounted without a limit) is not checked."""
        later = version_bytes if later_bytes is None else later_bytes
        need = version_bytes + (self.slots - 1) * later
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if st.f_blocks and free < need:
            raise SyncRootFull(
                f"weight-sync root {self.root} has {free / 2**20:.1f} MiB free; this host keeps sync.slots="
                f"{self.slots} versions there ({need / 2**20:.1f} MiB; the first {version_bytes / 2**20:.1f} MiB), "
                f"and vLLM's engines put their own buffers in /dev/shm too; {ROOM_ADVICE}")

    def _bucket_file(self, slot: str, bucket: Bucket) -> str:
        path = bucket_path(slot, bucket.index)
        fd = _open_private(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < bucket.nbytes:
                reserve(fd, bucket.nbytes, self.root)
            elif size > bucket.nbytes:
                os.ftruncate(fd, bucket.nbytes)
        finally:
            os.close(fd)
        return path

    @contextlib.contextmanager
    def bucket_views(self, slot: str, bucket: Bucket, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
        """Writable full-tensor views of one bucket (HF names); every rank fills its part."""
        views = _views(_MAPS.get(self._bucket_file(slot, bucket), writable=True), bucket, dtype)
        try:
            yield views
        finally:
            views.clear()

    @contextlib.contextmanager
    def raw_bucket(self, slot: str, bucket: Bucket, writable: bool) -> Iterator[torch.Tensor]:
        """The whole bucket as one uint8 tensor (what a relay sends or receives)."""
        path = self._bucket_file(slot, bucket) if writable else bucket_path(slot, bucket.index)
        with warnings.catch_warnings():  # read-only map on the sending side, which only reads it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(_MAPS.get(path, writable=writable), dtype=torch.uint8)
        try:
            yield raw
        finally:
            del raw

    def mark_done(self, slot: str, version: int, rank: int, elements: dict[int, int]) -> None:
        """Rank `rank` wrote its shards of every bucket (`elements`: elements written per bucket)."""
        _write_json(Path(slot) / f"done.v{version}.r{rank}.json", {str(k): int(v) for k, v in elements.items()})

    def log_changes(self, version: int, rank: int, base: int | None, names: list[str] | None) -> None:
        """What rank `rank` changed in `version` against `base` (HF names; None: everything), so an engine serving
        an older version reloads only those tensors (`changed_since`). The newest `CHANGE_LOG` versions are kept."""
        log = self.root / "changes"
        try:
            _mkdir_private(log)
        except FileExistsError:
            pass
        _write_json(log / f"v{int(version)}.r{int(rank)}.json", {"base": base, "names": names})
        versions = sorted({int(p.name[1:].split(".")[0]) for p in log.glob(f"v*.r{int(rank)}.json")})
        for old in versions[: max(0, len(versions) - CHANGE_LOG)]:
            (log / f"v{old}.r{int(rank)}.json").unlink(missing_ok=True)

    def changed_since(self, served: int, version: int, world: int | None = None) -> set[str] | None:
        """HF names of the tensors any of `world` ranks (None: the ranks that wrote `version` here) changed between
        `served` and `version`; None when that is not known (a link missing from the log, or a version that
        changed everything): reload everything."""
        if world is None:
            slot = self.find(version)
            info = self._slot_info(Path(slot)) if slot else None
            if info is None:
                return None
            world = int(info["world"])
        out: set[str] = set()
        for rank in range(world):
            at = version
            while at != served:
                try:
                    entry = json.loads((self.root / "changes" / f"v{at}.r{rank}.json").read_text())
                except (OSError, ValueError):
                    return None
                if entry["names"] is None or entry["base"] is None or entry["base"] < served:
                    return None
                out.update(entry["names"])
                at = int(entry["base"])
        return out

    # ------------------------------------------------------------------ receiving side
    def find(self, version: int) -> str | None:
        for slot in self._slots():
            info = self._slot_info(slot)
            if info and info["version"] == version:
                return str(slot)
        return None

    def latest_complete(self) -> int | None:
        """The newest version every learner rank finished writing, if any."""
        done = [info["version"] for s in self._slots() if (info := self._slot_info(s)) and self._missing(s, info) == []]
        return max(done) if done else None

    def _missing(self, slot: Path, info: dict) -> list[int]:
        v = info["version"]
        return [r for r in range(int(info["world"])) if not (slot / f"done.v{v}.r{r}.json").exists()]

    def wait_complete(self, version: int, timeout_s: float = 60.0) -> tuple[str, BucketPlan]:
        """Wait until every learner rank finished `version`; check that each element was written exactly once."""
        deadline = awake_now() + timeout_s
        missing: list[int] | None = None
        while True:
            slot = self.find(version)
            info = self._slot_info(Path(slot)) if slot else None
            if info is not None:
                missing = self._missing(Path(slot), info)
                if not missing:
                    break
            if awake_now() > deadline:
                who = f"learner rank(s) {missing} did not finish" if missing else "no learner rank started it"
                raise SyncError(f"sync of version {version} incomplete after {timeout_s:.0f} s: {who}")
            time.sleep(0.005)
        plan = BucketPlan.from_json(info["plan"])
        written: dict[int, int] = {}
        for r in range(int(info["world"])):
            for k, n in json.loads((Path(slot) / f"done.v{version}.r{r}.json").read_text()).items():
                written[int(k)] = written.get(int(k), 0) + n
        for b in plan.buckets:
            expected = sum(e.numel for e in b.entries)
            if written.get(b.index, 0) != expected:
                raise SyncError(f"sync of version {version}: bucket {b.index} got {written.get(b.index, 0)} elements "
                                f"from the learner ranks, expected {expected} (a shard is missing or written twice)")
        return slot, plan

    def bucket_sources(self, slot: str, plan: BucketPlan) -> list[dict]:
        """What an engine's worker opens for each bucket of a slot (`transports.open_bucket`): the file and layout."""
        return shm_bucket_sources(slot, plan)

    def read_version(self, version: int, timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
        """Copies of every tensor of a published version (to inspect or save what engines receive)."""
        slot, plan = self.wait_complete(version, timeout_s)
        out: dict[str, torch.Tensor] = {}
        for b in plan.buckets:
            with read_bucket(bucket_path(slot, b.index), b, plan.torch_dtype) as views:
                out.update({k: v.clone() for k, v in views.items()})
        return out

    def pin(self, engine_id: str, slots: dict[str, int]) -> None:
        """Keep these slots (slot path -> version) from being rewritten while engine `engine_id` needs them.

        Raises SyncError if a slot no longer holds its version (it was recycled first)."""
        with self._lock():
            for slot, version in slots.items():
                info = self._slot_info(Path(slot))
                if not info or info["version"] != version:
                    now = f"version {info['version']}" if info else "nothing readable"
                    raise SyncError(f"version {version} is gone from {slot} (a newer version reused the buffer: it "
                                    f"holds {now})")
            _write_json(self.root / "pins" / f"{engine_id}.json",
                        {"pid": os.getpid(), "slots": {Path(s).name: v for s, v in slots.items()}})

    def unpin(self, engine_id: str) -> None:
        with self._lock():
            (self.root / "pins" / f"{engine_id}.json").unlink(missing_ok=True)

    def close(self) -> None:
        """Remove every buffer (the run is over)."""
        shutil.rmtree(self.root, ignore_errors=True)


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a caller still holds a view; the map closes when that view is collected
        pass


def _views(buffer: object, bucket: Bucket, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # read-only maps: the engine side never writes through these views
        warnings.simplefilter("ignore", UserWarning)
        return {e.name: torch.frombuffer(buffer, dtype=dtype, count=e.numel, offset=e.offset).view(e.shape)
                for e in bucket.entries} if bucket.nbytes else {}


@contextlib.contextmanager
def read_bucket(path: str, bucket: Bucket, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
    """Read-only tensors of one bucket file, without a copy (used inside the engine's worker)."""
    size = os.stat(path).st_size
    if size != bucket.nbytes:
        raise SyncError(f"{path} holds {size} bytes, expected {bucket.nbytes}")
    views = _views(_MAPS.get(path, writable=False), bucket, dtype)
    try:
        yield views
    finally:
        views.clear()


class _MapCache:
    """Mappings of bucket files, kept across syncs.

    Slots are recycled, so the same files come back every other version;
    mapping a 256 MB file afresh costs ~65k page faults (a copy into it then
    ran at ~3 GB/s instead of ~11 GB/s on our 2-core test machine). A mapping
    is reused while the path still names the same file (inode and size);
    otherwise the new file is mapped with MAP_POPULATE (one fault-in call).
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[str, bool], tuple[int, int, mmap.mmap]] = {}
        self._lock = threading.Lock()
        """The relay's receiver threads map buckets at once: without it two of them unmapped the same gone file
        and the second died on a KeyError (tests/sync/test_map_cache.py)."""

    def get(self, path: str, writable: bool) -> mmap.mmap:
        with self._lock:
            return self._get(path, writable)

    def _get(self, path: str, writable: bool) -> mmap.mmap:
        st = os.stat(path)
        key = (path, writable)
        hit = self._maps.get(key)
        if hit is not None and hit[0] == st.st_ino and hit[1] == st.st_size:
            return hit[2]
        if hit is not None:
            _close(self._maps.pop(key)[2])
        self._drop_missing()
        with open(path, "r+b" if writable else "rb") as f:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(f.fileno(), st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=prot)
        self._maps[key] = (st.st_ino, st.st_size, mm)
        return mm

    def _drop_missing(self) -> None:
        """Unmap files that are gone (a dropped slot), so their memory is freed."""
        for key, (ino, _, mm) in list(self._maps.items()):
            try:
                alive = os.stat(key[0]).st_ino == ino
            except FileNotFoundError:
                alive = False
            if not alive:
                _close(mm)
                del self._maps[key]


_MAPS = _MapCache()
