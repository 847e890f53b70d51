"""Routing settings of a run (config group `routing`): which routing the learner replays, and the jump warning."""

from __future__ import annotations

import math
from dataclasses import dataclass

from moe_grpo.validate import at_least, between, refuse

REPLAY_MODES = ("r3", "r2", "off")
"""`routing.replay` (verl `router_replay.mode`: R3 / R2)."""


@dataclass(frozen=True)
class RoutingConfig:
    """Routing replay mode, the mismatch probe, and the early warning on router disagreement / rollout KL."""

    replay: str = "r3"
    """Routing in the learner's training forward: 'r3' replays the engine's routing of every token (rollout
    routing replay), 'r2' replays the learner's own routing recorded in a no-grad forward of the batch just before
    (one more forward per step), 'off' lets the routers choose."""
    probe_prompts: int = 4
    """Fixed prompts of the mismatch probe (orchestrator/probe.py): after a publish, each engine samples them once
    it serves the new version and the learner scores them with the weights it published, giving the
    engine-vs-learner gap on the same weights (`mismatch/*`); 0 = no probe. Costs the learner ranks a copy of their
    parameters per probed version (at most two kept) and two no-grad forwards of these few samples."""
    probe_every: int = 1
    """Probe every this many publishes (1: every published version); 0 = no probe."""
    probe_engines: int = 1
    """Engines that sample each probed version, taken round robin over the run's engines (orchestrator/probe.py,
    `engines_for_round`); 0 = every engine. The default 1 costs one engine's probe per version whatever the number
    of engines N, and still checks each engine's copy of the weights every N probed versions: a wrong shard in one
    engine shows up at its next turn, not at the very publish that broke it, and a version whose one chosen engine
    skips it or is restarting goes unprobed (`mismatch/probe_dropped`). 0 checks every sync end to end on every
    engine at N times the engine time (the probe's requests queue behind rollouts: before 2026-11-26 it was the
    only choice)."""
    jump_factor: float = 5.0
    """Warn when a step's train/rollout_kl or train/router_disagreement exceeds this many times its running level
    (the 90th percentile of the previous `jump_window` steps, at least a floor of 1e-3 KL / 0.05 disagreement);
    0 = no warning."""
    jump_window: int = 20
    """Steps the running level is taken over (the warning starts once 5 steps are in)."""
    on_jump: str = "warn"
    """'warn': log the jump and go on; 'rollback': a jump sustained for `jump_sustain` steps in a row restores the
    last run checkpoint, multiplies the learning rate by `rollback_lr_factor` and continues with fresh prompts."""
    jump_sustain: int = 2
    """Steps in a row that must jump before `on_jump=rollback` acts (one noisy step is not a collapse)."""
    rollback_lr_factor: float = 0.5
    """Learning-rate multiplier applied at each rollback."""
    max_rollbacks: int = 3
    """Rollbacks a run may take; a jump after the last one stops the run, saying what was seen."""

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_MODES:
            hint = " (the old replay=true is r3, replay=false is off)" if isinstance(self.replay, bool) else ""
            raise ValueError(f"routing.replay={self.replay!r}, expected one of {list(REPLAY_MODES)}{hint}")
        if not self.jump_factor >= 0 or not math.isfinite(self.jump_factor) or 0 < self.jump_factor <= 1:
            raise refuse("routing.jump_factor", self.jump_factor, "0 (off) or a number > 1")
        if self.on_jump not in ("warn", "rollback"):
            raise ValueError(f"routing.on_jump={self.on_jump!r}, expected 'warn' or 'rollback'")
        at_least("routing.jump_sustain", self.jump_sustain, 1)
        at_least("routing.max_rollbacks", self.max_rollbacks, 0)
        between("routing.rollback_lr_factor", self.rollback_lr_factor, 0.0, 1.0, low_open=True)
        at_least("routing.probe_prompts", self.probe_prompts, 0, "(0 = no probe)")
        at_least("routing.probe_every", self.probe_every, 0, "(0 = no probe)")
        at_least("routing.probe_engines", self.probe_engines, 0, "(0 = every engine)")
        at_least("routing.jump_window", self.jump_window, 5, "(the warning starts once 5 steps are in)")
