"""DAPO's reward-side pieces: overlong reward shaping and the dynamic-sampling filter (numpy, no torch)."""

from __future__ import annotations

import numpy as np


def overlong_penalty(lengths: np.ndarray, *, max_tokens: int, buffer: int, penalty: float = 1.0) -> np.ndarray:
    """DAPO's soft overlong punishment, one value (<= 0) per completion length.

    0 up to `max_tokens - buffer` tokens, then falling linearly to `-penalty`
    at `max_tokens` (a completion cut at the limit gets the whole penalty).
    `buffer=0` turns it off.
    """
    lengths = np.asarray(lengths, dtype=np.float64)
    if buffer <= 0:
        return np.zeros_like(lengths)
    if buffer > max_tokens:
        raise ValueError(f"overlong buffer {buffer} is longer than max_tokens {max_tokens}")
    start = max_tokens - buffer
    return -penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)


def carries_signal(rewards: np.ndarray) -> bool:
    """False when every reward of the group is the same: its advantages are all zero (dynamic sampling drops it)."""
    r = np.asarray(rewards, dtype=np.float64)
    return bool(r.size) and bool(np.ptp(r) > 0)
