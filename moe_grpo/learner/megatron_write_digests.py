"""Hash each shard file megatron-core's checkpoint writer writes, as it writes it (megatron-core 0.16.1).

A run checkpoint's manifest holds every file's sha256 (orchestrator/run_checkpoint.py). The learner ranks' shard
files (`*.distcp`) are written by megatron-core's `FileSystemWriterAsync.write_preloaded_data`, in writer
processes it forks; hashing them afterwards means reading every byte a second time, which for a real model's
checkpoint (hundreds of GB) costs as long as writing it. This patch hashes the bytes on their way to the file
instead: inside `recording(directory)`, each file the writer opens under `directory` is wrapped so that every
`write` also updates a sha256, and when the writer closes it (after its own fsync) a digest file
`<file>.sha256` holding `{"size": ..., "sha256": ...}` is left beside it. `run_checkpoint.finish` takes those
digests (and removes the digest files) instead of reading the shards back; a file without one, or whose size
disagrees, is hashed the old way. Loading still reads and checks every byte against the manifest.

The patched line, in megatron/core/dist_checkpointing/strategies/filesystem_async.py of 0.16.1:
`write_preloaded_data` does `open_file = open` (a module-global lookup that falls through to the builtin) and
writes each bucket through `with open_file(file_name, "wb") as stream:`, sequentially, calling only `tell`,
`write`, `flush` and `fileno` on it. `apply()` gives that module its own `open`, which is the builtin except
while `recording` is active for the path. Other writers in the same process (checkpoint conversion, exports)
never see a wrapped file. `apply()` refuses another megatron-core version and a writer whose source no longer
has that line.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from moe_grpo.hashing import HashingWriter

TARGET_VERSION = "0.16.1"
DIGEST_SUFFIX = ".sha256"
"""A digest file is `<shard file>` + this suffix, in the same directory."""
_PATCHED_MODULE = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_PATCHED_LINE = "open_file = open"

_recording: list[str] = []
"""Directories (absolute, with a trailing separator) whose files the writer hashes; set before the save forks its
writer processes, so they inherit it."""


@dataclass(frozen=True)
class Digest:
    size: int
    sha256: str


class _HashingStream(HashingWriter):
    """The writer's binary file, hashing what goes through `write`; leaves the digest file on a clean close."""

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file)
        self._path = path

    def __enter__(self) -> "_HashingStream":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.file.close()
        if exc_type is None:  # a failed write leaves no digest: finish() hashes the file (if it is ever finished)
            _write_digest(self._path, Digest(self.size, self.hash.hexdigest()))


def _write_digest(path: str, digest: Digest) -> None:
    with builtins.open(path + DIGEST_SUFFIX, "w") as f:
        json.dump({"size": digest.size, "sha256": digest.sha256}, f)


def read_digest(digest_file: str | os.PathLike[str]) -> Digest | None:
    """What a digest file says, or None where it is unreadable (the shard is then hashed by reading it)."""
    try:
        with builtins.open(digest_file) as f:
            record = json.load(f)
        return Digest(int(record["size"]), str(record["sha256"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    """The builtin `open`, hashing a file opened for writing under a recorded directory."""
    f = builtins.open(file, mode, *args, **kwargs)
    if mode == "wb" and _recording and isinstance(file, (str, os.PathLike)):
        path = os.path.abspath(os.fspath(file))
        if any(path.startswith(d) for d in _recording):
            return _HashingStream(f, path)
    return f


def _writer_module() -> Any:
    return importlib.import_module(_PATCHED_MODULE)


def apply() -> bool:
    """Give megatron-core's checkpoint writer the hashing `open`; True when this call installed it. Idempotent."""
    from moe_grpo.learner.megatron_cpu import megatron_version

    version = megatron_version()
    if version != TARGET_VERSION:
        raise RuntimeError(f"moe_grpo.learner.megatron_write_digests targets megatron-core=={TARGET_VERSION}, found "
                           f"{version}; re-read FileSystemWriterAsync.write_preloaded_data before changing it")
    module = _writer_module()
    if module.__dict__.get("open") is _open:
        return False
    source = inspect.getsource(module.FileSystemWriterAsync.write_preloaded_data)
    if _PATCHED_LINE not in source:
        raise RuntimeError(f"{_PATCHED_MODULE}.FileSystemWriterAsync.write_preloaded_data no longer has "
                           f"{_PATCHED_LINE!r}; the shard-digest patch does not apply")
    module.open = _open
    return True


def revert() -> None:
    """Take the hashing `open` away from the writer (tests use it to show the patch is what leaves digests)."""
    module = _writer_module()
    if module.__dict__.get("open") is _open:
        del module.open


def applied() -> bool:
    return _writer_module().__dict__.get("open") is _open


@contextlib.contextmanager
def recording(directory: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, shard files the (patched) writer writes under `directory` leave digest files."""
    root = os.path.join(os.path.abspath(os.fspath(directory)), "")
    _recording.append(root)
    try:
        yield
    finally:
        _recording.remove(root)
