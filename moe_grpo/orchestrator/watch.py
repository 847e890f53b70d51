"""An early warning (and, on request, a guard): router disagreement or rollout KL jumping above its running level.

Rollout routing replay exists because, without it, MoE RL runs can collapse: the
learner's routing drifts from the engine's, the train-inference KL grows, and
updates computed on the wrong experts feed the drift. The first visible sign is
a step whose trained batch shows a `train/router_disagreement` or
`train/rollout_kl` far above what the run has shown so far (the learner's
forward vs the rollout on the tokens it trains: measured every step, at once;
the probe's `mismatch/*` comes a step or more later). This watch compares each step's value with a
running level, the 90th percentile of the previous `window` steps (a high
percentile, because in async mode one-version-stale steps regularly show more
mismatch than fresh ones, and those are not news), and names the step when the
value exceeds `factor` times that level and an absolute floor.

A value that jumps is kept out of the running level, so a jump that lasts is
seen at every step it lasts. `in_a_row` counts consecutive steps with a jump; the driver's collapse guard
(`routing.on_jump=rollback`) acts when it reaches `routing.jump_sustain`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

WATCHED = {"train/rollout_kl": 1e-3, "train/router_disagreement": 0.05}
"""Watched keys and their floors: values below the floor never warn (tiny numbers jump by large factors)."""

MIN_HISTORY = 5
"""Steps of history before the watch can warn."""


class JumpWatch:
    """`update(row)` -> warning messages for this step (empty when nothing jumped); `factor=0` turns it off."""

    def __init__(self, factor: float = 5.0, window: int = 20) -> None:
        self.factor = factor
        self.history = {key: deque(maxlen=window) for key in WATCHED}
        self.jumps = 0
        """Warnings issued so far."""
        self.in_a_row = 0
        """Consecutive steps (up to the last one seen) with at least one jump."""

    def update(self, row: dict[str, float]) -> list[str]:
        messages = []
        for key, floor in WATCHED.items():
            value = row.get(key, float("nan"))
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            past = self.history[key]
            jumped = False
            if self.factor > 0 and len(past) >= MIN_HISTORY:
                level = float(np.percentile(np.asarray(past), 90))
                threshold = self.factor * max(level, floor)
                if value > threshold:
                    jumped = True
                    self.jumps += 1
                    messages.append(
                        f"step {int(row.get('step', -1))}: {key} = {value:.3g}, {value / max(level, 1e-12):.1f}x its "
                        f"running level {level:.3g} (90th percentile of the last {len(past)} steps); a jump like this "
                        "is an early sign of the train-inference drift that routing replay (routing.replay=r3) "
                        "is meant to prevent")
            if not jumped:  # a jump is not the new normal: later steps are measured against the level before it
                past.append(float(value))
        self.in_a_row = self.in_a_row + 1 if messages else 0
        return messages

    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: list(v) for k, v in self.history.items()}, "jumps": self.jumps,
                "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, values in state["history"].items():
            if key in self.history:
                self.history[key].clear()
                self.history[key].extend(values)
        self.jumps, self.in_a_row = int(state["jumps"]), int(state["in_a_row"])
