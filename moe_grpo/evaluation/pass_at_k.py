"""pass@k from n samples of which c are correct: the unbiased estimator of Chen et al. 2021 (the Codex paper)."""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k): the chance that k samples drawn without replacement from the n hold a correct one.

    Computed as the product form 1 - prod_{i=n-c+1..n} (1 - k/i), which does not overflow for large n."""
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct of n={n} samples, expected 0 <= c <= n")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} with n={n} samples, expected 1 <= k <= n")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
