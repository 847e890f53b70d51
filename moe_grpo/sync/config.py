"""Weight-sync settings of a run (config group `sync`): which transport carries versions to the engines."""

from __future__ import annotations

from dataclasses import dataclass

from moe_grpo.validate import at_least, positive, refuse

TRANSPORTS = ("auto", "shm", "relay", "cuda_ipc")
"""`sync.transport` (see `sync/transports.py` for what each one does)."""

LORA_APPLY = ("merge", "serve")
"""`sync.lora_apply`: how an engine applies a version's LoRA adapters."""

ROOT_ENV = "MOE_GRPO_SYNC_ROOT"
"""A host's weight-buffer directory, read on each host (set it in the environment of that host's `ray start`);
`sync.root` wins over it."""


@dataclass(frozen=True)
class SyncConfig:
    """How published versions reach the engines."""

    transport: str = "auto"
    """'shm': shared-memory buckets on the one host every learner rank and engine shares (the learner's write is
    the transfer); 'relay': each learner rank writes on its own host and broadcasts its shards over a private gloo
    group to every other host that holds engines (or learner rank 0), where they land in that host's shared memory;
    'cuda_ipc': buckets in learner rank 0's GPU memory, opened by the engines by CUDA IPC handle (one host, learner
    and engines on GPUs); 'auto': 'shm' when the run's actors are on one Ray node, 'relay' otherwise."""
    root: str | None = None
    """Directory (a tmpfs) for each host's weight buffers; None = $MOE_GRPO_SYNC_ROOT on that host, else
    /dev/shm/moe_grpo_sync_<uid>. Each run uses a private run-<pid>-<time> directory under it."""
    slots: int = 2
    """Whole versions each host's transport keeps (an extra one is opened while every slot is pinned)."""
    relay_timeout_s: float = 300.0
    """A relay broadcast (one bucket of one rank's shards) not through within this many seconds fails that
    publish, naming the rank and the host."""
    lora_apply: str = "merge"
    """With `lora.rank > 0`: how an engine applies each version's adapters. 'merge': each vLLM worker keeps an
    exact copy of W0 of every adapted weight (host memory: those weights' bytes) and reloads W0 + (alpha/r) B A
    computed from it (rollout/lora_merge.py); 'serve': each version's adapters become a vLLM LoRA adapter that new
    requests carry, the base weights untouched (rollout/lora_serving.py; on CPU not for `lora.targets` with
    'experts', which vLLM 0.32 cannot serve there). 'merge' is the default: on CPU served adapters took 1.87x
    the time per token of merged weights (tools/bench_lora_apply.py), merging serves routed-expert adapters, and
    both match the learner's log-probs to within 1e-6 (tests/rollout/test_lora_*.py)."""

    delta: bool = False
    """After a full first version, send each version as the elements whose value in the engine's dtype changed
    (`sync/delta.py`): engines reload only the tensors that changed, a routed expert no step touched costs nothing.
    Exact: engines hold bit for bit what a full version gives. Pays off with `rollout.dtype=bfloat16`, where most
    small updates do not move a bf16 value; in float32 nearly every element changes every step and versions fall
    back to full (`delta_max_fraction`). Over the relay only the encoded changes cross hosts. Off by default
    until measured on a real model. LoRA runs (whose versions are adapters already) refuse it."""
    delta_max_fraction: float = 0.5
    """A learner rank sends its shards whole when their encoded delta would exceed this fraction of their bytes."""
    full_every: int = 0
    """With `delta`: every this many versions, a full version that every engine reloads whole (a bound on how
    long a corrupted engine buffer could go unnoticed); 0 = only when needed (the first version, after a failed
    publish, an engine whose chain of changes is not known)."""

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise refuse("sync.transport", self.transport, f"one of {', '.join(TRANSPORTS)}")
        if self.lora_apply not in LORA_APPLY:
            raise refuse("sync.lora_apply", self.lora_apply, f"one of {', '.join(LORA_APPLY)}")
        at_least("sync.slots", self.slots, 1)
        positive("sync.relay_timeout_s", self.relay_timeout_s)
        if not 0.0 < self.delta_max_fraction <= 1.0:
            raise refuse("sync.delta_max_fraction", self.delta_max_fraction, "a fraction in (0, 1]")
        at_least("sync.full_every", self.full_every, 0)

