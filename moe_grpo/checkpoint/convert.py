"""Checkpoint conversion: Hugging Face <-> Megatron distributed checkpoint, streamed.

A Megatron `torch_dist` checkpoint holds full (global) tensors cut into
chunks; Megatron reshards it to any TP/EP/PP when a learner loads it. So one
conversion serves every layout, and `--tp/--ep/--pp` only choose the layout a
`verify` loads it at. Neither direction holds more than one decoder layer (HF
side) or one tensor chunk (Megatron side) in memory.

Each Megatron checkpoint written here carries `moe_grpo_model.json` (the
model description) so the way back needs no config.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from moe_grpo.checkpoint.hf_io import CheckpointFileError, SafetensorsDir, ShardedSafetensorsWriter
from moe_grpo.checkpoint.megatron_stream import load_params, save_streaming
from moe_grpo.learner.parallel import ParallelLayout, init_distributed
from moe_grpo.models.hf_config import hf_config_from_spec, read_hf_config, spec_from_hf_config
from moe_grpo.models.hf_names import ParamMapping, layer_groups, param_mappings, to_hf, to_megatron
from moe_grpo.models.megatron import MegatronOptions, build_gpt_model, transformer_config
from moe_grpo.models.spec import SPEC_FILE, MoEModelSpec, read_spec, spec_json

class Progress:
    """Prints `[convert] what: n/total (pct) MB/s` to stderr at most every `every_s` seconds."""

    def __init__(self, what: str, total: int, unit_bytes: bool = False, every_s: float = 2.0, enabled: bool = True):
        self.what, self.total, self.done, self.bytes = what, total, 0, 0
        self.t0 = self.last = time.monotonic()
        self.every_s, self.enabled = every_s, enabled

    def step(self, nbytes: int = 0) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.monotonic()
        if self.enabled and (now - self.last >= self.every_s or self.done == self.total):
            self.last = now
            rate = self.bytes / max(now - self.t0, 1e-9) / 1e6
            print(f"[convert] {self.what}: {self.done}/{self.total} ({100 * self.done / max(self.total, 1):.0f}%), "
                  f"{self.bytes / 1e6:.0f} MB, {rate:.0f} MB/s", file=sys.stderr, flush=True)


def _single_process() -> None:
    init_distributed(ParallelLayout())


def meta_model(spec: MoEModelSpec, dtype: torch.dtype = torch.float32) -> Any:
    """The TP=EP=PP=1 Megatron model on the meta device: the checkpoint's layout, no memory."""
    _single_process()
    with torch.device("meta"):
        config = transformer_config(spec, MegatronOptions(params_dtype=dtype, perform_initialization=False))
        return build_gpt_model(spec, config)


def _expected_hf_shapes(mapping: ParamMapping, meta_shape: tuple[int, ...], spec: MoEModelSpec) -> list[tuple[int, ...]]:
    fake = torch.empty(meta_shape, device="meta")
    return [tuple(t.shape) for t in to_hf(mapping, fake, spec)]


def _meta_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return shapes


def _staging(out_dir: str | Path) -> tuple[Path, Path]:
    target = Path(out_dir)
    if target.exists():
        raise FileExistsError(f"destination {target} exists; remove it or choose another")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    return target, tmp


