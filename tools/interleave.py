"""Shared by the benchmarks: run two arms alternately so machine drift hits both, report medians."""

from __future__ import annotations

import statistics
from typing import Callable


def interleaved_medians(first: Callable[[], float], second: Callable[[], float], rounds: int,
                        warmup: int = 1) -> tuple[float, float]:
    """Median of each arm over `rounds` timed rounds, after `warmup` untimed ones.

    The arm that goes first alternates from round to round."""
    for _ in range(warmup):
        first(), second()
    a: list[float] = []
    b: list[float] = []
    for i in range(rounds):
        if i % 2:
            b.append(second()); a.append(first())  # noqa: E702
        else:
            a.append(first()); b.append(second())  # noqa: E702
    return statistics.median(a), statistics.median(b)
