"""A run's signals and its cleanup: what `train` installs before anything starts and runs however the run ends.

SIGTERM / SIGUSR1 (what SLURM sends before preemption) become the driver's checkpoint at the next step boundary
(`SignalRelay`). Once the run is ending, a signal cannot stop the cleanup: SLURM sends SIGTERM again at the time
limit, a user may press on; each is noted and the cleanup goes on to its last step (`Teardown`), since a cleanup cut
short leaves the run's processes, weight slots and private directory behind. Ray installs a SIGTERM handler of its
own that exits on the spot; the relay is installed over it and, at the end, gives back the handlers from before Ray.
Ray's shutdown also resets SIGTERM under Python's feet (`keep_handlers_through_ray_shutdown`).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Callable

log = logging.getLogger("moe_grpo")


RAY_CHECKED = "2.60.0"
"""The Ray version `keep_handlers_through_ray_shutdown` was checked against."""


def keep_handlers_through_ray_shutdown() -> None:
    """Call before `ray.init`. The driver's core worker installs absl's failure-signal handler (a stack trace on a
    crash), and `ray.shutdown()` uninstalls it by setting SIGTERM, among others, to SIG_DFL at the C level, under
    Python's feet (Python still reports its own handler): a SIGTERM that lands during the rest of the shutdown (Ray's
    processes being stopped) or after it kills the driver mid-cleanup, exit -15 (seen with Ray 2.60.0). Ray's own
    switch for it (RAY_DISABLE_FAILURE_SIGNAL_HANDLER, which it reads once, when it is imported) is turned on here for
    this process only: Ray's worker processes keep theirs."""
    from ray._private import ray_constants

    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True


class SignalRelay:
    """SIGTERM / SIGUSR1 -> the driver's checkpoint at the next step boundary. Before the schedule runs there is
    nothing to checkpoint: SIGTERM then stops the start-up at once (cleanly). While the run cleans up (`hold`), a
    signal is only noted."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    HELD = SIGNALS + (signal.SIGINT,)
    """Signals held during the cleanup: SIGINT too (a second Ctrl-C must not cut the cleanup of the first short)."""

    def __init__(self) -> None:
        self.driver: Any = None
        self.original = {signum: signal.getsignal(signum) for signum in self.HELD}
        """The handlers before the run (and before Ray's): what `restore` gives back."""
        self.holding = False
        self.held: list[str] = []
        """Signals that arrived while the run cleaned up, by name."""

    def install(self) -> None:
        for signum in self.SIGNALS:
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame: Any) -> None:
        if self.holding:  # only a note: a handler must not take locks (the log's) the interrupted code may hold
            self.held.append(signal.Signals(signum).name)
        elif self.driver is not None and self.driver.record is not None:
            self.driver.on_signal(signum)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        elif signum == signal.SIGTERM:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} during start-up")

    def hold(self) -> None:
        """From now until `restore`, signals are noted and nothing else (installed here too: the run may be ending
        before `install` was reached)."""
        self.holding = True
        for signum in self.HELD:
            signal.signal(signum, self.handle)

    def restore(self) -> None:
        for signum, handler in self.original.items():
            signal.signal(signum, handler)


class Teardown:
    """The run's cleanup: named steps run in order, each whatever the ones before did (a step that fails is logged,
    and the rest still run), with signals held (`SignalRelay.hold`) from the first step until the last is done."""

    def __init__(self, signals: SignalRelay, after_each: Callable[[], None] | None = None) -> None:
        """`after_each`: called after every step (the process record is brought up to date there)."""
        self.signals = signals
        self.after_each = after_each
        self.steps: list[tuple[str, Callable[[], Any]]] = []
        self.done: list[str] = []
        self.failed: list[str] = []
        self.seconds: dict[str, float] = {}
        """Each step's time, its process record's update included (the log's last line names the slow ones)."""

    def add(self, name: str, step: Callable[[], Any]) -> None:
        self.steps.append((name, step))

    def run(self) -> None:
        self.signals.hold()
        t0 = time.perf_counter()
        try:
            for name, step in self.steps:
                t_step = time.perf_counter()
                try:
                    step()
                    self.done.append(name)
                except Exception as e:  # noqa: BLE001 - one release failing must not keep the others from running
                    self.failed.append(name)
                    log.warning("cleanup: %s failed (%s: %s); the rest of the cleanup goes on", name,
                                type(e).__name__, e)
                self.signals.hold()  # again: a step may have reset a handler at the C level (ray.shutdown does)
                if self.after_each is not None:
                    try:
                        self.after_each()
                    except Exception as e:  # noqa: BLE001 - a record of the cleanup must not stop it
                        log.warning("cleanup: the process record after %s could not be written (%s)", name, e)
                self.seconds[name] = time.perf_counter() - t_step
        finally:
            held = self.signals.held
            if held:
                counts = {name: held.count(name) for name in dict.fromkeys(held)}
                log.warning("cleanup: %s arrived during it and did not cut it short",
                            ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items()))
            slowest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:3]
            log.info("cleanup done in %.1f s (%s)", time.perf_counter() - t0,
                     ", ".join(f"{name} {s:.1f} s" for name, s in slowest if s >= 0.05) or "no step took 0.1 s")
            self.signals.restore()