def hf_to_megatron(hf_dir: str | Path, out_dir: str | Path, *, progress: bool = True) -> MoEModelSpec:
    """HF safetensors directory -> Megatron distributed checkpoint (layout-free)."""
    target, _ = _staging(out_dir)
    spec = spec_from_hf_config(read_hf_config(hf_dir), name=Path(hf_dir).name)
    source = SafetensorsDir(hf_dir)
    mappings = param_mappings(spec)
    source.require(n for m in mappings for n in m.hf)
    first = source.tensors[mappings[0].hf[0]]
    model = meta_model(spec, first.torch_dtype)
    shapes = _meta_shapes(model)
    by_name = {m.megatron: m for m in mappings}
    missing = sorted(set(shapes) - set(by_name))
    if missing:
        raise RuntimeError(f"no HF mapping for Megatron parameter(s) {missing[:5]}; the name map is incomplete")
    # Check every shape against config.json before writing anything.
    for m in mappings:
        for hf_name, want in zip(m.hf, _expected_hf_shapes(m, shapes[m.megatron], spec)):
            got = source.shape(hf_name)
            if got != want:
                raise CheckpointFileError(
                    f"{source.tensors[hf_name].file.name}: tensor {hf_name!r} has shape {list(got)}, but config.json "
                    f"implies {list(want)}: config and tensors do not match")
    bar = Progress("HF -> Megatron tensors", len(mappings), enabled=progress)
    seen: set[str] = set()

    def param_source(name: str) -> torch.Tensor:
        m = by_name[name]
        tensor = to_megatron(m, [source.get(n) for n in m.hf], spec)
        if name not in seen:
            seen.add(name)
            bar.step(tensor.numel() * tensor.element_size())
        return tensor

    save_streaming(model, param_source, str(target), extra_files={
        SPEC_FILE: spec_json(spec),
        "hf_config.json": json.dumps(read_hf_config(hf_dir), indent=2, sort_keys=True) + "\n",
    })
    return spec


def megatron_to_hf(megatron_dir: str | Path, out_dir: str | Path, *, spec: MoEModelSpec | None = None,
                   progress: bool = True) -> MoEModelSpec:
    """Megatron distributed checkpoint -> HF safetensors directory (one file per decoder layer)."""
    target, tmp = _staging(out_dir)
    spec = spec or read_spec(megatron_dir)
    dtype = _checkpoint_dtype(megatron_dir)
    model = meta_model(spec, dtype)
    groups = layer_groups(param_mappings(spec))
    bar = Progress("Megatron -> HF layers", len(groups), enabled=progress)
    try:
        writer = ShardedSafetensorsWriter(tmp)
        for group in groups:
            loaded = load_params(model, str(megatron_dir), [m.megatron for m in group])
            out: dict[str, torch.Tensor] = {}
            for m in group:
                out.update(zip(m.hf, to_hf(m, loaded[m.megatron], spec)))
            writer.write_file(out)
            bar.step(sum(t.numel() * t.element_size() for t in out.values()))
            del loaded, out
        writer.finish()
        cfg = hf_config_from_spec(spec, torch_dtype=str(dtype).removeprefix("torch."))
        original = Path(megatron_dir) / "hf_config.json"
        if original.is_file():  # keep keys we do not model (tokenizer ids, rope scaling, ...)
            cfg = {**json.loads(original.read_text()), **cfg}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return spec


def _checkpoint_dtype(megatron_dir: str | Path) -> torch.dtype:
    """dtype of the embedding as stored in the checkpoint's DCP metadata."""
    meta = FileSystemReader(str(megatron_dir)).read_metadata()
    md = meta.state_dict_metadata.get("embedding.word_embeddings.weight")
    return md.properties.dtype if md is not None else torch.float32


def megatron_to_megatron(src_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None,
                         progress: bool = True) -> MoEModelSpec:
    """Rewrite a Megatron checkpoint (optionally in another dtype), one decoder layer in memory at a time."""
    target, _ = _staging(out_dir)
    spec = read_spec(src_dir)
    src_dtype = _checkpoint_dtype(src_dir)
    src_model = meta_model(spec, src_dtype)
    out_model = meta_model(spec, dtype or src_dtype)
    mappings = param_mappings(spec)
    group_of = {m.megatron: [x.megatron for x in g] for g in layer_groups(mappings) for m in g}
    cache: dict[str, torch.Tensor] = {}
    bar = Progress("Megatron -> Megatron tensors", len(mappings), enabled=progress)

    def source(name: str) -> torch.Tensor:
        if name not in cache:
            cache.clear()
            cache.update(load_params(src_model, str(src_dir), group_of[name]))
            for t in cache.values():
                bar.step(t.numel() * t.element_size())
        t = cache[name]
        return t.to(dtype) if dtype is not None and t.is_floating_point() and not name.endswith("expert_bias") else t

    extras = {f: (Path(src_dir) / f).read_text() for f in (SPEC_FILE, "hf_config.json") if (Path(src_dir) / f).is_file()}
    save_streaming(out_model, source, str(target), extra_files=extras)
    return spec

