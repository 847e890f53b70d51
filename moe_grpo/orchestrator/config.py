"""Settings of the rollout side and of the Ray cluster (config groups `rollout` and `cluster`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutConfig:
    """How the engines sample."""

    temperature: float = 1.0
    """Sampling temperature of training rollouts (evaluation is greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 16
    """Longest completion in tokens (verl response_length, TRL max_completion_length)."""
    on_update: str = "keep"
    """What a weight update does to requests in flight: 'keep' (pause, load, resume on the new weights)
    or 'abort' (abort and resubmit prompt + tokens so far, AReaL's way)."""
    max_num_seqs: int = 256
    """Sequences an engine batches at once."""
    dtype: str = "float32"
    """Engine weights' dtype ('float32' or 'bfloat16')."""
    kv_cache_gib: int = 1
    """KV cache per engine on CPU (GiB)."""
    request_timeout_s: float = 120.0
    """A group of completions not back within this many seconds marks its engine hung: the engine is restarted and
    its prompts resubmitted (see `max_restarts`)."""
    max_restarts: int = 3
    """Engine restarts allowed per engine within `restart_window_s`; one more failure stops the run, naming the
    engine and the last checkpoint."""
    restart_window_s: float = 3600.0
    """The window `max_restarts` counts over (seconds)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0 or not math.isfinite(self.temperature):
            raise ValueError(f"rollout.temperature={self.temperature}, expected > 0 (groups need distinct samples)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p}, expected 0 < top_p <= 1")
        if self.max_tokens < 1:
            raise ValueError(f"rollout.max_tokens={self.max_tokens}, expected >= 1")
        if self.on_update not in ("keep", "abort"):
            raise ValueError(f"rollout.on_update={self.on_update!r}, expected 'keep' or 'abort'")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"rollout.dtype={self.dtype!r}, expected 'float32' or 'bfloat16'")
        if self.max_num_seqs < 1 or self.kv_cache_gib < 1:
            raise ValueError(f"rollout.max_num_seqs={self.max_num_seqs}, rollout.kv_cache_gib={self.kv_cache_gib}: "
                             "expected >= 1")
        if not self.request_timeout_s > 0:
            raise ValueError(f"rollout.request_timeout_s={self.request_timeout_s}, expected > 0")
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_restarts={self.max_restarts}, expected >= 0")
        if not self.restart_window_s > 0:
            raise ValueError(f"rollout.restart_window_s={self.restart_window_s}, expected > 0")


@dataclass(frozen=True)
class ClusterConfig:
    """Where the pools run: Ray, engines, learner ranks and their resources."""

    ray_address: str | None = None
    """Address ('host:port') of a Ray cluster to join; None starts a cluster of this run's own (private temp dir,
    see pools.start_ray). 'auto' is refused: it joins whichever cluster the host last started, maybe another job's."""
    num_engines: int = 1
    """vLLM engines (one Ray actor each)."""
    engine_cpus: float = 1.0
    """CPUs reserved per engine actor."""
    engine_gpus: float = 0.0
    """GPUs reserved per engine actor."""
    learner_ranks: int | None = None
    """Learner processes (one Ray actor per Megatron rank); None = TP x PP x EP of `parallel` (DP = EP)."""
    learner_cpus: float = 1.0
    """CPUs reserved per learner rank."""
    learner_gpus: float = 0.0
    """GPUs reserved per learner rank."""
    pin_cpus: bool = False
    """Pin each actor's process (and the engine's children) to its own cores: engines first, then learner ranks
    (single host only; benchmarks use it so each pool gets exactly its share)."""
    start_timeout_s: float = 600.0
    """Pools not up within this many seconds fail the run, naming the part that did not start."""
    learner_timeout_s: float = 1800.0
    """A learner call (training step, publish, checkpoint) not back within this many seconds stops the run, naming
    the rank (a dead rank is named at once; a hung collective only by this timeout)."""

    def __post_init__(self) -> None:
        if self.ray_address == "auto":
            raise ValueError("cluster.ray_address='auto' joins whichever Ray cluster this host last started, possibly "
                             "another job's or another user's; pass its address (cluster.ray_address=<head ip>:6379, "
                             "what `ray start --head` printed), or leave it unset for a cluster of this run's own")
        if not self.start_timeout_s > 0 or not self.learner_timeout_s > 0:
            raise ValueError(f"cluster.start_timeout_s={self.start_timeout_s}, cluster.learner_timeout_s="
                             f"{self.learner_timeout_s}: expected > 0")
        if self.num_engines < 1:
            raise ValueError(f"cluster.num_engines={self.num_engines}, expected >= 1")
        if self.learner_ranks is not None and self.learner_ranks < 1:
            raise ValueError(f"cluster.learner_ranks={self.learner_ranks}, expected >= 1 or null")
        for name in ("engine_cpus", "learner_cpus", "engine_gpus", "learner_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster.{name}={getattr(self, name)}, expected >= 0")


@dataclass(frozen=True)
class CheckpointConfig:
    """Run checkpoints (config group `checkpoint`): what `resume=true` continues from."""

    every: int = 50
    """Write a run checkpoint every this many optimizer steps (0 = only on SIGTERM / SIGUSR1 and at the end)."""
    keep: int = 2
    """Complete checkpoints kept in `<run dir>/checkpoints`; older ones are deleted once a newer one is whole."""
    at_end: bool = True
    """Write one after the last step too (what a later `steps=` increase with `resume=true` continues from)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint.every={self.every}, expected >= 0 (0 = only on signals and at the end)")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep={self.keep}, expected >= 1")
