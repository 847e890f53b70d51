"""Reading and writing Hugging Face safetensors directories, tensor by tensor, with precise errors.

Headers of every file are checked before any tensor is read (truncation,
corrupt headers, offsets past the end of the file, dtype/shape that do not
add up), so a bad checkpoint fails before anything is written.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
_TORCH_DTYPE = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


class CheckpointFileError(ValueError):
    """A safetensors file or index that is truncated, corrupt, or does not match the model."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    """Byte offset of the tensor's data from the start of the file."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPE[self.dtype]

    @property
    def nbytes(self) -> int:
        n = _DTYPE_BYTES[self.dtype]
        for s in self.shape:
            n *= s
        return n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointFileError(f"{path}: {size} bytes, too short for a safetensors header (truncated?)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > size - 8 or hlen > 100_000_000:
            raise CheckpointFileError(f"{path}: header length {hlen} exceeds the file ({size} bytes): truncated or corrupt")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointFileError(f"{path}: header is not valid JSON ({e}): corrupt file") from e
    data_size = size - 8 - hlen
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointFileError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from e
        if dtype not in _DTYPE_BYTES:
            raise CheckpointFileError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        info = TensorInfo(path, dtype, shape, 8 + hlen + int(start))
        if end > data_size:
            raise CheckpointFileError(
                f"{path}: tensor {name!r} ends at byte {end} of the data section but the file holds {data_size}: truncated")
        if end - start != info.nbytes:
            raise CheckpointFileError(
                f"{path}: tensor {name!r} spans {end - start} bytes but dtype {dtype} x shape {list(shape)} needs {info.nbytes}")
        out[name] = info
    return out


class SafetensorsDir:
    """All tensors of an HF checkpoint directory, read one at a time."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no checkpoint directory at {self.directory}")
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointFileError(f"{index}: not a valid safetensors index ({e})") from e
            files = sorted({self.directory / f for f in weight_map.values()})
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self.tensors: dict[str, TensorInfo] = {}
        for f in files:
            if not f.is_file():
                raise CheckpointFileError(f"{index}: lists {f.name}, which does not exist")
            for name, info in read_header(f).items():
                if name in self.tensors:
                    raise CheckpointFileError(f"tensor {name!r} appears in both {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = info
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self.tensors:
                    raise CheckpointFileError(f"{index}: maps {name!r} to {fname}, which does not hold it")

    def require(self, names: Iterable[str]) -> None:
        missing = sorted(set(names) - set(self.tensors))
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointFileError(f"{self.directory}: missing tensor(s) {missing[:5]}{more}")

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh memory.

        Plain reads rather than safetensors' memory map: mapped pages stay
        resident (and count against the process) while any tensor viewing
        them lives, which defeats streaming on large checkpoints.
        """
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointFileError(f"{self.directory}: missing tensor {name!r}")
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        try:
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                got = f.readinto(memoryview(buf.numpy()))
        except OSError as e:
            raise CheckpointFileError(f"{info.file}: cannot read tensor {name!r} ({e})") from e
        if got != info.nbytes:
            raise CheckpointFileError(f"{info.file}: tensor {name!r} is cut short ({got} of {info.nbytes} bytes): truncated")
        return buf.view(info.torch_dtype).reshape(info.shape)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class ShardedSafetensorsWriter:
    """Writes tensors into numbered safetensors files plus the HF index, one file per `flush`."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.weight_map: dict[str, str] = {}
        self.files: list[str] = []
        self.total_size = 0

    def write_file(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        if not tensors:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.directory / name), metadata={"format": "pt"})
        self.files.append(name)
        for k, v in tensors.items():
            self.weight_map[k] = name
            self.total_size += v.numel() * v.element_size()

    def finish(self) -> None:
        n = len(self.files)
        renamed = {}
        for i, old in enumerate(self.files):
            new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.directory / old, self.directory / new)
            renamed[old] = new
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": {k: renamed[v] for k, v in sorted(self.weight_map.items())}}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
