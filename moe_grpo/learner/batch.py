"""Sequences in, padded or packed Megatron microbatches out.

The learner feeds `tokens[:-1]` and predicts `tokens[1:]`, so a sequence of
length L occupies L-1 positions: exactly the rows of its routing trace
(docs/reference/trace-format.md: every prompt token and every generated token
except the last).

Packed microbatches put several sequences in one row behind a block-diagonal
causal mask. Rotary attention depends only on relative positions, so a packed
sequence sees exactly what it would see alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from moe_grpo.routing.trace import RoutingTrace


@dataclass
class LearnerSequence:
    """One prompt + completion as the learner sees it."""

    tokens: np.ndarray
    """Token ids, prompt then completion."""
    prompt_len: int
    """Number of prompt tokens; later tokens are the response (trained on)."""
    routing: RoutingTrace | None = None
    """Rollout routing, `[len(tokens)-1, moe_layers, topk]`; needed for replay."""
    advantage: float = 0.0
    """Advantage of this completion (same for all its tokens)."""
    old_logprobs: np.ndarray | None = None
    """Sampling log-probs of the response tokens, `[len(tokens)-prompt_len]`."""
    versions: np.ndarray | None = None
    """Policy version that sampled each response token, `[len(tokens)-prompt_len]`; None = version 0."""

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        n = len(self.tokens)
        if n < 2:
            raise ValueError(f"sequence has {n} tokens, expected at least 2 (a prompt token and one more)")
        if not 1 <= self.prompt_len < n:
            raise ValueError(f"prompt_len={self.prompt_len}, expected 1 <= prompt_len < len(tokens)={n}")
        if self.old_logprobs is not None:
            self.old_logprobs = np.asarray(self.old_logprobs, dtype=np.float32)
            if self.old_logprobs.shape != (n - self.prompt_len,):
                raise ValueError(
                    f"old_logprobs has shape {self.old_logprobs.shape}, expected ({n - self.prompt_len},) "
                    "(one per response token)"
                )
        if self.versions is not None:
            self.versions = np.asarray(self.versions, dtype=np.int64)
            if self.versions.shape != (n - self.prompt_len,):
                raise ValueError(f"versions has shape {self.versions.shape}, expected ({n - self.prompt_len},)")

    @property
    def num_positions(self) -> int:
        return len(self.tokens) - 1


@dataclass
class Microbatch:
    """Tensors for one Megatron forward, `[rows, seq]` unless noted."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    """1.0 on response-token targets."""
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    versions: torch.Tensor
    """Policy version that sampled each response-token target (0 elsewhere)."""
    routing: torch.Tensor | None
    """`[rows, seq, moe_layers, topk]` int64, padding filled with ids 0..k-1."""
    attention_mask: torch.Tensor | None
    """`[rows, 1, seq, seq]` bool, True = masked; None means plain causal."""
    spans: list[tuple[int, int, int, int]]
    """Per sequence: (index in the input list, row, start, end) of its positions."""

    def to(self, device: torch.device) -> "Microbatch":
        """The same microbatch with every tensor on `device` (a no-op on CPU)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Microbatch(move(self.input_ids), move(self.labels), move(self.loss_mask),
                          move(self.advantages), move(self.old_logprobs), move(self.versions), move(self.routing),
                          move(self.attention_mask), self.spans)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def make_microbatches(
    seqs: Sequence[LearnerSequence],
    indices: Sequence[int],
    *,
    micro_batch_size: int,
    pad_multiple: int,
    packed: bool,
    with_routing: bool,
    moe_layers: int,
    top_k: int,
    pad_token: int = 0,
    num_microbatches: int | None = None,
    seq_len: int | None = None,
    same_shape: bool = True,
) -> list[Microbatch]:
    """Group `seqs` into microbatches, equally shaped when `same_shape` (pipeline schedules need one shape).

    Padded: `micro_batch_size` sequences per row set. With `same_shape=False` (no pipeline stages) the sequences
    are taken shortest first and each microbatch is padded only to its own longest (and holds only its own rows):
    a few long prompts then cost their own microbatch, not every one (a batch padded to one 500-token prompt took
    30-40 s a step where its short prompts alone took 1 s). Packed: sequences are packed greedily into rows of
    `seq_len` positions (default: the longest sequence), one row per microbatch.
    """
    if with_routing:
        missing = [i for i, s in zip(indices, seqs) if s.routing is None]
        if missing:
            raise ValueError(f"replay needs a routing trace for every sequence; sequences {missing[:5]} have none")
    longest = max(s.num_positions for s in seqs)
    groups: list[list[int]] = []
    if packed:
        row_len = seq_len or longest
        if longest > row_len:
            raise ValueError(f"a sequence of {longest} positions does not fit packed rows of {row_len}")
        current: list[int] = []
        used = 0
        for k, s in enumerate(seqs):
            if used + s.num_positions > row_len and current:
                groups.append(current)
                current, used = [], 0
            current.append(k)
            used += s.num_positions
        if current:
            groups.append(current)
        rows = 1
        width = _round_up(row_len, pad_multiple)
    else:
        order = list(range(len(seqs)))
        if not same_shape and seq_len is None:
            order.sort(key=lambda k: seqs[k].num_positions)  # stable: equal lengths keep their order
        groups = [order[i:i + micro_batch_size] for i in range(0, len(seqs), micro_batch_size)]
        rows = micro_batch_size
        width = _round_up(seq_len or longest, pad_multiple)
    if num_microbatches is not None:
        if len(groups) > num_microbatches:
            raise ValueError(f"{len(seqs)} sequences need {len(groups)} microbatches, more than {num_microbatches}")
        groups += [[] for _ in range(num_microbatches - len(groups))]

    def shape(g: list[int]) -> tuple[int, int]:
        if same_shape or packed or seq_len is not None or not g:
            return rows, width
        return len(g), _round_up(max(seqs[k].num_positions for k in g), pad_multiple)

    return [_collate([seqs[k] for k in g], [indices[k] for k in g], *shape(g), packed, with_routing,
                     moe_layers, top_k, pad_token) for g in groups]


