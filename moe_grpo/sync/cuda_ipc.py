"""CUDA-IPC weight transport: bucket buffers in the learner's GPU memory, opened by engines on the same GPUs.

The bookkeeping is the shared-memory transport's (`transport.py`): a private
root directory holding, per slot, `version.json` (version, world size, plan),
one `done.v<version>.r<rank>.json` marker per learner rank, and the engines'
pins; slots are recycled, a version is complete only when every rank marked
it done and each bucket's element count adds up (all-or-nothing), and pinned
slots are never rewritten. What differs is where the bytes live: instead of
files on /dev/shm, every bucket of a slot is one `uint8` CUDA buffer owned by
learner rank 0's process, and the slot's `ipc.json` holds, per bucket, the
CUDA IPC handle of that buffer (`cudaIpcGetMemHandle` through torch's
`storage._share_cuda_()`, with torch's cross-process reference counter and
event). Learner ranks write their shards into the buffers device to device;
an engine process opens the same buffers by handle (`rebuild_cuda_tensor`,
i.e. `cudaIpcOpenMemHandle`) and copies device to device into its weights.

Rules of use:

- The owner (rank 0's `CudaIpcTransport`) must outlive every reader of its
  buffers; a reader of a dead owner's handles gets a `SyncError`.
- A CUDA IPC handle cannot be opened in the process that created it: the
  owner reads its own buffers directly, every other process opens them.
- Writers must finish their copies (synchronise the copy stream) before
  `mark_done`; `WeightSync` does.
- Learner ranks other than 0 open rank 0's buffers by handle as well, which
  needs peer access between their GPUs and rank 0's (one node). Only one
  process per GPU, world size 1, has run (one H100).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from moe_grpo.awake_clock import awake_now
from moe_grpo.sync.plan import Bucket, BucketPlan
from moe_grpo.sync.transport import SharedMemoryTransport, SyncError, _write_json, default_root

IPC_FILE = "ipc.json"


def _encode(value: Any) -> Any:
    return {"hex": value.hex()} if isinstance(value, (bytes, bytearray)) else value


def _decode(value: Any) -> Any:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) and "hex" in value else value


def share_handle(buffer: torch.Tensor) -> dict[str, Any]:
    """The JSON-able CUDA IPC description of a whole 1-D uint8 CUDA buffer (torch's `reduce_tensor` fields)."""
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(f"share_handle takes a 1-D uint8 CUDA tensor, got {buffer.dtype} {list(buffer.shape)} "
                         f"on {buffer.device}")
    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return {"size": list(size), "stride": list(stride), "offset": int(offset), "device": int(device),
            "handle": _encode(handle), "storage_bytes": int(storage_bytes), "storage_offset": int(storage_offset),
            "ref_handle": _encode(ref_handle), "ref_offset": int(ref_offset), "event_handle": _encode(event_handle),
            "event_sync": bool(event_sync)}


def open_handle(desc: dict[str, Any]) -> torch.Tensor:
    """Open a buffer another process shared with `share_handle` (device memory, no copy)."""
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(desc["size"]), tuple(desc["stride"]), desc["offset"], torch.UntypedStorage,
        torch.uint8, desc["device"], _decode(desc["handle"]), desc["storage_bytes"], desc["storage_offset"], False,
        _decode(desc["ref_handle"]), desc["ref_offset"], _decode(desc["event_handle"]), desc["event_sync"])


