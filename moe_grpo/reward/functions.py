"""Calling reward functions: loaded by dotted path, weighted, plain or async, each call under a timeout.

A function that raises, times out, returns the wrong number of values or a
value that is not a finite number marks those samples failed: their reward is
NaN, the caller counts them (`reward/failed`) and leaves them out of training.
A function that cannot be imported is a configuration error and fails the run
at start, naming it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

log = logging.getLogger("moe_grpo")


def load_function(path: str) -> Callable[..., Any]:
    """`package.module:function` (the function may be an attribute path: `module:Class.method`)."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config error naming the path
        raise ImportError(f"reward.fn={path!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"reward.fn={path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward.fn={path!r} is a {type(obj).__name__}, expected a function")
    return obj


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    weight: float
    accepts: frozenset[str] | None = None
    """Keyword arguments the function names (None: it takes **kwargs, so every row field)."""

    @classmethod
    def load(cls, path: str, weight: float = 1.0) -> "RewardFunction":
        fn = load_function(path)
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = None
        accepts = None
        if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            accepts = frozenset(p.name for p in params)
        return cls(path, fn, float(weight), accepts)


@dataclass
class Scores:
    """Weighted rewards of a batch of samples; NaN where a function failed."""

    rewards: np.ndarray
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> np.ndarray:
        return ~np.isfinite(self.rewards)


class Rewards:
    """The run's reward functions (`reward.fn` / `reward.weights`), called with one timeout each."""

    def __init__(self, paths: Sequence[str], weights: Sequence[float], timeout_s: float = 30.0) -> None:
        self.functions = [RewardFunction.load(p, w) for p, w in zip(paths, weights)]
        self.timeout_s = timeout_s
        self.failures_reported = 0
        """Calls whose failure was logged (reward/scoring.py logs the first few of a run)."""
        # Plain functions run on worker threads so a hung one can be timed out; the thread itself cannot be
        # killed, so the pool has a few spares before new calls queue behind hung ones.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="reward")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, rf: RewardFunction, prompts: list[str], completions: list[str],
              fields: Mapping[str, list[Any]]) -> Any:
        kwargs = dict(fields) if rf.accepts is None else {k: v for k, v in fields.items() if k in rf.accepts}
        if inspect.iscoroutinefunction(rf.fn):
            async def bounded() -> Any:
                return await asyncio.wait_for(rf.fn(prompts, completions, **kwargs), self.timeout_s)

            try:
                return asyncio.run(bounded())
            except asyncio.TimeoutError as e:
                raise TimeoutError(f"did not return within reward.timeout_s={self.timeout_s:g} s") from e
        future = self._pool.submit(rf.fn, prompts, completions, **kwargs)
        try:
            result = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise TimeoutError(f"did not return within reward.timeout_s={self.timeout_s:g} s") from e
        if inspect.isawaitable(result):  # a plain function that returned a coroutine
            async def wait() -> Any:
                return await asyncio.wait_for(result, self.timeout_s)

            result = asyncio.run(wait())
        return result

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              fields: Mapping[str, Sequence[Any]] | None = None) -> Scores:
        """The weighted reward per sample; a sample is NaN (failed) when any function failed on it."""
        n = len(completions)
        total = np.zeros(n, np.float64)
        errors: list[str] = []
        cols = {k: list(v) for k, v in (fields or {}).items()}
        for rf in self.functions:
            try:
                out = self._call(rf, list(prompts), list(completions), cols)
                values = _as_floats(out, n)
            except Exception as e:  # noqa: BLE001 - a reward failure costs its samples, not the run
                errors.append(f"{rf.name}: {type(e).__name__}: {e}")
                total[:] = np.nan
                continue
            bad = ~np.isfinite(values)
            if bad.any():
                errors.append(f"{rf.name}: {int(bad.sum())} of {n} values not finite (NaN/inf/None)")
            total += rf.weight * values
        return Scores(total, errors)


def _as_floats(out: Any, n: int) -> np.ndarray:
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise TypeError(f"returned {type(out).__name__}, expected a list of {n} floats")
    if len(out) != n:
        raise ValueError(f"returned {len(out)} values for {n} completions")
    values = np.full(n, np.nan)
    for i, v in enumerate(out):
        try:
            f = float(v) if v is not None else math.nan
        except (TypeError, ValueError):
            f = math.nan
        values[i] = f
    return values
