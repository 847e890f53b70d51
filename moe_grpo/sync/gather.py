"""Where each of this rank's parameter shards lands inside the full HF tensors (learner side of a sync).

Every rank writes its own shards straight into the shared bucket, at their
place in the full tensor; the TP gather, the EP expert gather and the
pipeline stages' layer offsets happen in that shared memory, with no
collective and no rank holding more than its own shards:

- TP: Megatron marks sharded parameters (`tensor_model_parallel`,
  `partition_dim`); a shard is the rank's slab along that dim. Two layouts
  need care: `linear_fc1` holds [gate_r; up_r] on TP rank r, and
  `linear_qkv` holds the rank's query groups, each [q, k, v] interleaved.
- EP: local expert e of a layer is global expert `mlp.local_expert_indices[e]`.
- PP: local layer i is global layer `layer_number - 1`.
- Replicas (data parallel copies, and unsharded tensors on TP ranks > 0)
  write nothing: exactly one rank writes each element.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_grpo.models.hf_names import ParamMapping, hf_shapes, param_mappings
from moe_grpo.models.spec import MoEModelSpec


class ShardPlacementError(ValueError):
    """A learner parameter has no place in the engine's tensors (unknown name, wrong shape)."""


@dataclass(frozen=True)
class ShardWrite:
    """Copy `source` (a view of a learner parameter) into `place(full HF tensor)`."""

    name: str
    source: torch.Tensor
    place: Callable[[torch.Tensor], torch.Tensor]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def _global_name(local: str, module: Any) -> str:
    m = _LAYER.match(local)
    if not m:
        return local
    layer = module.decoder.layers[int(m.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}." + local[m.end():]
    e = _EXPERT.search(name)
    if e:
        global_e = int(layer.mlp.local_expert_indices[int(e.group(1))])
        name = name[: e.start()] + f".mlp.experts.local_experts.{global_e}." + name[e.end():]
    return name


def _slab(dim: int | None, rank: int, length: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if dim is None:
        return lambda full: full
    return lambda full: full.narrow(dim, rank * length, length)


def _split(m: ParamMapping, src: torch.Tensor, spec: MoEModelSpec, dim: int | None, rank: int, size: int
           ) -> list[ShardWrite]:
    if m.kind == "copy":
        return [ShardWrite(m.hf[0], src, _slab(dim, rank, src.shape[dim] if dim is not None else 0))]
    if dim not in (None, 0):
        raise ShardPlacementError(f"{m.megatron} is split along dim {dim}; expected rows (dim 0)")
    if m.kind == "gate_up":
        gate, up = src.chunk(2, dim=0)
        rows = gate.shape[0]
        return [ShardWrite(m.hf[0], gate, _slab(dim, rank, rows)), ShardWrite(m.hf[1], up, _slab(dim, rank, rows))]
    groups, d, hidden = spec.query_groups, spec.kv_channels, src.shape[-1]
    per = spec.num_attention_heads // groups
    local = groups // size
    grouped = src.view(local, (per + 2) * d, hidden)
    parts = ((grouped[:, : per * d], per * d), (grouped[:, per * d : (per + 1) * d], d), (grouped[:, (per + 1) * d :], d))

    def place(rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda full: full.view(groups, rows, hidden)[rank * local : (rank + 1) * local]

    return [ShardWrite(hf, part, place(rows)) for hf, (part, rows) in zip(m.hf, parts)]


def local_shard_writes(learner: Any) -> list[ShardWrite]:
    """This rank's writes for one sync, checked against the full HF shapes before anything is written."""
    from megatron.core import parallel_state as ps

    spec, module = learner.spec, learner.module
    mappings = {m.megatron: m for m in param_mappings(spec)}
    shapes = hf_shapes(spec)
    tensors = dict(module.named_parameters())
    tensors.update({n: b for n, b in module.named_buffers() if n.endswith("expert_bias")})
    tp = (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    etp = (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    dp_first = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    edp_first = ps.get_expert_data_parallel_rank() == 0
    writes: list[ShardWrite] = []
    for local, tensor in tensors.items():
        if ".lora." in local:
            continue  # LoRA adapters travel in PEFT's naming (adapter_gather.py), not as base weights
        name = _global_name(local, module)
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            continue  # the last stage's copy of the tied embedding
        if name not in mappings:
            raise ShardPlacementError(f"learner parameter {local!r} (global {name!r}) has no HF name in "
                                      f"{spec.architecture}'s map")
        expert = "local_experts" in name
        (rank, size), first = (etp, edp_first) if expert else (tp, dp_first)
        partitioned = bool(getattr(tensor, "tensor_model_parallel", False)) and size > 1
        if not first or (not partitioned and rank != 0):
            continue
        stride = getattr(tensor, "partition_stride", 1)
        if partitioned and stride != (2 if mappings[name].kind == "gate_up" else 1):  # gated fc1: [gate_r; up_r]
            raise ShardPlacementError(f"{local} has partition_stride {stride}, expected "
                                      f"{2 if mappings[name].kind == 'gate_up' else 1}")
        dim = int(tensor.partition_dim) if partitioned else None
        for w in _split(mappings[name], tensor.detach(), spec, dim, rank if partitioned else 0, size if partitioned else 1):
            placed = w.place(torch.empty(shapes[w.name], device="meta"))
            if placed.shape != w.source.shape:
                raise ShardPlacementError(f"{local} -> {w.name}: shard of shape {list(w.source.shape)} does not fit "
                                          f"{list(placed.shape)} of the full {list(shapes[w.name])}")
            writes.append(w)
    return writes
