"""Which HF tensor goes into which bucket, at which byte offset: the contract both sides of a sync share.

The plan is a pure function of the model spec, the dtype and the bucket
size, so every learner rank computes the same plan without talking to the
others, and the engine can check a sync against the model it serves before
applying any of it. Buckets hold whole decoder layers (vLLM reloads whole
modules); a bucket closes once it reaches `max_bucket_bytes`, so a single
layer larger than the bound gets a bucket of its own.

With LoRA (`lora.rank > 0`) a plan also says which adapters it carries
(`BucketPlan.lora`): a *base* version holds every HF tensor of the frozen base
plus the adapters (A and B of every adapted HF module, whole, PEFT's names:
`base_model.model.<HF module>.lora_{A,B}.weight`), an *adapter* version the
adapters only. Router weights are never adapters (the router is frozen).

A version travels in the engines' dtype (`dtypes.version_dtype`: `rollout.dtype`, float32 with LoRA): the learner
casts its shards while writing them into the buckets, and an engine refuses a version in any other dtype
(`check_plan`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moe_grpo.models.peft_names import adapter_sites, peft_key, peft_shapes
from moe_grpo.models.hf_names import hf_shapes, layer_groups, param_mappings
from moe_grpo.models.spec import MoEModelSpec
from moe_grpo.sync.dtypes import version_dtype

if TYPE_CHECKING:
    from moe_grpo.learner.lora_config import LoraConfig

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
class LoraPlan:
    """The adapters a version carries: what the engine checks against its own `lora` before applying any of it."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base: bool
    """True: the version also carries every base tensor (the first publish of a learner); False: adapters only."""

    @property
    def scale(self) -> float:
        """alpha / rank: what B @ A is multiplied by."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "base": self.base}

    @staticmethod
    def from_dict(raw: dict[str, Any] | None) -> "LoraPlan | None":
        if raw is None:
            return None
        return LoraPlan(int(raw["rank"]), float(raw["alpha"]), tuple(raw["targets"]), bool(raw["base"]))


@dataclass(frozen=True)
class BucketPlan:
    model: str
    """The spec's name; an engine serving another model refuses the sync."""
    dtype: str
    """Element type of every tensor ('float32', 'bfloat16', 'float16')."""
    buckets: tuple[Bucket, ...]
    lora: LoraPlan | None = None
    """The adapters this version carries (None: a full-weight version without adapters)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def total_bytes(self) -> int:
        """Bytes of the version's buffers: its tensors plus the padding that starts each on an `ALIGN` boundary."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the version's tensors alone: what the learner ranks write of a full version together (the
        padding is never written), so what `sync/bytes` adds up to for one."""
        item = self.torch_dtype.itemsize
        return sum(e.numel * item for b in self.buckets for e in b.entries)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {e.name: e.shape for b in self.buckets for e in b.entries}

    def bucket_of(self) -> dict[str, int]:
        return {e.name: b.index for b in self.buckets for e in b.entries}

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "dtype": self.dtype,
                           "buckets": [[[e.name, list(e.shape), e.offset] for e in b.entries] + [b.nbytes]
                                       for b in self.buckets],
                           "lora": self.lora.to_dict() if self.lora is not None else None})

    @staticmethod
    def from_json(text: str) -> "BucketPlan":
        raw: dict[str, Any] = json.loads(text)
        buckets = tuple(Bucket(i, tuple(BucketEntry(n, tuple(s), o) for n, s, o in b[:-1]), int(b[-1]))
                        for i, b in enumerate(raw["buckets"]))
        return BucketPlan(raw["model"], raw["dtype"], buckets, LoraPlan.from_dict(raw.get("lora")))


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"sync dtype {name!r} is not supported, expected one of {sorted(DTYPES)}")
    return name


def _bucketed(groups: list[list[tuple[str, tuple[int, ...]]]], item: int, max_bucket_bytes: int,
              first: int = 0) -> list[Bucket]:
    """Buckets of whole groups (decoder layers), each closed once it reaches `max_bucket_bytes`."""
    buckets: list[Bucket] = []
    entries: list[BucketEntry] = []
    size = 0
    for group in groups:
        for name, shape in group:
            entries.append(BucketEntry(name, shape, size))
            size = _align(size + entries[-1].numel * item)
        if size >= max_bucket_bytes:
            buckets.append(Bucket(first + len(buckets), tuple(entries), size))
            entries, size = [], 0
    if entries:
        buckets.append(Bucket(first + len(buckets), tuple(entries), size))
    return buckets


def adapter_groups(spec: MoEModelSpec, lora: LoraConfig) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The adapter tensors (PEFT names, full shapes) grouped by decoder layer, in model order."""
    shapes = peft_shapes(spec, lora)
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for site, mapping in adapter_sites(spec, lora).items():
        layer = ".".join(site.split(".")[:3])  # decoder.layers.<i>
        for hf in mapping.hf:
            for factor in ("A", "B"):
                key = peft_key(hf, factor)
                groups.setdefault(layer, []).append((key, shapes[key]))
    return list(groups.values())


