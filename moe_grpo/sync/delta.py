"""Delta versions: what changed in the engine's dtype since the previous version, found, encoded and applied exactly.

A learner rank keeps the engine-dtype values it published last for each of its
shards (`DeltaTracker`: one copy of its own shards in the engine's dtype, e.g.
2 bytes per parameter for bf16, beside its float32 master weights). For a new
version it rounds its shards to the engine's dtype, compares them bit for bit
with that copy and keeps, per HF tensor, the flat positions (inside the full HF
tensor) and new values of the elements that changed (`EntryChange`). Bitwise,
not numerically: -0.0 vs 0.0 and NaN payloads count as changes, so applying
the changes gives exactly the bits a full version would carry.

A tensor with no changed element costs nothing: not an entry, not a bit. A
routed expert is a handful of such tensors (`experts_unchanged` counts the
experts none of whose tensors changed). On the wire (the relay, `encode` /
`decode`) each bucket's changes take the smallest of three encodings:

- "index": per changed shard, int32 indices inside the shard (int64 for a
  shard of 2**31 elements or more) and the values;
- "bitmap": per changed shard, one bit per element of the shard and the
  values in index order;
- "varint": per changed shard, the gaps between changed indices and the steps
  of the values' bit patterns (new - old), each as a LEB128 varint. A small
  optimizer step moves a changed bf16 value by a few units in its last place,
  so a change costs about 2 bytes, the same as its value: the wire carries about
  the changed fraction of a full version (at 3% changed: 9% with the index or
  bitmap encodings). The receiver adds the steps to the base version it holds.

Indices are the shard's own (its elements in row-major order): the receiver
knows where each of a rank's shards lies in the full tensor (`Placement`,
sent once when a relay group meets), so a tensor split over TP ranks costs
each rank a bitmap of its own slab only.

Applying (`apply_changes`) writes the values at their positions into the
full-tensor views of a bucket that holds the previous version; a host buffer
holding an older version is brought forward by applying each newer version's
changes in order (`DeltaHistory.chain`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from moe_grpo.sync.plan import BucketPlan

ENCODINGS = ("index", "bitmap")

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Integer dtype of each element size: changed elements are found by comparing bits, not values."""



@dataclass(frozen=True)
class EntryChange:
    """The changed elements of one rank's shard of a full HF tensor (the whole tensor for an unsplit one)."""

    name: str
    positions: torch.Tensor
    """int64 flat positions inside the full HF tensor, in the shard's element order."""
    values: torch.Tensor
    """The new values, in the engine's dtype, one per position."""
    local: torch.Tensor
    """int64 flat indices of the changed elements inside the shard, ascending (what travels)."""
    shard_numel: int
    """Elements of the shard (a bitmap's length)."""
    steps: torch.Tensor | None = None
    """int64 differences of the new values' bit patterns from the old ones (None: no old values, a first
    version): a small weight update moves a bf16 value by a few units in its last place, which a varint carries
    in one byte."""

    @property
    def count(self) -> int:
        return int(self.positions.numel())


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


@dataclass
class VersionDelta:
    """One rank's changes of one version against the version before it, by bucket index."""

    version: int
    base: int | None
    """The version these changes are against (None: against nothing, every element is a change)."""
    changes: dict[int, list[EntryChange]] = field(default_factory=dict)

    def names(self) -> set[str]:
        return {c.name for cs in self.changes.values() for c in cs}

    def changed_elements(self) -> int:
        return sum(c.count for cs in self.changes.values() for c in cs)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element size (bitwise comparison; no copy)."""
    return t.view(_INT_VIEW[t.element_size()])


def _position_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _varint_sizes(x: np.ndarray) -> np.ndarray:
    """Bytes of each unsigned value as a LEB128 varint (7 bits a byte)."""
    n = np.ones(x.shape, dtype=np.int64)
    rest = x >> np.uint64(7)
    while rest.any():
        n += rest > 0
        rest >>= np.uint64(7)
    return n


def _varint(x: np.ndarray) -> np.ndarray:
    """Unsigned values as LEB128 varints, one after another (vectorised: one pass per byte of the longest)."""
    x = x.astype(np.uint64)
    n = _varint_sizes(x)
    out = np.empty(int(n.sum()), dtype=np.uint8)
    starts = np.cumsum(n) - n
    for k in range(int(n.max(initial=0))):
        sel = n > k
        byte = (x[sel] >> np.uint64(7 * k)) & np.uint64(127)
        out[starts[sel] + k] = (byte | (np.uint64(128) * (n[sel] > k + 1))).astype(np.uint8)
    return out


def _unvarint(buf: np.ndarray, count: int) -> tuple[np.ndarray, int]:
    """The first `count` LEB128 varints of `buf`, and the bytes they took."""
    if count == 0:
        return np.zeros(0, dtype=np.uint64), 0
    ends = np.flatnonzero(buf < 128)[:count]
    if len(ends) < count:
        raise ValueError(f"a varint section holds {len(ends)} values, expected {count}")
    starts = np.concatenate([[0], ends[:-1] + 1])
    lens = ends - starts + 1
    out = np.zeros(count, dtype=np.uint64)
    for k in range(int(lens.max())):
        sel = lens > k
        out[sel] |= (buf[starts[sel] + k].astype(np.uint64) & np.uint64(127)) << np.uint64(7 * k)
    return out, int(ends[-1]) + 1


def _zigzag(v: torch.Tensor) -> np.ndarray:
    x = v.cpu().numpy().astype(np.int64)
    return ((x << 1) ^ (x >> 63)).astype(np.uint64)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    return ((u >> np.uint64(1)).astype(np.int64)) ^ -((u & np.uint64(1)).astype(np.int64))


def _gaps(local: torch.Tensor) -> np.ndarray:
    """Ascending indices as their gaps (the first from -1), all >= 1."""
    x = local.cpu().numpy().astype(np.int64)
    return np.diff(x, prepend=-1).astype(np.uint64)


def encoded_bucket_bytes(changes: Sequence[EntryChange], item: int) -> tuple[str, int]:
    """The smallest encoding of one bucket's changes and its payload bytes (`item`: bytes per value)."""
    sizes = {"index": sum(c.count * (_position_dtype(c.shard_numel).itemsize + item) for c in changes),
             "bitmap": sum(math.ceil(c.shard_numel / 8) + c.count * item for c in changes)}
    if all(c.steps is not None for c in changes):
        sizes["varint"] = sum(int(_varint_sizes(_gaps(c.local)).sum() + _varint_sizes(_zigzag(c.steps)).sum())
                              for c in changes)
    encoding = min(sizes, key=lambda k: (sizes[k], k))
    return encoding, sizes[encoding]


