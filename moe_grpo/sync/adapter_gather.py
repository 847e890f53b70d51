"""Where each of this rank's adapter shards lands inside the full A and B tensors (learner side of an adapter sync).

The adapter counterpart of `gather.py`: every rank writes its own pieces of
each adapter straight into the shared bucket, at their place in the full
`A [r, in]` / `B [out, r]` (PEFT naming), with no collective:

- TP: a column-parallel layer shards B on its output dim (rows `rank * n ...`)
  and keeps A whole; a row-parallel layer shards A on its input dim (columns)
  and keeps B whole. The whole factor is written by TP rank 0 only. Fused
  layers hold one (A, B) per HF target (q/k/v, gate/up), each sharded as a
  plain contiguous slab (learner/lora.py's `LoraAdapter`).
- EP: each rank holds (and writes) the adapters of its local experts; the
  adapter dict is already keyed by global names (`lora.global_module_name`).
- PP: each stage holds its own layers' adapters.
- Replicas (data-parallel copies; expert-data-parallel copies for experts)
  write nothing: exactly one rank writes each element.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from moe_grpo.models.peft_names import peft_key, peft_shapes
from moe_grpo.sync.gather import ShardPlacementError, ShardWrite


def _slab(dim: int, rank: int, length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda full: full.narrow(dim, rank * length, length)


def _whole(full: torch.Tensor) -> torch.Tensor:
    return full


def adapter_writes(adapters: dict[str, Any], shapes: dict[str, tuple[int, ...]], *, dp_first: bool,
                   edp_first: bool) -> list[ShardWrite]:
    """The writes of this rank's adapters (`{global module name: LoraAdapter}`), checked against the full PEFT
    `shapes`. `dp_first` / `edp_first`: whether this rank is the first data-parallel (dense adapters) /
    expert-data-parallel (expert adapters) replica; the others write nothing."""
    writes: list[ShardWrite] = []
    for name, adapter in adapters.items():
        first = edp_first if ".mlp.experts." in name else dp_first
        if not first:
            continue
        tp, rank = adapter.tp, adapter.tp_rank
        for piece, hf in zip(adapter.pieces, adapter.mapping.hf):
            a, b = adapter.A[piece].detach(), adapter.B[piece].detach()
            if tp > 1 and adapter.parallel == "column":
                pairs = [(b, peft_key(hf, "B"), _slab(0, rank, b.shape[0]))]
                if rank == 0:
                    pairs.append((a, peft_key(hf, "A"), _whole))
            elif tp > 1:
                pairs = [(a, peft_key(hf, "A"), _slab(1, rank, a.shape[1]))]
                if rank == 0:
                    pairs.append((b, peft_key(hf, "B"), _whole))
            else:
                pairs = [(a, peft_key(hf, "A"), _whole), (b, peft_key(hf, "B"), _whole)]
            for source, key, place in pairs:
                if key not in shapes:
                    raise ShardPlacementError(f"adapter {name}.{piece} -> {key!r}: not an adapter of the plan")
                placed = place(torch.empty(shapes[key], device="meta"))
                if placed.shape != source.shape:
                    raise ShardPlacementError(f"adapter {name}.{piece} -> {key}: shard of shape {list(source.shape)} "
                                              f"does not fit {list(placed.shape)} of the full {list(shapes[key])}")
                writes.append(ShardWrite(key, source, place))
    return writes


def local_adapter_writes(learner: Any) -> list[ShardWrite]:
    """This learner rank's adapter writes for one sync (`learner.adapters`, `learner.lora`)."""
    from megatron.core import parallel_state as ps

    return adapter_writes(learner.adapters, peft_shapes(learner.spec, learner.lora),
                          dp_first=ps.get_data_parallel_rank(with_context_parallel=True) == 0,
                          edp_first=ps.get_expert_data_parallel_rank() == 0)
