"""Every random generator a learner process draws from, as one state a run checkpoint saves per global rank.

Python's, NumPy's and torch's global generators, CUDA's where there is a GPU, and Megatron's tracker (the
tensor-parallel generators: dropout and initialisation differ per TP rank). A state is only meaningful for the
same rank of the same layout, so `load_run_state` restores it only there.
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import torch

RNG_FILE_RE = re.compile(r"rng_rank\d+\.pt")
"""Names of the per-rank RNG files inside a run-state directory (an earlier attempt's are removed first)."""


def rng_file(rank: int) -> str:
    """Name of global rank `rank`'s RNG states inside a run-state directory."""
    return f"rng_rank{rank}.pt"


def capture_rng_state() -> dict[str, Any]:
    """This process's generators: `{"python", "numpy", "torch", "megatron"[, "cuda"]}` (what `torch.save` writes)."""
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "megatron": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set this process's generators to a `capture_rng_state` result (as `torch.load` reads it back: tuples may
    come back as lists)."""
    from megatron.core import tensor_parallel

    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
