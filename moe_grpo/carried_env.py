"""What a process forked from a multiprocessing process server (`forkserver`) takes from the process that asked
for it: that caller's environment and CPU affinity as they are when it starts the process.

A forkserver child is a fork of the server, a process started once per caller; without this it would get the
environment and CPU affinity the caller had when the server started, not what the caller set since (a rank's
variables, `learner/spawn.py`; what vLLM sets just before it starts its engine core, an engine actor's cores,
`rollout/engine_core_start.py`). /proc/<pid>/environ still shows the server's (the kernel keeps the environment a
process was exec'ed with); what reads that (`process_ties.leftovers`) is served by restarting the server when the
variable it reads changes (`rollout/engine_core_start.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class CallerSettings:
    """The caller's environment and CPU affinity, taken when it starts a process."""

    environ: dict[str, str]
    cpus: frozenset[int] | None
    """The caller's allowed CPUs (None where the platform has no sched_getaffinity)."""

    @classmethod
    def now(cls) -> CallerSettings:
        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        return cls(dict(os.environ), cpus)

    def apply(self) -> None:
        """Make this process's environment (and CPU affinity) the caller's."""
        os.environ.clear()
        os.environ.update(self.environ)
        if self.cpus is not None and self.cpus != frozenset(os.sched_getaffinity(0)):
            os.sched_setaffinity(0, self.cpus)


class WithCallerSettings:
    """A process target that first takes on the caller's settings (pickled to the child by reference to this
    module, which imports nothing else of moe_grpo)."""

    def __init__(self, target: Callable[..., Any], settings: CallerSettings,
                 before: Callable[[], None] | None = None) -> None:
        self.target, self.settings, self.before = target, settings, before

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before is not None:
            self.before()
        self.settings.apply()
        return self.target(*args, **kwargs)
