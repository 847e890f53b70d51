"""The run record's `sync/*` keys from every learner rank's report (torch-free: the driver imports it).

Each rank reports its own part of a version (`weight_sync.SyncReport.metrics`);
the driver adds them up here. Routed experts travel as per-layer bitmaps (bit e:
expert e), so a rank's report stays small for a model of hundreds of experts and
an expert split over expert-TP ranks is counted once.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

_EXPERT = re.compile(r"^(.*\.layers\.(\d+)\.mlp\.experts\.(\d+))\.")
"""An HF name of a routed expert's tensor: (expert prefix, layer, expert)."""


def expert_bitmaps(names: Iterable[str]) -> dict[int, int]:
    """Per MoE layer, a bitmap of the routed experts (bit e: expert e) that have a tensor in `names`."""
    out: dict[int, int] = {}
    for n in names:
        m = _EXPERT.match(n)
        if m:
            out[int(m.group(2))] = out.get(int(m.group(2)), 0) | (1 << int(m.group(3)))
    return out


def experts_unchanged(held: Sequence[dict[int, int]], changed: Sequence[dict[int, int]]) -> int:
    """Experts some rank holds (`held`: each rank's `expert_bitmaps` of its tensors) that no rank changed.

    Bitmaps, not names, cross from the ranks: one bit per expert per layer, and an expert split over several
    ranks (expert TP) is counted once."""
    held_all: dict[int, int] = {}
    changed_all: dict[int, int] = {}
    for maps, into in ((held, held_all), (changed, changed_all)):
        for m in maps:
            for layer, bitmap in m.items():
                into[int(layer)] = into.get(int(layer), 0) | int(bitmap)
    return sum(bin(bitmap & ~changed_all.get(layer, 0)).count("1") for layer, bitmap in held_all.items())


def newest_common_version(ranks: Sequence[dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each rank's report of the newest version every rank has finished publishing (`ranks`: per rank, version ->
    its `SyncReport.metrics()`, the few latest), or [] before that. Background publishes end at different times on
    different ranks: adding up each rank's latest would mix versions (a whole one on one rank, an adapter-only one
    on another)."""
    common = set.intersection(*(set(r) for r in ranks)) if ranks else set()
    return [r[max(common)] for r in ranks] if common else []


def combine_sync_metrics(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The run record's `sync/*` keys from every learner rank's `SyncReport.metrics()`: bytes added up (each
    element is sent by one rank), the slowest rank's seconds, the changed fraction over all elements, the experts
    no rank changed, and `sync/delta` 1 when every rank sent changes only. Without `sync.delta` the changed
    fraction and the experts are NaN (nothing compared them)."""
    nan = float("nan")
    out = {"sync/seconds": max((r.get("sync/seconds", 0.0) for r in ranks), default=0.0),
           "sync/bytes": sum(r.get("sync/bytes", 0.0) for r in ranks),
           "sync/full_bytes": sum(r.get("sync/full_bytes", 0.0) for r in ranks),
           "sync/delta": float(bool(ranks) and all(r.get("sync/delta", 0.0) for r in ranks)),
           "sync/changed_fraction": nan, "sync/experts_unchanged": nan}
    compared = [r for r in ranks if "sync/changed" in r]
    if compared and len(compared) == len(ranks):
        elements = sum(r["sync/elements"] for r in compared)
        out["sync/changed_fraction"] = sum(r["sync/changed"] for r in compared) / max(elements, 1.0)
        out["sync/experts_unchanged"] = float(experts_unchanged([r["sync/experts_held"] for r in compared],
                                                                [r["sync/experts_changed"] for r in compared]))
    return out


