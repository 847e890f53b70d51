"""Write and read Megatron distributed checkpoints one tensor chunk at a time.

The layout of a Megatron `torch_dist` checkpoint is described by the model
itself: `model.sharded_state_dict()` of a model built on the meta device lists
every chunk (checkpoint key, global offset, shape) without allocating weights.
Such a checkpoint is layout-free: Megatron's loader reshards it to any
TP/EP/PP at load time. This module

- saves one through megatron-core's own `dist_checkpointing.save`, with a
  strategy whose writer asks a `ChunkSource` for each chunk's data only when
  torch's DCP FileSystemWriter is about to write it (so peak memory is one
  chunk - one expert, one attention matrix - not the model);
- reads chunks back by model parameter name, a few parameters at a time.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.distributed.checkpoint import FileSystemWriter, save as dcp_save

ParamSource = Callable[[str], torch.Tensor]
"""Full (TP=EP=PP=1) tensor of one Megatron model parameter, by its model name."""


@dataclass(frozen=True)
class ChunkRef:
    """Where one checkpoint chunk comes from in the model's own parameters."""

    param: str
    """Model parameter name at TP=EP=PP=1 (e.g. decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight)."""
    offset: tuple[int, ...]
    """Offset of the chunk inside that parameter."""
    shape: tuple[int, ...]
    """Chunk shape."""
    prepend: int = 0
    """Leading size-1 axes the checkpoint stores (e.g. the expert axis of stacked experts)."""

    def take(self, full: torch.Tensor) -> torch.Tensor:
        index = tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))
        if full.shape[len(self.offset):] or full.dim() != len(self.offset):
            raise ValueError(f"{self.param}: source tensor has shape {tuple(full.shape)}, expected {len(self.offset)} dims")
        chunk = full[index]
        if tuple(chunk.shape) != self.shape:
            raise ValueError(f"{self.param}: source tensor of shape {tuple(full.shape)} does not hold a chunk "
                             f"{self.shape} at offset {self.offset}")
        return chunk.reshape((1,) * self.prepend + self.shape)


def chunk_map(sharded_state_dict: dict[str, Any]) -> dict[tuple[str, tuple[int, ...]], ChunkRef]:
    """(checkpoint key, global offset) -> ChunkRef, for every tensor chunk of a TP=EP=PP=1 model."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out: dict[tuple[str, tuple[int, ...]], ChunkRef] = {}
    for name, value in sharded_state_dict.items():
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            items = list(nested_values(built)) if isinstance(built, (dict, list)) else [built]
        else:
            items = [value]
        for sh in items:
            if not isinstance(sh, ShardedTensor):
                continue
            pre = sh.prepend_axis_num
            key = (sh.key, tuple(int(o) for o in sh.global_offset))
            out[key] = ChunkRef(name, tuple(int(o) for o in sh.global_offset[pre:]),
                                tuple(int(s) for s in sh.local_shape), pre)
    return out


def _lazy_strategy(chunks: dict[tuple[str, tuple[int, ...]], ChunkRef], source: ParamSource,
                   on_chunk: Callable[[str], None] | None) -> Any:
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    cache: dict[str, torch.Tensor] = {}

    def resolve(fqn: str, offset: tuple[int, ...]) -> torch.Tensor:
        ref = chunks.get((fqn, offset))
        if ref is None:
            raise KeyError(f"checkpoint chunk {fqn} at offset {offset} has no source parameter")
        # Consecutive chunks usually come from one parameter (gate/up halves): keep just the last one.
        if ref.param not in cache:
            cache.clear()
            full = source(ref.param)
            cache[ref.param] = full
        if on_chunk is not None:
            on_chunk(ref.param)
        return ref.take(cache[ref.param]).contiguous()

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            if isinstance(obj, torch.Tensor) and obj.is_meta:
                obj = resolve(write_item.index.fqn, tuple(int(o) for o in write_item.index.offset))
            return self.transform_object(write_item, obj)

    class StreamingSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, False)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1, sync_files=True)
            dcp_save(pyt_state_dict, storage_writer=writer,
                     planner=LazyPlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
            cache.clear()

    return StreamingSaveStrategy("torch_dist", 1)


def save_streaming(meta_model: Any, source: ParamSource, directory: str,
                   on_chunk: Callable[[str], None] | None = None, extra_files: dict[str, str] | None = None) -> None:
    """Write a Megatron checkpoint for `meta_model`'s structure, pulling each chunk from `source`.

    Written into `<directory>.tmp` and renamed into place, so a failure leaves
    nothing at `directory`.
    """
    from megatron.core import dist_checkpointing

    sharded = meta_model.sharded_state_dict()
    chunks = chunk_map(sharded)
    target = Path(directory)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dist_checkpointing.save(sharded, str(tmp), sharded_strategy=_lazy_strategy(chunks, source, on_chunk),
                                validate_access_integrity=False)
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        if target.exists():
            raise FileExistsError(f"destination {target} appeared while converting; not overwriting it")
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_params(meta_model: Any, directory: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Full tensors of the named model parameters (TP=EP=PP=1 names) from a Megatron checkpoint."""
    from megatron.core import dist_checkpointing

    wanted = set(names)
    sharded = meta_model.sharded_state_dict()
    request = {}
    for name in wanted:
        if name not in sharded:
            raise KeyError(f"{name!r} is not a parameter of this model")
        request[name] = _materialize(sharded[name])
    loaded = dist_checkpointing.load(request, directory, validate_access_integrity=False)
    return {name: loaded[name] for name in wanted}


def _materialize(item: Any) -> Any:
    """Replace the meta tensor of a ShardedTensor(Factory) with an empty CPU tensor to load into."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(item, ShardedTensor):
        item.data = torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu")
        return item
    if isinstance(item, ShardedTensorFactory):
        item.data = torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu")
        return item
    raise TypeError(f"cannot load checkpoint item of type {type(item).__name__}")
