"""The rollout buffer between the inference and training pools: bounded, versioned, staleness-checked.

Groups (one prompt's completions, scored) go in as engines finish them and
come out a batch at a time for the learner. `max_staleness` is enforced when
a batch is taken: a group with any token sampled more than `max_staleness`
versions before the weights being trained is dropped and counted (the
driver samples a replacement), so no trained token is ever older than that.
Capacity bounds how far generation may run ahead: the driver submits new
prompts only while `room()` is positive, so producers wait when it is full.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Group:
    """The completions of one prompt, with rewards and advantages."""

    example: Any
    """The prompt's task example (or dataset row)."""
    completions: list[Any]
    """`Completion`s from the engine, each with per-token versions and a routing trace."""
    rewards: np.ndarray
    """One reward per completion (NaN-free: failed rewards are dropped before this point)."""
    advantages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """Group-relative advantage per completion."""
    engine: str = ""
    """Name of the engine that sampled it."""

    @property
    def oldest_version(self) -> int:
        return min(int(c.versions.min()) for c in self.completions if len(c.versions))

    @property
    def newest_version(self) -> int:
        return max(int(c.versions.max()) for c in self.completions if len(c.versions))


class RolloutBuffer:
    """FIFO of scored groups with a capacity and a staleness bound."""

    def __init__(self, capacity: int, max_staleness: int) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity={capacity}, expected >= 1")
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}, expected >= 0")
        self.capacity, self.max_staleness = capacity, max_staleness
        self._groups: deque[Group] = deque()
        self.dropped_stale = 0
        """Groups dropped because a token was older than `max_staleness` allowed."""

    def __len__(self) -> int:
        return len(self._groups)

    def room(self, in_flight: int) -> int:
        """How many more groups may be started, counting those still being generated."""
        return self.capacity - len(self._groups) - in_flight

    def put(self, group: Group) -> None:
        if len(self._groups) >= self.capacity:
            raise OverflowError(f"rollout buffer full ({self.capacity} groups); the driver admitted too much work")
        self._groups.append(group)

    def drop_stale(self, trained_version: int) -> int:
        """Drop groups that can no longer be trained on weights of `trained_version`; returns how many."""
        oldest_allowed = trained_version - self.max_staleness
        keep = deque(g for g in self._groups if g.oldest_version >= oldest_allowed)
        dropped = len(self._groups) - len(keep)
        self._groups = keep
        self.dropped_stale += dropped
        return dropped

    def state_dict(self) -> dict[str, Any]:
        """Every group with its completions (tokens, log-probs, per-token versions, routing traces)."""
        return {"groups": list(self._groups), "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        groups = list(state["groups"])
        if len(groups) > self.capacity:
            raise OverflowError(f"the checkpoint's buffer holds {len(groups)} groups, this run's capacity is "
                                f"{self.capacity} (algo.prompts_per_step x (algo.max_staleness + 1)); resume with the "
                                "checkpoint's algo settings")
        self._groups = deque(groups)
        self.dropped_stale = int(state["dropped_stale"])

    def clear(self) -> int:
        """Drop every group (a rollback: they were sampled by weights that are gone); returns how many."""
        n = len(self._groups)
        self._groups.clear()
        return n

    def take(self, n: int, trained_version: int) -> list[Group] | None:
        """`n` groups (oldest first) fit to train weights of `trained_version`, or None if fewer are ready."""
        self.drop_stale(trained_version)
        if len(self._groups) < n:
            return None
        return [self._groups.popleft() for _ in range(n)]
