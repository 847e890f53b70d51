"""What the rollout engine takes and returns (engine-independent)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from moe_grpo.routing.trace import RoutingTrace


@dataclass(frozen=True)
class SamplingSettings:
    """How completions are sampled."""

    n: int = 1
    """Completions per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 64
    """Longest completion."""
    stop_token_ids: tuple[int, ...] = (2,)
    """Token ids that end a completion (the project tokenizer's <eos> is 2)."""
    seed: int | None = None
    """Per-request sampling seed: sample k of the prompt draws from `seed + k`, so the same prompt, weights and
    seed give the same completions whatever else the engine is doing (what a resumed run relies on to repeat an
    uninterrupted one). None: the engine's own generator."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n}, expected >= 1")
        if self.temperature == 0 and self.n > 1:
            raise ValueError(f"n={self.n} with temperature=0: greedy decoding gives n identical completions; use n=1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}, expected >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}, expected 0 < top_p <= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens}, expected >= 1")


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_ids: np.ndarray
    """The prompt's token ids."""
    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Generated token ids."""
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """Sampling log-prob of each generated token."""
    routing: RoutingTrace | None = None
    """Experts chosen at every position that went through the model: prompt + generated - 1 rows."""
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Policy version of the weights that sampled each generated token."""
    finish_reason: str = ""
    """'stop', 'length', 'abort' or 'error'."""
    error: str | None = None
    """Why this request failed (bad input, routing capture); the other requests were served."""
    resubmits: int = 0
    """Times a weight update aborted this completion and it was resubmitted (`on_update=abort`)."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_positions(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids) - 1


class RolloutEngine(Protocol):
    """The rollout side: token ids in, completions with routing out, new weights in."""

    policy_version: int

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingSettings) -> list[list[Completion]]:
        """`n` completions for each prompt; a bad prompt yields completions with `error` set."""
        ...

    def load_weights(self, tensors: dict[str, "object"], version: int) -> None:
        """Replace weights (HF names, complete modules) and start serving `version`."""
        ...

    def shutdown(self) -> None:
        ...