def encoded_bytes(delta: VersionDelta, plan: BucketPlan) -> int:
    """What `encode(delta, plan)` carries: the payload of every bucket in its smallest encoding (header aside)."""
    return sum(encoded_bucket_bytes(cs, plan.torch_dtype.itemsize)[1] for cs in delta.changes.values())


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bits, little-endian within each byte (bit i of byte j is element 8j + i)."""
    pad = (-mask.numel()) % 8
    m = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].bool()


def encode(delta: VersionDelta, plan: BucketPlan) -> bytes:
    """The changes as bytes: an 8-byte header length, a JSON header, then per changed shard its indices (or
    bitmap, or varint gaps) inside the shard and its values (or, with varint gaps, the varint steps of their bit
    patterns). Each bucket uses the smallest encoding."""
    item = plan.torch_dtype.itemsize
    parts: list[bytes] = []
    header: dict = {"version": delta.version, "base": delta.base, "dtype": plan.dtype, "buckets": {}}
    for index, changes in sorted(delta.changes.items()):
        encoding, _ = encoded_bucket_bytes(changes, item)
        rows = []
        for c in changes:
            if encoding == "varint":
                assert c.steps is not None
                gaps, steps = _varint(_gaps(c.local)), _varint(_zigzag(c.steps))
                rows.append([c.name, c.count, len(gaps), "varint", c.shard_numel, len(steps)])
                parts += [gaps.tobytes(), steps.tobytes()]
                continue
            if encoding == "index":
                where = c.local.to(_position_dtype(c.shard_numel)).cpu().contiguous()
            else:
                mask = torch.zeros(c.shard_numel, dtype=torch.bool)
                mask[c.local.cpu()] = True
                where = _pack(mask)
            values = c.values.cpu().contiguous()
            rows.append([c.name, c.count, where.numel() * where.element_size(), str(where.dtype)[6:], c.shard_numel,
                         c.count * item])
            parts += [where.view(torch.uint8).numpy().tobytes(), values.view(torch.uint8).numpy().tobytes()]
        header["buckets"][str(index)] = [encoding, rows]
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(parts)


OldValues = Callable[[str, torch.Tensor], torch.Tensor]
"""(HF name, flat indices inside this rank's shard) -> the base version's values there: what varint steps add to."""


def decode(blob: bytes | memoryview, plan: BucketPlan, placements: dict[str, Placement],
           old_values: OldValues | None = None) -> VersionDelta:
    """`encode`'s inverse, for the rank whose shards lie at `placements` (HF name -> `Placement`); `old_values`
    reads the base version's values (needed for a bucket in varint steps). Refuses a blob of another dtype, or
    one naming a tensor this rank holds no shard of or a shard of another size."""
    size = int.from_bytes(bytes(blob[:8]), "little")
    header = json.loads(bytes(blob[8 : 8 + size]))
    if header["dtype"] != plan.dtype:
        raise ValueError(f"delta of version {header['version']} is in {header['dtype']}, the plan in {plan.dtype}")
    dtype = plan.torch_dtype
    data = np.frombuffer(bytes(blob[8 + size :]), dtype=np.uint8)
    at = 0
    out = VersionDelta(int(header["version"]), header["base"])
    for index, (encoding, rows) in header["buckets"].items():
        changes = []
        for name, count, where_bytes, where_dtype, shard_numel, value_bytes in rows:
            placement = placements.get(name)
            if placement is None or math.prod(placement[0]) != shard_numel:
                raise ValueError(f"delta of version {out.version} names a {shard_numel}-element shard of {name!r}; "
                                 f"this rank's is {None if placement is None else list(placement[0])}")
            where, values = data[at : at + where_bytes], data[at + where_bytes : at + where_bytes + value_bytes]
            at += where_bytes + value_bytes
            if encoding == "varint":
                if old_values is None:
                    raise ValueError(f"delta of version {out.version}: {name} carries steps from version "
                                     f"{out.base}, and no values of that version were given")
                local = torch.from_numpy(np.cumsum(_unvarint(where, count)[0].astype(np.int64)) - 1)
                steps = torch.from_numpy(_unzigzag(_unvarint(values, count)[0]))
                new = _stepped(old_values(name, local), steps)
            else:
                raw = torch.from_numpy(where.copy())  # a copy: views of another dtype need aligned storage
                local = (raw.view(getattr(torch, where_dtype)).long() if encoding == "index"
                         else _unpack(raw, shard_numel).nonzero().view(-1))
                new = torch.from_numpy(values.copy()).view(dtype)
                steps = None
            if local.numel() != count or new.numel() != count:
                raise ValueError(f"delta of version {out.version}: {name} carries {local.numel()} positions "
                                 f"for {count} values")
            changes.append(EntryChange(name, placed_positions(local, placement), new, local, shard_numel, steps))
        out.changes[int(index)] = changes
    return out


def _stepped(old: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """`old` with each bit pattern moved by its step (wrapping within the element's width)."""
    width = old.element_size() * 8
    moved = (bits(old.contiguous()).to(torch.int64) + steps) & ((1 << width) - 1)
    moved = torch.where(moved >= 1 << (width - 1), moved - (1 << width), moved)  # back to the signed view
    return moved.to(_INT_VIEW[old.element_size()]).view(old.dtype)


def apply_changes(views: dict[str, torch.Tensor], changes: Iterable[EntryChange]) -> int:
    """Write each change into its full tensor (`views`: HF name -> contiguous full tensor holding the previous
    version). Returns the elements written."""
    n = 0
    for c in changes:
        flat = views[c.name].view(-1)
        flat[c.positions.to(flat.device)] = c.values.to(flat.device)
        n += c.count
    return n


class DeltaTracker:
    """One rank's last published engine-dtype values of its shards, and the changes of each new version.

    `shards`: per bucket index, (HF name, the rank's source tensor, a view of a contiguous meta tensor of the full
    HF shape showing where that source lands in it). Holds one engine-dtype copy of the rank's shards (2 bytes
    per parameter for bf16); a diff casts one shard at a time beside it."""

    def __init__(self, dtype: torch.dtype, shards: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]]) -> None:
        self.dtype = dtype
        self.shards = shards
        self.last: dict[tuple[int, int], torch.Tensor] | None = None
        """The engine-dtype values of the last version, per (bucket, shard); None before the first version."""
        self.last_version: int | None = None
        self._diffed: int | None = None

    def _cast(self, source: torch.Tensor) -> torch.Tensor:
        return source.detach().to(self.dtype, memory_format=torch.contiguous_format, copy=True)

    def diff(self, version: int) -> VersionDelta:
        """The changes of the current weights against the last version (call `commit` once they are published).
        Before any version, every element is a change."""
        out = VersionDelta(version, self.last_version if self.last is not None else None)
        self._diffed = version
        for index, shards in self.shards.items():
            changes = []
            for i, (name, source, placed) in enumerate(shards):
                new = self._cast(source)
                old = self.last.get((index, i)) if self.last is not None else None
                mask = torch.ones_like(new, dtype=torch.bool) if old is None else bits(new) != bits(old)
                local = mask.view(-1).nonzero().view(-1)
                if local.numel() == 0:
                    continue
                positions = placed_positions(local, (placed.shape, placed.stride(), placed.storage_offset()))
                steps = None if old is None else (bits(new)[mask].to(torch.int64) - bits(old)[mask].to(torch.int64))
                changes.append(EntryChange(name, positions.cpu(), new[mask].cpu(), local.cpu(), new.numel(),
                                           None if steps is None else steps.cpu()))
            if changes:
                out.changes[index] = changes
        return out

    def commit(self) -> None:
        """The version `diff` looked at was published: its values are the base of the next diff. The sources are
        as `diff` saw them (a publish ends before the next optimizer step changes them), so they are cast again
        into the kept copy in place rather than held twice during the sync."""
        assert self._diffed is not None, "commit() without diff()"
        last = self.last if self.last is not None else {}
        for index, shards in self.shards.items():
            for i, (_, source, _) in enumerate(shards):
                if (index, i) in last:
                    last[(index, i)].copy_(source.detach())  # the same rounding as .to(dtype)
                else:
                    last[(index, i)] = self._cast(source)
        self.last, self.last_version, self._diffed = last, self._diffed, None

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
