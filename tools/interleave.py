"""Shared by the benchmarks: run two arms alternately so machine drift hits both, report medians."""

from __future__ import annotations

import argparse
import statistics
from typing import Callable


def engine_bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every engine bench takes (a bench adds its own): the model, what is sampled, the rounds."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek_moe")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    return ap


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