def device_views(raw: torch.Tensor, bucket: Bucket, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Full-tensor views (HF names) into one bucket's raw device buffer."""
    item = torch.empty(0, dtype=dtype).element_size()
    return {e.name: raw[e.offset : e.offset + e.numel * item].view(dtype).view(e.shape) for e in bucket.entries}


@dataclass
class _Owned:
    sizes: tuple[int, ...]
    buffers: list[torch.Tensor]
    handles: list[dict[str, Any]]


class CudaIpcTransport(SharedMemoryTransport):
    """Versioned, recycled bucket buffers in rank 0's GPU memory, shared by CUDA IPC handle.

    `root` holds the bookkeeping (default: the shared-memory transport's root
    with an `_ipc` suffix); `device` is where rank 0 allocates the buffers
    (default: the current CUDA device).
    """

    def __init__(self, root: str | None = None, slots: int = 2, device: torch.device | int | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise SyncError("CudaIpcTransport needs CUDA: torch.cuda.is_available() is False in this process")
        super().__init__(root or default_root() + "_ipc", slots)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device={device!r}, expected a CUDA device")
        self._owned: dict[str, _Owned] = {}
        self._opened: dict[tuple[str, int], torch.Tensor] = {}
        self._views: dict[tuple[str, int, torch.dtype, int], dict[str, torch.Tensor]] = {}

    def check_room(self, version_bytes: int, later_bytes: int | None = None) -> None:
        """Nothing to check under the root: the versions' buffers are in rank 0's GPU memory."""

    # ------------------------------------------------------------------ sending side
    def claim(self, version: int, plan: BucketPlan, rank: int, world: int, timeout_s: float = 60.0) -> str:
        """The slot for `version`; rank 0 (re)allocates its device buffers and publishes their handles."""
        slot = super().claim(version, plan, rank, world, timeout_s)
        sizes = tuple(b.nbytes for b in plan.buckets)
        if rank == 0:
            for gone in [s for s in self._owned if not os.path.isdir(s)]:  # slots dropped by the recycling
                del self._owned[gone]
                self._views = {k: v for k, v in self._views.items() if k[0] != gone}
            owned = self._owned.get(slot)
            if owned is None or owned.sizes != sizes:
                self._owned.pop(slot, None)
                self._views = {k: v for k, v in self._views.items() if k[0] != slot}
                self.forget_base(slot)  # new buffers: a delta version is written whole into them
                buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
                owned = self._owned[slot] = _Owned(sizes, buffers, [share_handle(b) for b in buffers])
            _write_json(Path(slot) / IPC_FILE, {"version": version, "pid": os.getpid(), "sizes": list(sizes),
                                                 "buckets": owned.handles})
            return slot
        deadline = awake_now() + timeout_s
        while (info := self._ipc_info(slot)) is None or info["version"] != version:
            if awake_now() > deadline:
                raise SyncError(f"sync of version {version}: learner rank 0 published no CUDA IPC handles in {slot} "
                                f"within {timeout_s:.0f} s")
            time.sleep(0.002)
        return slot

    def _ipc_info(self, slot: str) -> dict[str, Any] | None:
        try:
            return json.loads((Path(slot) / IPC_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _raw(self, slot: str, bucket: Bucket) -> torch.Tensor:
        owned = self._owned.get(slot)
        if owned is not None and bucket.index < len(owned.buffers):
            raw = owned.buffers[bucket.index]
        else:
            info = self._ipc_info(slot)
            if info is None:
                raise SyncError(f"{slot} has no {IPC_FILE}: no learner rank 0 published CUDA IPC handles there")
            if bucket.index >= len(info["buckets"]):
                raise SyncError(f"{slot}/{IPC_FILE} lists {len(info['buckets'])} buckets, bucket {bucket.index} asked for")
            desc = info["buckets"][bucket.index]
            key = (desc["handle"]["hex"], desc["storage_offset"])
            raw = self._opened.get(key)  # type: ignore[arg-type]
            if raw is None:
                try:
                    raw = open_handle(desc)
                except RuntimeError as e:
                    raise SyncError(f"cannot open bucket {bucket.index} of {slot} by CUDA IPC handle (owner pid "
                                    f"{info['pid']}, device {desc['device']}): {e}") from e
                self._opened[key] = raw  # type: ignore[index]
        if raw.numel() != bucket.nbytes:
            raise SyncError(f"bucket {bucket.index} of {slot} holds {raw.numel()} bytes on the device, "
                            f"expected {bucket.nbytes}")
        return raw

    @contextlib.contextmanager
    def bucket_views(self, slot: str, bucket: Bucket, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
        """Writable full-tensor device views of one bucket (HF names); every rank fills its part."""
        raw = self._raw(slot, bucket)
        key = (slot, bucket.index, dtype, raw.data_ptr())
        cached = self._views.get(key)
        if cached is None:  # hundreds of views per bucket: built once per buffer, not once per sync
            cached = self._views[key] = device_views(raw, bucket, dtype)
        views = dict(cached)
        try:
            yield views
        finally:
            views.clear()

    @contextlib.contextmanager
    def raw_bucket(self, slot: str, bucket: Bucket, writable: bool) -> Iterator[torch.Tensor]:
        """The whole bucket as one uint8 device tensor."""
        yield self._raw(slot, bucket)

    # ------------------------------------------------------------------ receiving side
    def bucket_sources(self, slot: str, plan: BucketPlan) -> list[dict]:
        """What an engine's worker opens for each bucket (`transports.open_bucket`): the buffer's IPC handle."""
        info = self._ipc_info(slot)
        if info is None or len(info["buckets"]) != len(plan.buckets):
            raise SyncError(f"{slot}/{IPC_FILE} is missing or lists another number of buckets than the plan's "
                            f"{len(plan.buckets)}")
        return [{"kind": "cuda_ipc", "handle": info["buckets"][b.index], "nbytes": b.nbytes, "dtype": plan.dtype,
                 "entries": [(e.name, list(e.shape), e.offset) for e in b.entries]} for b in plan.buckets]

    @contextlib.contextmanager
    def read_bucket(self, slot: str, bucket: Bucket, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
        """Device views of one bucket of a complete version (after `wait_complete` and `pin`): copy out of them."""
        with self.bucket_views(slot, bucket, dtype) as views:
            yield views

    def read_version(self, version: int, timeout_s: float = 60.0) -> dict[str, torch.Tensor]:
        """Device copies of every tensor of a published version."""
        slot, plan = self.wait_complete(version, timeout_s)
        out: dict[str, torch.Tensor] = {}
        for b in plan.buckets:
            with self.read_bucket(slot, b, plan.torch_dtype) as views:
                out.update({k: v.clone() for k, v in views.items()})
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def close(self) -> None:
        """Drop the buffers (owner) or the opened mappings (readers), then the bookkeeping."""
        self._views.clear()
        self._opened.clear()
        self._owned.clear()
        super().close()
