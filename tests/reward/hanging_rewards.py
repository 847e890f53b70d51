"""Reward functions that misbehave the way a flaky user reward does.

Named by dotted path, `tests.reward.hanging_rewards:...`: the workers import them as the caller would."""

import asyncio
import os
import signal
import time

HANG_S = 30.0
"""How long a hung call sleeps: far past the tests' timeouts, yet short enough that a Rewards which cannot free its
worker makes the tests fail (a process that exits only when the hang ends) rather than hang the suite."""

MARK = None
"""Set by a test in its own process: a worker that sees it set was forked from the test, not started fresh."""


def _next_call() -> int:
    """1, 2, 3, ... counted in the file $HANG_COUNTER, so the count survives the worker being replaced."""
    path = os.environ["HANG_COUNTER"]
    n = int(open(path).read() or 0) + 1 if os.path.exists(path) else 1
    with open(path, "w") as f:
        f.write(str(n))
    return n


def hangs_every_third_call(prompts, completions, **fields):
    """Hangs (for HANG_S) on every third call; otherwise the length of each completion."""
    if _next_call() % 3 == 0:
        time.sleep(HANG_S)
    return [float(len(c)) for c in completions]


def hangs(prompts, completions, **fields):
    time.sleep(HANG_S)
    return [0.0] * len(completions)


async def blocks_its_event_loop(prompts, completions, **fields):
    """An async reward that calls something blocking: no asyncio timeout can cancel it."""
    time.sleep(HANG_S)
    return [0.0] * len(completions)


def exits(prompts, completions, how=None, **fields):
    """Ends its own process when the rows ask to (how=exit: os._exit(3); how=segfault: SIGSEGV); else 1.0 each."""
    how = set(how or ())
    if "exit" in how:
        os._exit(3)
    if "segfault" in how:
        os.kill(os.getpid(), signal.SIGSEGV)
    return [1.0] * len(completions)


def pid_and_mark(prompts, completions, **fields):
    """This process's pid, then 1.0 if MARK is set here (it is only set in the test's own process)."""
    return [float(os.getpid()), 1.0 if MARK is not None else 0.0][: len(completions)]


async def async_length(prompts, completions, **fields):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def hangs_if_asked(prompts, completions, hang=None, **fields):
    """Hangs (for HANG_S) when any row's `hang` field is true; otherwise the length of each completion."""
    if any(hang or ()):
        time.sleep(HANG_S)
    return [float(len(c)) for c in completions]
