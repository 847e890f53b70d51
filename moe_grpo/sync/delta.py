"""Delta versions: what changed in the engine's dtype since the previous version, found, encoded and applied exactly.

A learner rank keeps the engine-dtype values it published last of its shards,
bucket by bucket (`DeltaTracker`: one copy of its own shards in the engine's
dtype, e.g. 2 bytes per parameter for bf16, beside its float32 master
weights). A rank's *part* of a bucket is its shards of that bucket's tensors,
one after another in a fixed order (`RankBucket`). For a new version the rank
rounds its shards into one flat engine-dtype buffer per bucket, compares it bit
for bit with the kept copy (one comparison and one `nonzero` per bucket, not
per tensor) and keeps the ascending indices inside the part and the new values
of the elements that changed (`BucketChange`). Bitwise, not numerically: -0.0
vs 0.0 and NaN payloads count as changes, so applying the changes gives exactly
the bits a full version would carry. Which tensors changed (for the engines'
reload and `experts_unchanged`) comes from where the indices fall among the
part's shard boundaries (`searchsorted`), not from a loop over tensors.

A tensor with no changed element costs nothing in the index and varint
encodings, and one bit per element in the bitmap. A routed expert is a handful
of such tensors (`experts_unchanged` counts the experts none of whose tensors
changed). On the wire (the relay, `encode` / `decode`) each bucket's changes
take the smallest of three encodings, each over the rank's whole part of the
bucket:

- "index": int32 indices inside the part (int64 for a part of 2**31 elements
  or more) and the values;
- "bitmap": one bit per element of the part and the values in index order;
- "varint": the gaps between changed indices and the steps of the values' bit
  patterns (new - old), each as a LEB128 varint. A small optimizer step moves a
  changed bf16 value by a few units in its last place, so a change costs about
  2 bytes, the same as its value: the wire carries about the changed fraction
  of a full version (at 3% changed: 9% with the index or bitmap encodings). The
  receiver adds the steps to the base version it holds.

Indices are the part's own: the receiver knows where each of a rank's shards
lies in the full tensor and where that tensor lies in the bucket (`Placement`,
sent once when a relay group meets), so a tensor split over TP ranks costs
each rank a bitmap of its own slab only.

Applying (`apply_bucket`) writes the values at their positions in the bucket
(one indexed write per bucket into the bucket's flat buffer, which holds the
previous version); a buffer holding an older version is brought forward by
applying each newer version's changes in order (`DeltaHistory.chain`).

Two implementations of the same steps, chosen per tracker (`torch_ops`): on
CPU (shared memory, the relay) numpy's passes on the tensors' memory, which
took a third to a tenth of torch's CPU kernels' time; on a GPU (`cuda_ipc`)
torch ops on the device end to end (compare, `nonzero`, gather, steps, the
encodings' sizes, positions, `index_copy_` into the slot and the kept copy),
with two small host reads a version (the encodings' sizes, the changed
tensors' names): a full version there is one ~10 ms device copy of 315 MB, and
copying the changes to the host and back cost 14-275x that (H200, 2026-11-27).
`torch_ops=True` runs the device path on CPU tensors too (tests, benches).
The encodings' sizes mean the same on both paths (`sync/bytes`: the payload of
the smallest encoding); over `cuda_ipc` no bytes cross a wire, and that figure
is what the relay would carry, not what the device writes (positions + values).
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from moe_grpo.sync.plan import Bucket, BucketPlan

ENCODINGS = ("index", "bitmap", "varint")

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of each element size: changed elements are found by comparing bits, not values."""

COMPARE_CHUNK = 1 << 22
"""Elements compared at a time in a diff on CPU (a 4 MB mask, reused)."""

COMPARE_CHUNK_DEVICE = 1 << 26
"""Elements compared at a time on a GPU (a 64 MB mask): each chunk's `nonzero` waits for the device to count its
hits, so fewer, larger chunks (a 256 MB bf16 bucket's part in two)."""


def _compare_chunk(device: torch.device) -> int:
    return COMPARE_CHUNK if device.type == "cpu" else COMPARE_CHUNK_DEVICE

Placement = tuple[Sequence[int], Sequence[int], int]
"""Where a shard lies in its full HF tensor: (shape, strides, element offset) of a view of the contiguous tensor."""