def _collate(seqs, indices, rows, width, packed, with_routing, moe_layers, top_k, pad_token) -> Microbatch:  # type: ignore[no-untyped-def]
    input_ids = torch.full((rows, width), pad_token, dtype=torch.int64)
    labels = torch.full((rows, width), pad_token, dtype=torch.int64)
    loss_mask = torch.zeros((rows, width), dtype=torch.float32)
    adv = torch.zeros((rows, width), dtype=torch.float32)
    old = torch.zeros((rows, width), dtype=torch.float32)
    versions = torch.zeros((rows, width), dtype=torch.float32)
    routing = None
    if with_routing:
        # Padding positions still pass through the routers; any distinct ids will do.
        routing = torch.arange(top_k, dtype=torch.int64).expand(rows, width, moe_layers, top_k).clone()
    attention_mask = None
    if packed:
        allowed = torch.zeros((width, width), dtype=torch.bool)
    spans = []
    cursor = 0
    for j, (s, idx) in enumerate(zip(seqs, indices)):
        row, start = (0, cursor) if packed else (j, 0)
        n = s.num_positions
        end = start + n
        t = torch.tensor(s.tokens)  # a copy: arrays that arrive through Ray are read-only
        input_ids[row, start:end] = t[:-1]
        labels[row, start:end] = t[1:]
        resp_from = start + s.prompt_len - 1
        loss_mask[row, resp_from:end] = 1.0
        adv[row, start:end] = float(s.advantage)
        if s.old_logprobs is not None:
            old[row, resp_from:end] = torch.tensor(s.old_logprobs)
        if s.versions is not None:
            versions[row, resp_from:end] = torch.tensor(s.versions, dtype=torch.float32)
        if routing is not None:
            routing[row, start:end] = torch.from_numpy(s.routing.expert_ids.astype(np.int64))
        if packed:
            allowed[start:end, start:end] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        spans.append((idx, row, start, end))
        cursor = end
    if packed:
        # Padding positions attend to themselves only, so no softmax row is empty.
        pad = torch.arange(cursor, width)
        allowed[pad, pad] = True
        attention_mask = (~allowed).view(1, 1, width, width)
    return Microbatch(input_ids, labels, loss_mask, adv, old, versions, routing, attention_mask, spans)
