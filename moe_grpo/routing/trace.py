"""The routing trace: which experts each MoE layer chose for every position.

Contract (docs/reference/trace-format.md): an integer array
`[positions, moe_layers, topk]` of logical expert ids, one row per position
that went through the model during rollout (every prompt token and every
generated token except the last), MoE layers only, in model order. uint8 when
the model has at most 256 routed experts, else int16 (ids up to 32767; no
published MoE has more experts).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np


class RoutingTraceError(ValueError):
    """A routing trace that does not fit its sequence or model."""


def trace_dtype(num_experts: int) -> np.dtype:
    """uint8 for <= 256 routed experts, int16 above (up to 32768)."""
    if num_experts <= 0:
        raise RoutingTraceError(f"num_experts={num_experts}, expected a positive integer")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise RoutingTraceError(f"num_experts={num_experts}, expected at most 32768")


@dataclass(frozen=True)
class RoutingTrace:
    """Expert ids `[positions, moe_layers, topk]` for one sequence."""

    expert_ids: np.ndarray
    """Logical expert ids, dtype from `trace_dtype(num_experts)`."""
    num_experts: int
    """Routed experts per MoE layer of the model that produced the trace."""

    @property
    def num_positions(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def num_moe_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def bytes_per_token(self) -> int:
        """Storage cost of one position (moe_layers * topk * itemsize)."""
        return self.num_moe_layers * self.top_k * self.expert_ids.dtype.itemsize

    @classmethod
    def from_array(cls, ids: np.ndarray | "object", num_experts: int) -> "RoutingTrace":
        """Wrap any integer array (numpy or torch) as a trace in the contract's dtype.

        Values are range-checked before narrowing so that a wrong id is
        reported rather than silently wrapped.
        """
        try:
            import torch

            if isinstance(ids, torch.Tensor):
                ids = ids.detach().cpu().numpy()
        except ImportError:  # pragma: no cover - torch is a hard dependency
            pass
        arr = np.asarray(ids)
        if arr.ndim != 3:
            raise RoutingTraceError(f"routing trace has shape {arr.shape}, expected 3 dims [positions, moe_layers, topk]")
        if arr.dtype.kind not in "iu":
            raise RoutingTraceError(f"routing trace dtype {arr.dtype}, expected an integer type")
        if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
            bad = int(arr.max()) if arr.max() >= num_experts else int(arr.min())
            raise RoutingTraceError(f"expert id {bad} out of range, expected 0 <= id < num_experts={num_experts}")
        return cls(arr.astype(trace_dtype(num_experts), copy=False), num_experts)

    def validate(self, *, num_positions: int, num_moe_layers: int, top_k: int, num_experts: int) -> None:
        """Refuse a trace that does not fit its sequence and model; names the field that is off."""
        ids = self.expert_ids
        if ids.ndim != 3:
            raise RoutingTraceError(f"routing trace has shape {ids.shape}, expected 3 dims [positions, moe_layers, topk]")
        if self.num_experts != num_experts:
            raise RoutingTraceError(f"routing trace num_experts={self.num_experts}, expected {num_experts}")
        expected_dtype = trace_dtype(num_experts)
        if ids.dtype != expected_dtype:
            raise RoutingTraceError(f"routing trace dtype {ids.dtype}, expected {expected_dtype} for {num_experts} experts")
        if self.num_positions != num_positions:
            raise RoutingTraceError(
                f"routing trace positions={self.num_positions}, expected {num_positions} "
                "(prompt tokens + generated tokens - 1)"
            )
        if self.num_moe_layers != num_moe_layers:
            raise RoutingTraceError(
                f"routing trace moe_layers={self.num_moe_layers}, expected {num_moe_layers} (MoE layers only, no dense layers)"
            )
        if self.top_k != top_k:
            raise RoutingTraceError(f"routing trace topk={self.top_k}, expected {top_k}")
        if ids.size == 0:
            return
        wide = ids.astype(np.int64)
        if wide.max() >= num_experts or wide.min() < 0:
            bad = int(wide.max()) if wide.max() >= num_experts else int(wide.min())
            where = np.argwhere((wide >= num_experts) | (wide < 0))[0]
            raise RoutingTraceError(
                f"routing trace expert id {bad} at (position {where[0]}, moe_layer {where[1]}) out of range, "
                f"expected 0 <= id < num_experts={num_experts}"
            )
        if top_k > 1:
            srt = np.sort(wide, axis=-1)
            dup = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))
            if len(dup):
                p, layer = dup[0]
                raise RoutingTraceError(
                    f"routing trace repeats expert id {int(srt[p, layer][np.argmax(srt[p, layer, 1:] == srt[p, layer, :-1])])} "
                    f"within a token at (position {p}, moe_layer {layer}), expected {top_k} distinct ids"
                )

    # ---- serialisation -------------------------------------------------------------
    def pack(self) -> bytes:
        """Compact bytes: a small .npy header plus the raw ids (no pickling)."""
        buf = io.BytesIO()
        np.save(buf, self.expert_ids, allow_pickle=False)
        return self.num_experts.to_bytes(4, "little") + buf.getvalue()

    @classmethod
    def unpack(cls, data: bytes) -> "RoutingTrace":
        if len(data) < 4:
            raise RoutingTraceError(f"packed routing trace is {len(data)} bytes, expected a 4-byte header and an array")
        num_experts = int.from_bytes(data[:4], "little")
        try:
            ids = np.load(io.BytesIO(data[4:]), allow_pickle=False)
        except ValueError as e:
            raise RoutingTraceError(f"packed routing trace is corrupt: {e}") from e
        trace = cls(ids, num_experts)
        if ids.dtype != trace_dtype(num_experts):
            raise RoutingTraceError(f"packed routing trace dtype {ids.dtype}, expected {trace_dtype(num_experts)}")
        return trace


def save_traces(path: str, traces: "list[RoutingTrace]") -> None:
    """Several traces (one per sequence) in one .npz file; written to a temp file and renamed."""
    if not traces:
        raise RoutingTraceError("no traces to save")
    experts = {t.num_experts for t in traces}
    if len(experts) != 1:
        raise RoutingTraceError(f"traces disagree on num_experts: {sorted(experts)}")
    tmp = f"{path}.tmp.npz"
    np.savez(tmp, num_experts=np.int64(experts.pop()), **{f"seq{i}": t.expert_ids for i, t in enumerate(traces)})
    os.replace(tmp, path)


def load_traces(path: str) -> "list[RoutingTrace]":
    """Traces saved by `save_traces`, in order."""
    try:
        data = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise RoutingTraceError(f"{path}: not a routing-trace file ({e})") from e
    if "num_experts" not in data:
        raise RoutingTraceError(f"{path}: no 'num_experts' entry; expected a file written by save_traces")
    n = int(data["num_experts"])
    keys = sorted((k for k in data.files if k.startswith("seq")), key=lambda k: int(k[3:]))
    return [RoutingTrace.from_array(data[k], n) for k in keys]