def placed_positions(local: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Flat positions in the full tensor of the shard's elements `local` (flat indices in the shard)."""
    shape, strides, offset = placement
    out = torch.full_like(local, int(offset))
    rest = local.clone()
    for size, stride in zip(reversed(list(shape)), reversed(list(strides))):
        out += (rest % int(size)) * int(stride)
        rest //= int(size)
    return out


def _is_dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether a view's elements are consecutive in row-major order (its flat index + offset is the position)."""
    expected = 1
    for size, stride in zip(reversed(list(shape)), reversed(list(strides))):
        if int(size) != 1 and int(stride) != expected:
            return False
        expected *= int(size)
    return True


class RankBucket:
    """One rank's part of one bucket: its shards (HF name, place in the full tensor, element offset of that
    tensor in the bucket), their elements one after another in this order."""

    def __init__(self, names: Sequence[str], placements: Sequence[Placement], entry_offsets: Sequence[int]) -> None:
        if not len(names) == len(placements) == len(entry_offsets):
            raise ValueError(f"{len(names)} shards, {len(placements)} placements, {len(entry_offsets)} offsets")
        self.names = tuple(names)
        self.placements = tuple((tuple(int(s) for s in p[0]), tuple(int(s) for s in p[1]), int(p[2]))
                                for p in placements)
        self.numels = [math.prod(p[0]) for p in self.placements]
        starts = np.concatenate([[0], np.cumsum(self.numels, dtype=np.int64)])
        self.starts = torch.from_numpy(starts)
        """Where each shard starts in the part, and (last) the part's length."""
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.numel = int(starts[-1])
        dense = [_is_dense(p[0], p[1]) for p in self.placements]
        self._sparse = [i for i, d in enumerate(dense) if not d]
        """Shards whose elements are not consecutive in their tensor (TP slabs along a later dimension)."""
        self._shift = torch.tensor([int(o) + p[2] - int(s) for o, p, s in zip(entry_offsets, self.placements, starts)],
                                   dtype=torch.int64)
        """Per shard: bucket position - part index of its elements (a dense shard's)."""
        self.entry_offsets = [int(o) for o in entry_offsets]
        self.key = f"{zlib.crc32(json.dumps([self.names, self.numels]).encode()):08x}"
        """A checksum of the shards' names and sizes: a blob for another rank's part is refused."""

    @staticmethod
    def of(bucket: Bucket, rows: Sequence[tuple[str, Placement]], item: int) -> "RankBucket":
        """From a bucket of the plan and the rank's (HF name, placement) rows in that bucket, at `item` bytes per
        element (entry offsets in a bucket are bytes)."""
        offsets = {e.name: e.offset for e in bucket.entries}
        for name, _ in rows:
            if name not in offsets:
                raise ValueError(f"shard of {name!r} placed in bucket {bucket.index}, which does not hold it")
            if offsets[name] % item:
                raise ValueError(f"{name} starts at byte {offsets[name]} of bucket {bucket.index}, not a multiple "
                                 f"of the {item}-byte element")
        return RankBucket([n for n, _ in rows], [p for _, p in rows], [offsets[n] // item for n, _ in rows])

    def _starts_shift(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`starts` and the per-shard shifts on `device` (copied there once: searchsorted wants both on one)."""
        if device.type == "cpu":
            return self.starts, self._shift
        if device not in self._on_device:
            self._on_device[device] = (self.starts.to(device), self._shift.to(device))
        return self._on_device[device]

    def counts(self, local: torch.Tensor) -> torch.Tensor:
        """Changed elements per shard of ascending part indices `local` (on `local`'s device)."""
        return torch.searchsorted(local, self._starts_shift(local.device)[0]).diff()

    def positions(self, local: torch.Tensor, torch_ops: bool = False) -> torch.Tensor:
        """Element positions in the bucket's flat buffer of ascending part indices `local` (on its device;
        `torch_ops`: torch's repeat on CPU too, as on a GPU)."""
        starts, shift = self._starts_shift(local.device)
        cuts = torch.searchsorted(local, starts)
        counts = cuts.diff()
        if local.device.type == "cpu" and not torch_ops:  # numpy's repeat: a tenth of repeat_interleave's time
            out = torch.from_numpy(np.repeat(shift.numpy(), counts.numpy()))
            out += local
        else:
            out = local + torch.repeat_interleave(shift, counts, output_size=local.numel())
        if self._sparse:
            at = cuts.tolist()
            for i in self._sparse:
                if at[i] < at[i + 1]:
                    seg = local[at[i] : at[i + 1]] - int(self.starts[i])
                    out[at[i] : at[i + 1]] = placed_positions(seg, self.placements[i]) + self.entry_offsets[i]
        return out


@dataclass
class BucketChange:
    """The changed elements of one rank's part of one bucket."""

    part: RankBucket
    local: torch.Tensor
    """int64 ascending indices of the changed elements inside the part (what travels)."""
    values: torch.Tensor
    """The new values, in the engine's dtype, one per index."""
    steps: torch.Tensor | None = None
    """Integer differences of the new values' bit patterns from the old ones (None: no old values, a first
    version): a small weight update moves a bf16 value by a few units in its last place, which a varint carries
    in one byte."""
    torch_ops: bool = False
    """Whether its tensors stay on their device and are worked on with torch ops (a GPU rank's changes); False:
    on the host, numpy's passes."""
    _positions: torch.Tensor | None = field(default=None, repr=False)
    _sizes: dict | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return int(self.local.numel())

    def positions(self) -> torch.Tensor:
        """Element positions in the bucket's flat buffer (kept: a chain may apply one change to several slots)."""
        if self._positions is None:
            self._positions = self.part.positions(self.local, self.torch_ops)
        return self._positions

    def names(self) -> list[str]:
        """The HF tensors with a changed element."""
        return _names_of([self])

    def entries(self) -> list["EntryChange"]:
        """Per changed shard: its changes (positions inside the full tensor), for inspection and tests."""
        out = []
        cuts = torch.searchsorted(self.local, self.part._starts_shift(self.local.device)[0]).tolist()
        for i, name in enumerate(self.part.names):
            a, b = cuts[i], cuts[i + 1]
            if a == b:
                continue
            within = self.local[a:b] - int(self.part.starts[i])
            out.append(EntryChange(name, placed_positions(within, self.part.placements[i]), self.values[a:b], within,
                                   self.part.numels[i], None if self.steps is None else self.steps[a:b]))
        return out


@dataclass(frozen=True)
class EntryChange:
    """One shard's part of a `BucketChange` (`entries()`): for inspection; nothing is sent or applied this way."""

    name: str
    positions: torch.Tensor
    """int64 flat positions inside the full HF tensor, in the shard's element order."""
    values: torch.Tensor
    local: torch.Tensor
    """int64 flat indices of the changed elements inside the shard, ascending."""
    shard_numel: int
    steps: torch.Tensor | None = None

    @property
    def count(self) -> int:
        return int(self.positions.numel())


@dataclass
class VersionDelta:
    """One rank's changes of one version against the version before it, by bucket index."""

    version: int
    base: int | None
    """The version these changes are against (None: against nothing, every element is a change)."""
    changes: dict[int, BucketChange] = field(default_factory=dict)

    def names(self) -> set[str]:
        """The HF tensors with a changed element, in every bucket (one host read for all of them)."""
        return set(_names_of(list(self.changes.values())))

    def changed_elements(self) -> int:
        return sum(c.count for c in self.changes.values())


def _names_of(changes: list[BucketChange]) -> list[str]:
    """The shards with a changed element of each change, in order: their per-shard counts read to the host once
    for all of them (on a GPU each read waits for the device)."""
    if not changes:
        return []
    hit = torch.cat([c.part.counts(c.local) > 0 for c in changes]).tolist()
    return [n for n, h in zip((n for c in changes for n in c.part.names), hit) if h]


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element size (bitwise comparison; no copy)."""
    return t.view(_INT_VIEW[t.element_size()])


def flat_bucket(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bucket's bytes (a uint8 tensor, `raw_bucket`) as one flat tensor of `dtype` (entry offsets are aligned)."""
    item = torch.empty(0, dtype=dtype).element_size()
    return raw[: raw.numel() - raw.numel() % item].view(dtype)


def _position_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _not_equal(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """`out` = a != b elementwise for integer views (bits, `bits`): numpy's on CPU, where torch's `ne` on int16
    took 2.8x numpy's time (one thread, 37.7M elements, 2-core test machine unloaded: 18.5 vs 6.7 ms)."""
    if a.device.type == "cpu":
        np.not_equal(a.numpy(), b.numpy(), out=out.numpy())
    else:
        torch.ne(a, b, out=out)


def _flatnonzero(mask: torch.Tensor, torch_ops: bool = False) -> torch.Tensor:
    """int64 indices of a flat bool tensor's True elements (numpy's on CPU: half of torch's `nonzero` time on
    a 75M-element mask; no copy either way)."""
    if mask.device.type == "cpu" and not torch_ops:
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().view(-1)


# The encodings' integer passes run in numpy on the tensors' memory (no copy): on the CPUs measured (2-core AMD
# EPYC, torch 2.13 CPU, one thread per learner rank) torch's integer shifts, conversions and uint8 sums took 2-17x
# numpy's time on the same arrays (a zigzag of 11.7M int32 steps: 72 vs 20 ms; a uint8 sum: 44 vs 2.6 ms;
# repeat_interleave to 11.7M: 93 vs 10 ms).


def _varint_sizes(x: torch.Tensor) -> torch.Tensor:
    """Bytes of each non-negative integer as a LEB128 varint (7 bits a byte), as uint8."""
    xn = x.numpy()
    n = np.ones(xn.shape, dtype=np.uint8)
    top = int(xn.max()) if xn.size else 0
    for k in range(1, max(1, (top.bit_length() + 6) // 7)):
        n += xn >= (1 << (7 * k))
    return torch.from_numpy(n)


def _total(n: torch.Tensor) -> int:
    """The sum of a uint8 tensor (varint sizes)."""
    return int(n.numpy().sum(dtype=np.int64))


def _varint(x: torch.Tensor, n: torch.Tensor | None = None) -> torch.Tensor:
    """Non-negative integers as LEB128 varints, one after another (uint8); `n`: their sizes (`_varint_sizes`), if
    known. A small update's gaps and steps take one byte but for a few: every value's low byte at once, the few
    longer ones' first bytes fixed, and their further bytes inserted after them (work on the few, not on all)."""
    xn = x.numpy()
    nn = (_varint_sizes(x) if n is None else n).numpy()
    first = xn.astype(np.uint8)  # a one-byte value is its low byte
    if not xn.size or int(nn.max()) <= 1:
        return torch.from_numpy(first)
    long = np.flatnonzero(nn > 1)
    xl, more = xn[long].astype(np.int64), nn[long].astype(np.int64) - 1
    first[long] = (xl & 127) | 128
    k = np.arange(1, int(more.max()) + 1)
    rows = (((xl[:, None] >> (7 * k)) & 127) | ((k < more[:, None]).astype(np.int64) << 7)).astype(np.uint8)
    used = k <= more[:, None]
    return torch.from_numpy(np.insert(first, np.repeat(long + 1, more), rows[used]))


def _unvarint(buf: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` LEB128 varints that fill the uint8 tensor `buf`, as int64."""
    return torch.from_numpy(_unvarint_np(buf.numpy(), count).astype(np.int64, copy=False))


def _unvarint_np(b: np.ndarray, count: int) -> np.ndarray:
    """The `count` LEB128 varints that fill the uint8 array `b`: `b` itself when every value took one byte (no
    copy), else int64. The few longer than a byte are found by their continuation bytes: every value's first
    byte at once, then those few finished."""
    cont = np.flatnonzero(b >= 128)
    if b.size - cont.size != count or (count and int(b[-1]) >= 128):
        raise ValueError(f"a varint section of {b.size} bytes holds {b.size - cont.size} values"
                         f"{' and an unfinished one' if count and int(b[-1]) >= 128 else ''}, expected {count}")
    if not cont.size:
        return b
    out = np.delete(b, cont + 1).astype(np.int64)  # each value's first byte
    starts = np.ones(cont.size, dtype=bool)  # a run of continuation bytes starts a longer value
    starts[1:] = cont[1:] != cont[:-1] + 1
    runs = np.flatnonzero(starts)
    at = cont[runs]
    value = at - runs  # bytes before it that are not first bytes: the continuation bytes before the run
    lens = np.diff(runs, append=cont.size) + 1
    acc = out[value] & 127
    for k in range(1, int(lens.max())):
        sel = np.flatnonzero(lens > k)
        acc[sel] |= (b[at[sel] + k] & 127).astype(np.int64) << (7 * k)
    out[value] = acc
    return out


_UNZIGZAG_BYTE = (lambda u: (u >> 1) ^ -(u & 1))(np.arange(256, dtype=np.int32))
"""A one-byte zigzag value's step (a lookup: one pass over a section of one-byte steps)."""


def _zigzag(v: torch.Tensor) -> torch.Tensor:
    """Signed steps as non-negative integers (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...), in their own dtype (a bf16
    step fits int32 twice over)."""
    x = v.cpu().numpy()
    return torch.from_numpy((x << 1) ^ (x >> (x.itemsize * 8 - 1)))


def _unzigzag(u: torch.Tensor) -> torch.Tensor:
    x = u.numpy()
    return torch.from_numpy((x >> 1) ^ -(x & 1))


def _gaps(local: torch.Tensor, numel: int) -> torch.Tensor:
    """Ascending indices inside a part of `numel` elements as their gaps (the first from -1), all >= 1; int32
    where the part allows (half the memory traffic of the varint passes)."""
    x = local.cpu().numpy()
    out = np.empty(x.shape, dtype=np.int32 if numel < 2**31 else np.int64)
    if x.size:
        out[0] = x[0] + 1
        np.subtract(x[1:], x[:-1], out=out[1:], casting="unsafe")  # gaps < numel: they fit
    return torch.from_numpy(out)


def _gaps_torch(local: torch.Tensor, numel: int) -> torch.Tensor:
    """`_gaps` as torch ops on `local`'s device (the same values and dtype)."""
    out = torch.empty(local.shape, dtype=_position_dtype(numel), device=local.device)
    if local.numel():
        out[:1] = local[:1] + 1
        out[1:] = local[1:] - local[:-1]  # gaps < numel: they fit (a narrowing copy)
    return out


def _zigzag_torch(v: torch.Tensor) -> torch.Tensor:
    """`_zigzag` as torch ops on `v`'s device (arithmetic right shift of a signed integer, as numpy's)."""
    return (v << 1) ^ (v >> (v.element_size() * 8 - 1))


def _varint_bytes_torch(x: torch.Tensor) -> torch.Tensor:
    """The LEB128 bytes of non-negative integers `x`, summed on their device (an int64 scalar tensor): one byte
    each, and one more for each 7 bits past the first 7. One pass per 7 bits of the dtype's width (4 for int32),
    not of the largest value as on the host (knowing it would be a host read): a pass past it counts nothing."""
    total = torch.zeros((), dtype=torch.int64, device=x.device) + x.numel()
    for k in range(1, (x.element_size() * 8 - 1 + 6) // 7):  # a non-negative value has width - 1 bits
        total += (x >= (1 << (7 * k))).sum()
    return total


def _sizes(change: BucketChange, item: int) -> dict[str, int]:
    """Payload bytes of each encoding of one bucket's changes (kept on the change: `encode` reuses the varints'
    sizes)."""
    if change._sizes is None:
        _fill_sizes([change], item)
    return {k: v for k, v in change._sizes.items() if not k.startswith("_")}  # type: ignore[union-attr]


def _fill_sizes(changes: list[BucketChange], item: int) -> None:
    """Size the encodings of every change not sized yet. A device path change's varint bytes are summed on its
    device and read to the host once for all of them (`torch_ops`); its gaps and zigzag steps are not kept
    (device memory: `encode`, the relay's, remakes them)."""
    pending: list[tuple[BucketChange, torch.Tensor]] = []
    for change in changes:
        if change._sizes is not None:
            continue
        n, numel = change.count, change.part.numel
        sizes: dict = {"index": n * (_position_dtype(numel).itemsize + item), "bitmap": math.ceil(numel / 8) + n * item}
        if change.steps is not None and change.torch_ops:
            gaps, steps = _gaps_torch(change.local, numel), _zigzag_torch(change.steps)
            pending.append((change, _varint_bytes_torch(gaps) + _varint_bytes_torch(steps)))
        elif change.steps is not None:
            gaps, steps = _gaps(change.local, numel), _zigzag(change.steps)
            gap_n, step_n = _varint_sizes(gaps), _varint_sizes(steps)
            sizes["varint"] = _total(gap_n) + _total(step_n)
            sizes["_varints"] = (gaps, gap_n, steps, step_n)
        change._sizes = sizes
    if pending:
        for (change, _), total in zip(pending, torch.stack([t for _, t in pending]).tolist()):
            change._sizes["varint"] = int(total)  # type: ignore[index]


def encoded_bucket_bytes(change: BucketChange, item: int) -> tuple[str, int]:
    """The smallest encoding of one bucket's changes and its payload bytes (`item`: bytes per value)."""
    sizes = _sizes(change, item)
    encoding = min(sizes, key=lambda k: (sizes[k], k))
    return encoding, sizes[encoding]


def encoded_bytes(delta: VersionDelta, plan: BucketPlan) -> int:
    """What `encode(delta, plan)` carries: the payload of every bucket in its smallest encoding (header aside)."""
    _fill_sizes(list(delta.changes.values()), plan.torch_dtype.itemsize)
    return sum(encoded_bucket_bytes(c, plan.torch_dtype.itemsize)[1] for c in delta.changes.values())


def _pack(local: torch.Tensor, numel: int) -> np.ndarray:
    """Indices as a bitmap of `numel` bits, little-endian within each byte (bit i of byte j is element 8j + i)."""
    mask = np.zeros(numel, dtype=bool)
    mask[local.cpu().numpy()] = True
    return np.packbits(mask, bitorder="little")


def _unpack(packed: np.ndarray, numel: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(packed, count=numel, bitorder="little"))


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def encode(delta: VersionDelta, plan: BucketPlan) -> bytes:
    """The changes as bytes: an 8-byte header length, a JSON header (per bucket: [encoding, changes, bytes of
    the indices / bitmap / varint gaps, bytes of the values / varint steps, elements of the rank's part, its
    shards' checksum]), then per bucket its indices (or bitmap, or varint gaps) inside the rank's part and its
    values (or, with varint gaps, the varint steps of their bit patterns). Each bucket uses the smallest
    encoding."""
    item = plan.torch_dtype.itemsize
    parts: list[bytes] = []
    header: dict = {"version": delta.version, "base": delta.base, "dtype": plan.dtype, "buckets": {}}
    for index, c in sorted(delta.changes.items()):
        encoding, _ = encoded_bucket_bytes(c, item)
        if encoding == "varint":
            if "_varints" not in c._sizes:  # type: ignore[operator]  # a device change: remade on the host
                c._sizes["_varints"] = (_gaps(c.local, c.part.numel), None, _zigzag(c.steps), None)  # type: ignore
            gaps, gap_n, steps, step_n = c._sizes["_varints"]  # type: ignore[index]
            where, values = _varint(gaps, gap_n).numpy().tobytes(), _varint(steps, step_n).numpy().tobytes()
        elif encoding == "index":
            where, values = _as_bytes(c.local.to(_position_dtype(c.part.numel))), _as_bytes(c.values)
        else:
            where, values = _pack(c.local, c.part.numel).tobytes(), _as_bytes(c.values)
        header["buckets"][str(index)] = [encoding, c.count, len(where), len(values), c.part.numel, c.part.key]
        parts += [where, values]
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(parts)


OldValues = Callable[[int, torch.Tensor], torch.Tensor]
"""(bucket index, element positions in the bucket) -> the base version's values there: what varint steps add to."""


def decode(blob: bytes | memoryview, plan: BucketPlan, parts: dict[int, RankBucket],
           old_values: OldValues | None = None) -> VersionDelta:
    """`encode`'s inverse, for the rank whose parts of the buckets are `parts` (bucket index -> `RankBucket`);
    `old_values` reads the base version's values (needed for a bucket in varint steps). Refuses a blob of another
    dtype, or one for a part of a bucket this rank does not hold (other shards, other sizes)."""
    size = int.from_bytes(bytes(blob[:8]), "little")
    header = json.loads(bytes(blob[8 : 8 + size]))
    if header["dtype"] != plan.dtype:
        raise ValueError(f"delta of version {header['version']} is in {header['dtype']}, the plan in {plan.dtype}")
    dtype = plan.torch_dtype
    data = np.frombuffer(blob, dtype=np.uint8, offset=8 + size)
    at = 0
    out = VersionDelta(int(header["version"]), header["base"])
    for index, (encoding, count, where_bytes, value_bytes, numel, key) in header["buckets"].items():
        part = parts.get(int(index))
        if part is None or (part.numel, part.key) != (numel, key):
            raise ValueError(f"delta of version {out.version} carries a {numel}-element part of bucket {index} "
                             f"(shards {key}); this rank's is "
                             f"{'none' if part is None else f'{part.numel} elements (shards {part.key})'}")
        where, values = data[at : at + where_bytes], data[at + where_bytes : at + where_bytes + value_bytes]
        at += where_bytes + value_bytes
        steps = None
        if encoding == "varint":
            if old_values is None:
                raise ValueError(f"delta of version {out.version}: bucket {index} carries steps from version "
                                 f"{out.base}, and no values of that version were given")
            local_np = np.cumsum(_unvarint_np(where, count), dtype=np.int64)
            local_np -= 1
            local = torch.from_numpy(local_np)
            zig = _unvarint_np(values, count)
            if zig.dtype == np.uint8:  # every step in one byte
                steps = torch.from_numpy(_UNZIGZAG_BYTE[zig])
            else:  # a step of a 2-byte pattern fits int32: half the bytes of what follows
                steps = _unzigzag(torch.from_numpy(zig.astype(np.int32) if dtype.itemsize <= 2 else zig))
        elif encoding == "index":
            local = torch.from_numpy(where.copy()).view(_position_dtype(numel)).long()  # a copy: aligned storage
        elif encoding == "bitmap":
            local = torch.from_numpy(_unpack(where, numel))
        else:
            raise ValueError(f"delta of version {out.version}: bucket {index} in encoding {encoding!r}, expected one "
                             f"of {ENCODINGS}")
        if local.numel() != count or (count and not (0 <= int(local[0]) and int(local[-1]) < numel)):
            raise ValueError(f"delta of version {out.version}: bucket {index} carries {local.numel()} indices in "
                             f"[0, {numel}) for {count} changes")
        change = BucketChange(part, local, torch.empty(0, dtype=dtype), steps)
        if steps is not None:
            change.values = _stepped(old_values(int(index), change.positions()), steps)  # type: ignore[misc]
        else:
            change.values = torch.from_numpy(values.copy()).view(dtype)
        if change.values.numel() != count:
            raise ValueError(f"delta of version {out.version}: bucket {index} carries {change.values.numel()} values "
                             f"for {count} changes")
        out.changes[int(index)] = change
    return out


def _stepped(old: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`old` with each bit pattern moved by its step, wrapping within the element's width: the sum in a wider
    integer, narrowed (a narrowing cast keeps the low bits, i.e. takes the sum modulo 2**width)."""
    base = bits(old.contiguous()).cpu().numpy()
    moved = np.add(base, steps.cpu().numpy(), out=np.empty_like(base), casting="unsafe")  # summed wide, narrowed
    return torch.from_numpy(moved).view(old.dtype)


def apply_bucket(flat: torch.Tensor, change: BucketChange | None) -> int:
    """Write one bucket's changes into its flat buffer (`flat_bucket`, holding the previous version): one indexed
    write. Returns the elements written."""
    if change is None or change.count == 0:
        return 0
    # index_copy_ rather than `flat[positions] = values` (index_put_): the same result for unique positions, a
    # little less time on CPU (1.1M positions in a 37.7M-element bucket: 4.7 vs 5.0 ms, one thread).
    flat.index_copy_(0, change.positions().to(flat.device), change.values.to(flat.device))
    return change.count


def _changes(part: RankBucket, local: torch.Tensor, new: torch.Tensor, old: torch.Tensor,
             torch_ops: bool = False) -> BucketChange:
    """The changed elements `local` of a part: new values and their bit patterns' steps from `old` (int32 for
    2-byte dtypes: no overflow, half the bytes): numpy's gathers and subtraction on CPU; with `torch_ops` torch's
    on the tensors' device, kept there."""
    if not torch_ops:
        at, new_bits = local.numpy(), bits(new).numpy()
        values = new_bits[at]
        steps = np.subtract(values, bits(old).numpy()[at], dtype=np.int32 if new.element_size() <= 2 else np.int64)
        return BucketChange(part, local, torch.from_numpy(values).view(new.dtype), torch.from_numpy(steps))
    values = new[local]  # a copy: the scratch buffer is reused for the next bucket
    wide = torch.int32 if values.element_size() <= 2 else torch.int64
    steps = bits(values).to(wide) - bits(old)[local].to(wide)
    return BucketChange(part, local, values, steps, torch_ops=True)


class DeltaTracker:
    """One rank's last published engine-dtype values of its shards, and the changes of each new version.

    `shards`: per bucket index, (HF name, the rank's source tensor, a view of a contiguous meta tensor of the full
    HF shape showing where that source lands in it). Holds one engine-dtype copy of the rank's shards (2 bytes
    per parameter for bf16), one flat tensor per bucket; a diff casts one bucket's shards at a time beside it.

    `torch_ops`: find, size and keep the changes with torch ops on the sources' device (the device path; always
    for sources off the CPU, e.g. a GPU rank's), not numpy's on the host; True on CPU runs the device path there
    (tests compare it with the numpy path, benches time it)."""

    def __init__(self, plan: BucketPlan, shards: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]],
                 torch_ops: bool = False) -> None:
        self.dtype = plan.torch_dtype
        self.shards = {i: s for i, s in shards.items() if s}
        item = self.dtype.itemsize
        self.parts = {i: RankBucket.of(plan.buckets[i], [(n, (p.shape, p.stride(), p.storage_offset()))
                                                         for n, _, p in s], item)
                      for i, s in self.shards.items()}
        """Each bucket's part of this rank (where its shards lie in the bucket)."""
        device = next((src.device for s in self.shards.values() for _, src, _ in s), torch.device("cpu"))
        self.torch_ops = bool(torch_ops) or device.type != "cpu"
        self._scratch = torch.empty(max((p.numel for p in self.parts.values()), default=0), dtype=self.dtype,
                                    device=device)
        """One bucket's part cast to the engine's dtype, on the sources' device (the kept copy lives there too)."""
        self._mask = torch.empty(min(_compare_chunk(device), self._scratch.numel()), dtype=torch.bool, device=device)
        self._casts = {i: ([self._scratch[a : a + n].view(src.shape) for (_, src, _), a, n
                            in zip(s, part.starts.tolist(), part.numels)], [src for _, src, _ in s])
                       for i, (s, part) in ((i, (s, self.parts[i])) for i, s in self.shards.items())}
        """Per bucket: each shard's place in the scratch buffer, and its source (built once: the optimizer
        updates the sources in place)."""
        self.last: dict[int, torch.Tensor] | None = None
        """The engine-dtype values of the last version, per bucket (the part's shards one after another); None
        before the first version."""
        self.last_version: int | None = None
        self._diffed: VersionDelta | None = None

    def _cast(self, index: int) -> torch.Tensor:
        """This bucket's shards rounded to the engine's dtype, one after another (in the scratch buffer)."""
        dsts, srcs = self._casts[index]
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)  # rounds as .to(dtype)
        return self._scratch[: self.parts[index].numel]

    def _changed(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """Ascending indices where the integer views `new` and `old` differ: compared a chunk at a time into one
        reused mask (a fresh mask of a 256 MB bucket's part cost more in page faults than the comparison)."""
        out = []
        chunk = _compare_chunk(new.device)
        for start in range(0, new.numel(), chunk):
            end = min(new.numel(), start + chunk)
            mask = self._mask[: end - start]
            if self.torch_ops:  # the device's own kernels (a `nonzero` reads one count to the host)
                torch.ne(new[start:end], old[start:end], out=mask)
            else:
                _not_equal(new[start:end], old[start:end], mask)
            found = _flatnonzero(mask, self.torch_ops)
            out.append(found + start if start else found)
        return (torch.cat(out) if len(out) > 1 else
                (out[0] if out else torch.zeros(0, dtype=torch.int64, device=self._scratch.device)))

    def diff(self, version: int) -> VersionDelta:
        """The changes of the current weights against the last version (call `commit` once they are published).
        Before any version, every element is a change."""
        out = VersionDelta(version, self.last_version if self.last is not None else None)
        for index, part in self.parts.items():
            new = self._cast(index)
            if self.last is None:  # every element; on the device path the values stay on the device
                where = new.device if self.torch_ops else torch.device("cpu")
                out.changes[index] = BucketChange(part, torch.arange(part.numel, device=where), new.to(where, copy=True),
                                                  torch_ops=self.torch_ops)
                continue
            old = self.last[index]
            local = self._changed(bits(new), bits(old))
            if local.numel():  # numpy path: on the host (the shard relay, the encodings); device path: on the device
                out.changes[index] = _changes(part, local, new, old, self.torch_ops)
        self._diffed = out
        return out

    def commit(self) -> None:
        """The version `diff` looked at was published: its values are the base of the next diff (the kept copy
        takes the changed values in place: unchanged elements are equal bit for bit already)."""
        delta = self._diffed
        assert delta is not None, "commit() without diff()"
        if self.last is None:
            self.last = {i: c.values.to(self._scratch.device, copy=True) for i, c in delta.changes.items()}
        else:
            for i, c in delta.changes.items():
                last = self.last[i]
                last.index_copy_(0, c.local.to(last.device), c.values.to(last.device))  # see apply_bucket
        self.last_version, self._diffed = delta.version, None

    def forget(self) -> None:
        """The last publish failed part-way: the next version is compared with nothing (sent whole)."""
        self.last, self.last_version, self._diffed = None, None, None


class DeltaHistory:
    """The recent versions' changes (or None: a version sent whole), to bring an older buffer forward."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.deltas: dict[int, VersionDelta | None] = {}

    def record(self, version: int, delta: VersionDelta | None) -> None:
        self.deltas[version] = delta
        for v in sorted(self.deltas)[: max(0, len(self.deltas) - self.keep)]:
            del self.deltas[v]

    def chain(self, base: int | None, version: int) -> list[VersionDelta] | None:
        """The changes that bring a buffer holding `base` to `version`, oldest first (each delta's own `base`
        links it to the one before); None when a link is unknown or was sent whole (write the buffer whole)."""
        if base is None or base >= version:
            return None
        out: list[VersionDelta] = []
        at: int | None = version
        while at != base:
            d = self.deltas.get(at) if at is not None else None
            if d is None or d.base is None or d.base < base:
                return None
            out.append(d)
            at = d.base
        return out[::-1]
