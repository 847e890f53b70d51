"""Starting a run from a Hugging Face checkpoint (config group `init`).

    init.hf=DIR  ->  model description   from DIR/config.json (models/hf_config.py)
                     learner weights     from a Megatron checkpoint converted from DIR (streamed; cached and reused)
                     engine weights      from DIR itself (a view of it whose config.json vLLM can load)
                     tokenizer           DIR's own tokenizer files, local only (data/tokenizer.py HFTokenizer)
                     final policy        exported with DIR's tokenizer and config keys (rollout/export.py)

The conversion cache lives beside the run directories (`<run dir>/../megatron_cache`, or
above Hydra's date folder for the default `outputs/<date>/<time>`: `outputs/megatron_cache`;
before 2026-11-28 it was `outputs/<date>/megatron_cache`, one copy a day, which nothing
removes; `init.cache_dir` says otherwise), one directory per checkpoint
fingerprint (config.json, and each weight file's name, size and mtime), so a
later run from the same checkpoint reuses it and a changed checkpoint gets a
new one. Conversion happens once, in a child process, under a file lock, into
a staging directory renamed into place, while the run's pools start
(`LearnerStartCheckpoint`): the learner ranks load it once they are up.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe_grpo.learner.spawn import run_distributed
from moe_grpo.models.hf_config import hf_config_from_spec, read_hf_config, spec_from_hf_config

if TYPE_CHECKING:
    from moe_grpo.models.spec import MoEModelSpec

log = logging.getLogger("moe_grpo")

CONVERTER_VERSION = "1"
"""Part of the cache fingerprint: bump when the conversion's output changes."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
"""Files of a checkpoint that are its tokenizer (and generation defaults), copied into exports."""


@dataclass(frozen=True)
class InitConfig:
    """Where the initial weights come from; all None = random initialisation of `model`."""

    hf: str | None = None
    """A Hugging Face checkpoint directory (DeepSeek-MoE / V2 / V3 or Qwen3-MoE: config.json, *.safetensors and its
    tokenizer files). The model description is read from its config.json (the `model` group is ignored), the
    learner starts from its converted weights, the engines from the directory, tokenisation from its tokenizer."""
    megatron: str | None = None
    """A Megatron checkpoint already converted from `hf` (tools/convert_checkpoint.py --from hf --to megatron);
    None = convert on first use and cache it (see `cache_dir`)."""
    cache_dir: str | None = None
    """Where converted checkpoints are cached; None = `megatron_cache` next to the run directory, or next to its
    date folder when it is in one (Hydra's default `outputs/<date>/<time>-...`: `outputs/megatron_cache`, so runs
    on different days share it). A conversion is as large as the checkpoint's weights (their dtype kept): put it
    on a filesystem the learner hosts read."""
    adapter: str | None = None
    """A LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors, HF module names) to start
    the adapters from; needs `lora.rank` and `lora.alpha` equal to its `r` and `lora_alpha`."""

    def __post_init__(self) -> None:
        if self.hf is not None:
            if not self.hf or not Path(self.hf).is_dir():
                raise ValueError(f"init.hf={self.hf!r}: expected an existing checkpoint directory")
            if not (Path(self.hf) / "config.json").is_file():
                raise ValueError(f"init.hf={self.hf!r} has no config.json")
        if self.megatron is not None:
            if self.hf is None:
                raise ValueError(f"init.megatron={self.megatron!r} without init.hf: the model description, the "
                                 "engines' weights and the tokenizer come from the HF checkpoint; set init.hf too")
            if not Path(self.megatron).is_dir():
                raise ValueError(f"init.megatron={self.megatron!r}: expected an existing Megatron checkpoint directory")
        if self.adapter is not None and not (Path(self.adapter) / "adapter_config.json").is_file():
            raise ValueError(f"init.adapter={self.adapter!r}: expected a PEFT adapter directory with adapter_config.json")

    def model_spec(self) -> Any:
        """The model description of `hf` (its config.json)."""
        assert self.hf is not None
        return spec_from_hf_config(read_hf_config(self.hf), name=Path(self.hf).resolve().name)


def fingerprint(hf_dir: str | Path) -> str:
    """Changes when config.json or any weight file changes (name, size, mtime)."""
    d = Path(hf_dir)
    h = hashlib.sha256(CONVERTER_VERSION.encode())
    h.update((d / "config.json").read_bytes())
    for p in sorted(d.iterdir()):
        if p.name.endswith((".safetensors", ".safetensors.index.json")):
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _convert(hf_dir: str, out_dir: str) -> str:
    from moe_grpo.checkpoint.convert import hf_to_megatron

    hf_to_megatron(hf_dir, out_dir, progress=False)
    return out_dir


class ConversionStopped(RuntimeError):
    """`cached_megatron`'s `stop` was set before the conversion began."""


def _lock(lock: Any, stop: threading.Event | None) -> None:
    """The cache's lock, waited for (another run may be converting the same checkpoint: minutes); `stop` ends the
    wait, so a run stopped meanwhile does not wait for the other run's conversion to end."""
    if stop is None:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stop.wait(0.2):
                raise ConversionStopped("stopped while another process held the conversion cache's lock") from None


