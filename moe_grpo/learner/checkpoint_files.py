"""Checks of a learner checkpoint's files before anything is loaded from it, and the error that names a bad one.

A run-state directory (`checkpoint_io.save_run_state`) holds `learner_meta.json` (written last: it lists every
other file with its size), `dist/` (a Megatron distributed checkpoint) and one `rng_rank{N}.pt` per global rank.
Everything here reads files only; `on_every_rank` is the one collective, so that a file only some ranks read
fails every rank alike.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader

RUN_STATE_META = "learner_meta.json"
"""Written last by `save_run_state`: without it (or with a broken one) the directory is an incomplete save."""
RUN_STATE_DIST = "dist"
"""The Megatron distributed checkpoint inside a run-state directory (weights, optimizer state, reference)."""
RUN_STATE_FORMAT = 1


class IncompleteCheckpointError(RuntimeError):
    """A learner checkpoint cannot be used: a file is missing, truncated or unreadable. `path` names it."""

    def __init__(self, path: str, why: str) -> None:
        self.path, self.why = str(path), why
        super().__init__(f"incomplete learner checkpoint: {self.path}: {why}")


def on_every_rank(check: Callable[[], Any]) -> Any:
    """Collective: `check()` on every rank; when it raised on any rank, raise on every rank (the first failing
    rank's error), so that no rank goes on into a collective load that the others have given up on."""
    try:
        result, error = check(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        result, error = None, e
    report = None
    if error is not None:
        report = (type(error).__name__, getattr(error, "path", None), getattr(error, "why", None), str(error))
    reports: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(reports, report)
    if error is not None:
        raise error
    for rank, rep in enumerate(reports):
        if rep is not None:
            kind, path, why, text = rep
            if path is not None and why is not None:
                raise IncompleteCheckpointError(path, f"{why} (seen by rank {rank})")
            cls = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}.get(kind, RuntimeError)
            raise cls(f"rank {rank}: {text}")
    return result


def why(error: BaseException) -> str:
    """One line about `error` (torch.distributed.checkpoint's CheckpointException: each rank's first failure)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        return "; ".join(f"rank {r}: {why(x)}" for r, x in zip(failures, inner))
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def check_file(path: str, size: int | None = None) -> None:
    """`path` exists, is not empty and, when `size` is given, has exactly that many bytes."""
    if not os.path.isfile(path):
        raise IncompleteCheckpointError(path, "missing")
    actual = os.path.getsize(path)
    if size is not None and actual != size:
        raise IncompleteCheckpointError(path, f"{actual} bytes where {size} were written (truncated or overwritten)")
    if size is None and actual == 0:
        raise IncompleteCheckpointError(path, "empty")


def read_run_state_meta(directory: str) -> dict[str, Any]:
    """`learner_meta.json` of a run-state directory, checked for the keys `load_run_state` reads."""
    path = os.path.join(directory, RUN_STATE_META)
    check_file(path)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise IncompleteCheckpointError(path, f"not readable JSON ({e})") from e
    need = ("format", "layout", "step_count", "lr", "adam_step", "has_reference", "files")
    missing = [k for k in need if k not in meta] if isinstance(meta, dict) else list(need)
    if missing:
        raise IncompleteCheckpointError(path, f"lacks {missing}")
    if meta["format"] != RUN_STATE_FORMAT:
        raise ValueError(f"{path}: run-state format {meta['format']}, this code reads format {RUN_STATE_FORMAT}")
    return meta


def check_dist_checkpoint_files(directory: str) -> None:
    """Every file a Megatron (torch_dist) checkpoint needs is present and long enough: `metadata.json`,
    `common.pt`, torch.distributed.checkpoint's `.metadata` and each data file it points into."""
    if not os.path.isdir(directory):
        raise IncompleteCheckpointError(directory, "missing")
    for name in ("metadata.json", "common.pt", ".metadata"):
        check_file(os.path.join(directory, name))
    path = os.path.join(directory, "metadata.json")
    try:
        with open(path) as f:
            json.load(f)
    except (OSError, ValueError) as e:
        raise IncompleteCheckpointError(path, f"not readable JSON ({e})") from e
    path = os.path.join(directory, "common.pt")
    try:
        torch.load(path, map_location="cpu")  # small (the non-tensor state); Megatron reads it this way
    except Exception as e:
        raise IncompleteCheckpointError(path, f"unreadable ({why(e)})") from e
    _check_data_files(directory)


def _check_data_files(directory: str) -> None:
    """Each data file torch.distributed.checkpoint's `.metadata` points into is there and reaches the last byte."""
    path = os.path.join(directory, ".metadata")
    try:
        storage = FileSystemReader(directory).read_metadata().storage_data or {}
    except Exception as e:
        raise IncompleteCheckpointError(path, f"unreadable ({why(e)})") from e
    needed: dict[str, int] = {}
    for info in storage.values():
        rel = str(info.relative_path)
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(needed.items()):
        data = os.path.join(directory, rel)
        if not os.path.isfile(data):
            raise IncompleteCheckpointError(data, "missing (listed in .metadata)")
        if os.path.getsize(data) < end:
            raise IncompleteCheckpointError(data, f"{os.path.getsize(data)} bytes, .metadata points up to byte {end} "
                                                  "(truncated)")
