"""Megatron layout (any TP/SP, EP, PP) -> full tensors under Hugging Face names, a decoder layer at a time.

Two steps on two sides of a process boundary:

1. `stage(learner, version)`, a collective over the learner's ranks: every
   rank writes its own shards with Megatron's distributed checkpointing into
   a staging directory on /dev/shm (memory, not disk, where it exists).
2. `iter_hf_buckets(stage_dir)`, in the process that feeds the engine: reads
   full tensors back one decoder layer at a time - Megatron's loader does the
   TP gather, local -> global expert ids across EP ranks and the pipeline
   stages' layer offsets - and renames them with the family's name map
   (`models/hf_names.py`, shared with checkpoint conversion).

No process holds more than one layer of full tensors at a time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from moe_grpo.models.hf_names import layer_groups, param_mappings, to_hf


def staging_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def stage(learner: Any, version: int, root: str | None = None) -> str:
    """Collective: write the learner's weights (policy `version`) to a staging directory; returns its path."""
    rank = torch.distributed.get_rank()
    box = [tempfile.mkdtemp(prefix=f"moe_grpo_sync_v{version}_", dir=root or staging_root()) if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    learner.save_checkpoint(path)
    if rank == 0:
        Path(path, "VERSION").write_text(str(int(version)))
    torch.distributed.barrier()
    return path


def staged_version(stage_dir: str) -> int:
    return int(Path(stage_dir, "VERSION").read_text())




def iter_hf_buckets(stage_dir: str, *, max_bucket_bytes: int = 256 << 20) -> Iterator[dict[str, torch.Tensor]]:
    """HF-named full tensors from a staged checkpoint, in buckets of whole decoder layers."""
    from moe_grpo.checkpoint.convert import _checkpoint_dtype, meta_model, read_spec
    from moe_grpo.checkpoint.megatron_stream import load_params

    spec = read_spec(stage_dir)
    model = meta_model(spec, _checkpoint_dtype(stage_dir))
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for group in layer_groups(param_mappings(spec)):
        loaded = load_params(model, stage_dir, [m.megatron for m in group])
        for m in group:
            for name, t in zip(m.hf, to_hf(m, loaded[m.megatron], spec)):
                bucket[name] = t
                size += t.numel() * t.element_size()
        if size >= max_bucket_bytes:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def release(stage_dir: str) -> None:
    """Remove a staging directory once every engine has its weights."""
    shutil.rmtree(Path(stage_dir).parent, ignore_errors=True)