def cached_megatron(hf_dir: str | Path, cache_root: str | Path, *, timeout_s: float = 3600.0,
                    stop: threading.Event | None = None) -> Path:
    """The Megatron checkpoint converted from `hf_dir`: reused from `cache_root` or converted there now.
    `stop` (set from another thread) ends a conversion under way: its process is killed, nothing enters the cache."""
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{Path(hf_dir).resolve().name}-{fingerprint(hf_dir)}"
    with open(root / ".lock", "w") as lock:
        _lock(lock, stop)  # two runs starting from the same checkpoint convert it once
        if (target / ".complete").is_file():
            log.info("init: reusing the Megatron checkpoint %s (converted from %s)", target, hf_dir)
            return target
        staging = root / f".{target.name}.converting"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        if stop is not None and stop.is_set():
            raise ConversionStopped(f"conversion of {hf_dir} stopped before it started")
        t0 = time.perf_counter()
        # A child process: conversion initialises torch.distributed and megatron, which the driver keeps out of.
        run_distributed(_convert, 1, str(hf_dir), str(staging), timeout_s=timeout_s, start_method="spawn", stop=stop)
        (staging / ".complete").write_text(json.dumps({"hf": str(Path(hf_dir).resolve()), "time": time.time()}))
        os.replace(staging, target)
        log.info("init: converted %s to a Megatron checkpoint in %.1fs: %s", hf_dir, time.perf_counter() - t0, target)
        return target


def engine_dir(hf_dir: str | Path, spec: MoEModelSpec, out_dir: str | Path) -> Path:
    """A view of `hf_dir` that vLLM loads: its files linked, config.json completed with what vLLM needs.

    transformers' `save_pretrained` leaves out keys vLLM reads (DeepSeek-V3's `topk_method: noaux_tc` and
    `scoring_func: sigmoid`; without them vLLM builds no e_score_correction_bias and fails to load). The
    checkpoint's own keys win; only missing ones are filled from the model description."""
    src, out = Path(hf_dir).resolve(), Path(out_dir)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for p in src.iterdir():
        if p.name != "config.json":
            (staging / p.name).symlink_to(p)
    original = read_hf_config(src)
    derived = {k: v for k, v in hf_config_from_spec(spec).items() if v is not None}
    (staging / "config.json").write_text(json.dumps({**derived, **original}, indent=2, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(staging, out)
    return out


def default_cache_dir(run_dir: str | Path) -> Path:
    """`megatron_cache` next to the run directory, or next to its date folder when its parent is named as Hydra's
    default names one (`%Y-%m-%d`): a run the next day reuses the conversion instead of making it again."""
    parent = Path(run_dir).resolve().parent
    if re.fullmatch(r"\d{4}-\d{2}-\d{2}", parent.name):
        parent = parent.parent
    return parent / "megatron_cache"


class LearnerStartCheckpoint:
    """The Megatron checkpoint the learner ranks load before the first step: `init.megatron`, or `init.hf`
    converted (or found in the cache) on a thread while Ray, the engines' actors and the learner ranks start, none of
    which needs it; the ranks load it once they are up (`InitialWeights`). On a host with cores to spare the
    conversion (minutes for a large checkpoint) overlaps the actors' start; on 2 cores, busy starting them, it
    gained nothing measurable (test_hf_runs: pools up in 33 s with a 9.7 s conversion, 9.9 s + 23 s before)."""

    def __init__(self, init: InitConfig, run_dir: str | Path) -> None:
        self._given = init.megatron
        self._stop = threading.Event()
        self._conversion: futures.Future[Path] | None = None
        if init.hf and not init.megatron:
            cache = Path(init.cache_dir) if init.cache_dir else default_cache_dir(run_dir)
            converter = futures.ThreadPoolExecutor(1, thread_name_prefix="moe_grpo-convert")
            self._conversion = converter.submit(cached_megatron, init.hf, cache, stop=self._stop)
            converter.shutdown(wait=False)  # its thread ends with the conversion

    def path(self) -> str | None:
        """The checkpoint's directory once it exists (waits for the conversion; raises what it raised); None without
        `init.hf`."""
        if self._conversion is None:
            return self._given
        t0 = time.perf_counter()
        done = self._conversion.done()
        path = self._conversion.result()
        if not done:
            log.info("init: the learner ranks were up %.1f s before the conversion finished", time.perf_counter() - t0)
        return str(path)

    def close(self) -> None:
        """A conversion still running (the run ended during its start) is stopped, its process killed."""
        if self._conversion is not None and not self._conversion.done():
            self._stop.set()
            try:
                self._conversion.result(timeout=60)
            except futures.TimeoutError:
                log.warning("init: the conversion did not stop within 60 s; the process exits once it has")
            except Exception:  # noqa: BLE001 - what it raised was the start's to report; the run is ending
                pass


def copy_tokenizer(hf_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the checkpoint's tokenizer (and generation defaults) files into `out_dir`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        p = Path(hf_dir) / name
        if p.is_file():
            shutil.copyfile(p, Path(out_dir) / name)
            copied.append(name)
    return copied
