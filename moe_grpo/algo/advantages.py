"""Group-relative advantages (GRPO): each completion is scored against its siblings."""

from __future__ import annotations

import numpy as np


def group_relative_advantages(rewards: np.ndarray, *, normalize_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """`rewards [groups, group_size]` -> advantages of the same shape.

    A completion's advantage is its reward minus the mean reward of the
    completions sampled from the same prompt, divided by their standard
    deviation when `normalize_std` (Dr. GRPO argues for leaving it out; both
    are offered). A group whose rewards are all equal carries no signal and
    gets zero advantage.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 1:
        raise ValueError(f"rewards have shape {r.shape}, expected [groups, group_size]")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards contain NaN or inf; a reward function failure must be scored before this point")
    centered = r - r.mean(axis=1, keepdims=True)
    if normalize_std:
        centered = centered / (r.std(axis=1, keepdims=True) + eps)
    return centered.astype(np.float32)