def plan_buckets(spec: MoEModelSpec, dtype: torch.dtype | str, max_bucket_bytes: int = 512 << 20, *,
                 lora: LoraConfig | None = None, base: bool = True) -> BucketPlan:
    """Buckets of whole decoder layers, in Megatron module order, each closed at `max_bucket_bytes`.

    `lora` (a LoraConfig with rank > 0): the adapters follow in buckets of their own; `base=False` leaves the
    base tensors out (an adapter-only version)."""
    name = _dtype_name(dtype)
    if max_bucket_bytes <= 0:
        raise ValueError(f"max_bucket_bytes={max_bucket_bytes}, expected a positive number of bytes")
    if not base and (lora is None or not lora.enabled):
        raise ValueError("plan_buckets(base=False) without adapters (lora.rank > 0) would publish nothing")
    item = torch.empty(0, dtype=DTYPES[name]).element_size()
    buckets: list[Bucket] = []
    if base:
        shapes = hf_shapes(spec)
        groups = [[(hf, shapes[hf]) for m in group for hf in m.hf] for group in layer_groups(param_mappings(spec))]
        buckets = _bucketed(groups, item, max_bucket_bytes)
    lora_plan = None
    if lora is not None and lora.enabled:
        buckets += _bucketed(adapter_groups(spec, lora), item, max_bucket_bytes, first=len(buckets))
        lora_plan = LoraPlan(int(lora.rank), float(lora.alpha), tuple(lora.targets), base)
    return BucketPlan(spec.name, name, tuple(buckets), lora_plan)


def check_plan(plan: BucketPlan, spec: MoEModelSpec, lora: LoraConfig | None = None,
               engine_dtype: str | None = None) -> None:
    """Raise ValueError naming the first thing where `plan` and the engine's model `spec` (its `lora`, a
    LoraConfig or None, and its `engine_dtype`, the dtype it serves; None: not checked) disagree: model name,
    dtype (`version_dtype`), adapter rank / alpha / targets, tensor names and shapes."""
    if plan.model != spec.name:
        raise ValueError(f"sync is for model {plan.model!r}, the engine serves {spec.name!r}")
    if engine_dtype is not None and plan.dtype != (want := version_dtype(engine_dtype, lora)):
        raise ValueError(f"the version is in {plan.dtype}, the engine serves {engine_dtype} and takes versions in "
                         f"{want}" + (" (LoRA versions travel in float32)" if want != engine_dtype else ""))
    serving = lora is not None and lora.enabled
    if plan.lora is not None and not serving:
        raise ValueError(f"the version carries LoRA adapters (rank {plan.lora.rank}), the engine was started "
                         "without lora.rank > 0")
    if plan.lora is None and serving:
        raise ValueError(f"the version carries no adapters, the engine expects lora.rank={lora.rank} adapters")
    expected: dict[str, tuple[int, ...]] = {}
    if plan.lora is not None:
        for field, want in (("rank", lora.rank), ("alpha", float(lora.alpha)), ("targets", tuple(lora.targets))):
            if getattr(plan.lora, field) != want:
                raise ValueError(f"the version's adapters have {field}={getattr(plan.lora, field)!r}, the engine "
                                 f"expects lora.{field}={want!r}")
        expected.update(peft_shapes(spec, lora))
    if plan.lora is None or plan.lora.base:
        expected.update(hf_shapes(spec))
    got = plan.shapes()
    unknown = sorted(set(got) - set(expected))
    if unknown:
        raise ValueError(f"tensor(s) {unknown[:5]} are not parameters of {spec.name}"
                         + (" or its adapters" if plan.lora is not None else ""))
    missing = sorted(set(expected) - set(got))
    if missing:
        raise ValueError(f"tensor(s) {missing[:5]} missing ({len(missing)} in all)")
    for name, shape in got.items():
        if shape != expected[name]:
            raise ValueError(f"{name} has shape {list(shape)}, expected {list(expected[name])}")
