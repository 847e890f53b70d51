"""Deliver HF-named weight buckets to an engine, versioned and all-or-nothing.

`SharedMemoryTransport` (CPU, and any engine on the same host): buckets are
checked against the names and shapes the engine's model expects *before* any
is applied; then applied in order; if applying fails part-way (engine error),
the engine is rolled back to the previous version's weights, which the
transport kept, so it never keeps serving a mix of two versions. On failure
the sender gets a `SyncError` naming the tensor or the step.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from moe_grpo.models.hf_names import hf_names


class SyncError(RuntimeError):
    """A weight sync was refused or failed; the engine still serves its previous version."""


class SharedMemoryTransport:
    """Pushes buckets into a `VllmEngine` through files on /dev/shm (see `VllmEngine.load_weights`)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.expected = hf_names(engine.spec)
        self.current: dict[str, torch.Tensor] | None = None  # last good full state, for rollback
        self.shapes: dict[str, tuple[int, ...]] | None = None

    def check(self, state: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(state) - self.expected)
        if unknown:
            raise SyncError(f"sync refused: tensor(s) {unknown[:5]} are not parameters of {self.engine.spec.name}")
        missing = sorted(self.expected - set(state))
        if missing:
            raise SyncError(f"sync refused: tensor(s) {missing[:5]} missing ({len(missing)} in all)")
        if self.shapes is not None:
            for name, t in state.items():
                if tuple(t.shape) != self.shapes[name]:
                    raise SyncError(f"sync refused: {name} has shape {list(t.shape)}, expected {list(self.shapes[name])}")

    def push(self, buckets: Iterable[dict[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Apply a whole version or nothing; returns bytes and seconds."""
        import time

        t0 = time.perf_counter()
        state: dict[str, torch.Tensor] = {}
        for b in buckets:
            state.update(b)
        self.check(state)
        try:
            self.engine.load_weights(state, version)
        except Exception as e:
            if self.current is not None:
                self.engine.load_weights(self.current, self.engine.policy_version)
            raise SyncError(f"engine failed while loading version {version}; rolled back to "
                            f"version {self.engine.policy_version}: {e}") from e
        self.current = state
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return {"sync/bytes": float(nbytes), "sync/seconds": time.perf_counter() - t0}

    def adopt(self, state: dict[str, torch.Tensor]) -> None:
        """Record the weights the engine was started with (the rollback target before the first sync)."""
        self.check(state)
        self.current = dict(state)
        self.shapes = {k: tuple(v.shape) for k, v in state.items()}
