"""A binary file that hashes what is written through it: its checksum costs no second read of the file."""

from __future__ import annotations

import hashlib
from typing import Any


class HashingWriter:
    """Wraps a binary file: every `write` also updates `hash` (sha256) and `size`; anything else (tell, flush,
    fileno, close) goes to the file. The run checkpoint's driver state and megatron-core's shard writer
    (learner/megatron_write_digests.py) are written through it."""

    def __init__(self, file: Any) -> None:
        self.file, self.hash, self.size = file, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hash.update(view)
        self.size += view.nbytes
        return self.file.write(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)
