"""Group-relative advantages (GRPO): each completion is scored against its siblings."""

from __future__ import annotations

import numpy as np


def group_relative_advantages(rewards: np.ndarray, *, normalize_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """`rewards [groups, group_size]` -> advantages of the same shape.

    A completion's advantage is its reward minus the mean reward of the
    completions sampled from the same prompt, divided by their sample standard
    deviation (ddof 1) plus `eps` when `normalize_std`, as verl's GRPO
    advantage (`(r - mean) / (std + 1e-6)`, torch.std's default ddof 1) and
    TRL's (`/ (std + 1e-4)`) define it; Dr. GRPO argues for leaving the division
    out, and both are offered. A group whose rewards are all equal carries no
    signal and gets zero advantage.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] < 1:
        raise ValueError(f"rewards have shape {r.shape}, expected [groups, group_size]")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards contain NaN or inf; a reward function failure must be scored before this point")
    centered = r - r.mean(axis=1, keepdims=True)
    if normalize_std:
        if r.shape[1] < 2:
            raise ValueError(f"a group of {r.shape[1]} completion(s) has no sample std; expected >= 2 per group")
        centered = centered / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    return centered.astype(np.float32)
