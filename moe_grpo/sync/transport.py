"""Carrying bucketed weights from learner ranks to engines: the interface and the shared-memory transport.

A transport has a sending side (every learner rank: claim the version's
buffers, write its shards into bucket views, mark itself done) and a
receiving side (an engine: wait until every rank is done, pin the version,
read bucket by bucket). `SharedMemoryTransport` is the one that exists
today: buckets are files on /dev/shm that learner ranks and vLLM workers
map into their address space, so the learner's write *is* the transfer and
the engine reads without a copy. It serves every engine on the learner's
host. NCCL (other hosts) and CUDA IPC (engines on the learner's GPUs) are
not built yet.

Buffers are recycled: a transport keeps `slots` full versions (default 2),
and a new version goes into a slot no engine has pinned. Freshly created
shared-memory pages cost ~10x a memcpy to fault in on first touch, reused
pages do not. An engine pins the slot it is applying and the one it serves
(its rollback source); when every slot is pinned, the sender opens an extra
slot rather than wait, so a slow engine never stalls the learner, and
extra slots are removed once nobody pins them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator, Protocol

import torch

from moe_grpo.sync.plan import Bucket, BucketPlan


class SyncError(RuntimeError):
    """A weight sync was refused or failed; names the part (rank, engine, tensor) and the version."""


class WeightTransport(Protocol):
    """Learner ranks write a version bucket by bucket; engines read it once every rank is done."""

    def claim(self, version: int, plan: BucketPlan, rank: int, world: int, timeout_s: float) -> str: ...

    def bucket_views(self, slot: str, bucket: Bucket, dtype: torch.dtype) -> contextlib.AbstractContextManager[dict[str, torch.Tensor]]: ...

    def mark_done(self, slot: str, version: int, rank: int, elements: dict[int, int]) -> None: ...

    def wait_complete(self, version: int, timeout_s: float) -> tuple[str, BucketPlan]: ...

    def pin(self, engine_id: str, slots: dict[str, int]) -> None: ...

    def unpin(self, engine_id: str) -> None: ...


def bucket_path(slot: str, index: int) -> str:
    """The file of bucket `index` inside a slot."""
    return os.path.join(slot, f"b{index:05d}.bin")


def default_root() -> str:
    return os.path.join("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(), f"moe_grpo_sync_{os.getuid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, value: object) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class SharedMemoryTransport:
    """Versioned, recycled bucket files under `root` (a tmpfs such as /dev/shm)."""

    def __init__(self, root: str | None = None, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots}, expected at least 1")
        self.root, self.slots = Path(root or default_root()), slots
        (self.root / "pins").mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ bookkeeping
    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as f:
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
            if _pid_alive(int(pin["pid"])):
                out[p.stem] = {k: int(v) for k, v in pin["slots"].items()}
            else:
                p.unlink(missing_ok=True)
        return out

    def _slot_info(self, slot: Path) -> dict | None:
        try:
            return json.loads((slot / "version.json").read_text())
        except (OSError, ValueError):
            return None

    def _slots(self) -> list[Path]:
        return sorted(p for p in self.root.glob("slot*") if p.is_dir())

    # ------------------------------------------------------------------ sending side
    def claim(self, version: int, plan: BucketPlan, rank: int, world: int, timeout_s: float = 60.0) -> str:
        """The slot this version goes into. Rank 0 picks it (never one an engine pins); other ranks wait for that."""
        if rank != 0:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                slot = self.find(version)
                if slot is not None:
                    return slot
                time.sleep(0.002)
            raise SyncError(f"sync of version {version}: learner rank 0 claimed no buffer within {timeout_s:.0f} s")
        with self._lock():
            pinned = {s for pins in self._pins().values() for s in pins}
            slots = self._slots()
            # A slot whose version some rank is still writing is not free either (a slow rank's late
            # writes would land in the new version).
            free = [s for s in slots if s.name not in pinned
                    and ((info := self._slot_info(s)) is None or not self._missing(s, info))]
            if free and len(slots) >= self.slots:  # least recently written first
                slot = min(free, key=lambda s: (self._slot_info(s) or {"version": -1})["version"])
            else:
                slot = self.root / f"slot{len(slots)}"
                while slot.exists():
                    slot = slot.with_name(slot.name + "x")
                slot.mkdir()
            for marker in slot.glob("done.*"):
                marker.unlink()
            _write_json(slot / "version.json", {"version": version, "world": world, "plan": plan.to_json()})
            self._drop_extra_slots(keep=slot, pinned=pinned)
        return str(slot)

    def _drop_extra_slots(self, keep: Path, pinned: set[str]) -> None:
        slots = self._slots()
        for slot in reversed(slots):
            if len(slots) <= self.slots:
                return
            if slot != keep and slot.name not in pinned:
                shutil.rmtree(slot, ignore_errors=True)
                slots.remove(slot)

    def _bucket_file(self, slot: str, bucket: Bucket) -> str:
        path = bucket_path(slot, bucket.index)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != bucket.nbytes:
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
        deadline = time.monotonic() + timeout_s
        missing: list[int] | None = None
        while True:
            slot = self.find(version)
            info = self._slot_info(Path(slot)) if slot else None
            if info is not None:
                missing = self._missing(Path(slot), info)
                if not missing:
                    break
            if time.monotonic() > deadline:
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
                    raise SyncError(f"version {version} is gone from {slot} (a newer version reused the buffer)")
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
    item = torch.empty(0, dtype=dtype).element_size()
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

    def get(self, path: str, writable: bool) -> mmap.mmap:
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
