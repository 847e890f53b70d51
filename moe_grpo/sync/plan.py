"""Which HF tensor goes into which bucket, at which byte offset: the contract both sides of a sync share.

The plan is a pure function of the model spec, the dtype and the bucket
size, so every learner rank computes the same plan without talking to the
others, and the engine can check a sync against the model it serves before
applying any of it. Buckets hold whole decoder layers (vLLM reloads whole
modules); a bucket closes once it reaches `max_bucket_bytes`, so a single
layer larger than the bound gets a bucket of its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from moe_grpo.models.hf_names import hf_shapes, layer_groups, param_mappings
from moe_grpo.models.spec import MoEModelSpec

ALIGN = 64
"""Every tensor starts on a 64-byte boundary (a cache line): copies into the bucket run at full speed."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor inside its bucket."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Bucket:
    index: int
    entries: tuple[BucketEntry, ...]
    nbytes: int


@dataclass(frozen=True)
class BucketPlan:
    model: str
    """The spec's name; an engine serving another model refuses the sync."""
    dtype: str
    """Element type of every tensor ('float32', 'bfloat16', 'float16')."""
    buckets: tuple[Bucket, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {e.name: e.shape for b in self.buckets for e in b.entries}

    def bucket_of(self) -> dict[str, int]:
        return {e.name: b.index for b in self.buckets for e in b.entries}

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "dtype": self.dtype,
                           "buckets": [[[e.name, list(e.shape), e.offset] for e in b.entries] + [b.nbytes]
                                       for b in self.buckets]})

    @staticmethod
    def from_json(text: str) -> "BucketPlan":
        raw: dict[str, Any] = json.loads(text)
        buckets = tuple(Bucket(i, tuple(BucketEntry(n, tuple(s), o) for n, s, o in b[:-1]), int(b[-1]))
                        for i, b in enumerate(raw["buckets"]))
        return BucketPlan(raw["model"], raw["dtype"], buckets)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(spec: MoEModelSpec, dtype: torch.dtype | str, max_bucket_bytes: int = 512 << 20) -> BucketPlan:
    """Buckets of whole decoder layers, in Megatron module order, each closed at `max_bucket_bytes`."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"sync dtype {name!r} is not supported, expected one of {sorted(DTYPES)}")
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes={max_bucket_bytes}, expected a positive number of bytes")
    item = torch.empty(0, dtype=DTYPES[name]).element_size()
    shapes = hf_shapes(spec)
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    size = 0
    for group in layer_groups(param_mappings(spec)):
        for m in group:
            for hf in m.hf:
                entries.append(BucketEntry(hf, shapes[hf], size))
                size = _align(size + entries[-1].numel * item)
        if size >= max_bucket_bytes:
            buckets.append(Bucket(len(buckets), tuple(entries), size))
            entries, size = [], 0
    if entries:
        buckets.append(Bucket(len(buckets), tuple(entries), size))
    return BucketPlan(spec.name, name, tuple(buckets))


def check_plan(plan: BucketPlan, spec: MoEModelSpec) -> None:
    """Raise ValueError naming the first tensor where `plan` and the model `spec` disagree."""
    if plan.model != spec.name:
        raise ValueError(f"sync is for model {plan.model!r}, the engine serves {spec.name!r}")
    expected, got = hf_shapes(spec), plan.shapes()
    unknown = sorted(set(got) - set(expected))
    if unknown:
        raise ValueError(f"tensor(s) {unknown[:5]} are not parameters of {spec.name}")
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"tensor(s) {missing[:5]} missing ({len(missing)} in all)")
    for name, shape in got.items():
        if shape != expected[name]:
            raise ValueError(f"{name} has shape {list(shape)}, expected {list(expected[name])}")
