"""Applying LoRA adapters to an engine by merging (`sync.lora_apply=merge`): the worker-side arithmetic, torch only.

Inside each vLLM worker, `MergedWeights` keeps an exact copy of W0 for every adapted HF weight (host memory:
the adapted weights' bytes in the model's dtype, e.g. every routed expert's gate/up/down plus the attention
projections with `lora.targets` at its default) and, for each adapter version, computes
`W = W0 + (alpha / r) * B @ A` from that copy (in fp32, stored in W0's dtype), never from the weights being
served: a version's weights depend on that version's adapters only, never on the versions before it.

The merged tensors go back through vLLM's `reload_weights` one decoder layer at a time. vLLM's layer-wise
reload processes a module (a fused `qkv_proj`, `gate_up_proj`, a `FusedMoE` holding all experts of a layer)
once all its elements have arrived and puts back the old kernel tensors of a module that got none; a module
that got only part of its elements would be processed with the rest uninitialised. The adapted HF weights
always form whole vLLM modules: `lora.targets` adapts whole Megatron layers (q, k, v together; gate and up
together; every expert of every MoE layer), which are the modules vLLM fuses.
"""

from __future__ import annotations

import re
from typing import Iterator, Mapping

import torch

from moe_grpo.models.peft_names import PEFT_PREFIX

_LAYER = re.compile(r"^(model\.layers\.\d+)\.")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def adapter_weight(peft_name: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (`<module>.weight`, 'A')."""
    if not peft_name.startswith(PEFT_PREFIX) or not peft_name.endswith((".lora_A.weight", ".lora_B.weight")):
        raise ValueError(f"{peft_name!r} is no PEFT LoRA tensor name (base_model.model.<module>.lora_A/B.weight)")
    module, factor = peft_name.removeprefix(PEFT_PREFIX).removesuffix(".weight").rsplit(".lora_", 1)
    return f"{module}.weight", factor


def is_adapter_name(name: str) -> bool:
    return name.startswith(PEFT_PREFIX)


def on_stage(weight: str, start: int, end: int | None) -> bool:
    """Whether the HF weight `weight` lies in a pipeline stage's decoder layers [start, end) (end None: to the last;
    a name outside the layer stack: on every stage)."""
    m = _LAYER_INDEX.match(weight)
    return m is None or (start <= int(m.group(1)) and (end is None or int(m.group(1)) < end))


class MergedWeights:
    """W0 of every adapted HF weight, and the merged weights of an adapter version computed from it."""

    def __init__(self, adapted: list[str]) -> None:
        """`adapted`: the HF weights this worker merges (none: a pipeline stage whose layers hold no adapter)."""
        self.adapted = list(adapted)
        self._adapted = set(adapted)
        self.base: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        """Host memory the copies of W0 take."""
        return sum(t.numel() * t.element_size() for t in self.base.values())

    def keep(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy W0 of every adapted weight among `tensors` (HF names; a base version's or the model directory's
        tensors). Returns how many were copied."""
        n = 0
        for name, t in tensors.items():
            if name in self._adapted:
                held = self.base.get(name)
                if held is not None and held.shape == t.shape and held.dtype == t.dtype:
                    held.copy_(t)
                else:
                    self.base[name] = t.detach().to("cpu", copy=True).contiguous()
                n += 1
        return n

    def merged(self, adapter: Mapping[str, torch.Tensor], scale: float) -> Iterator[dict[str, torch.Tensor]]:
        """`W0 + scale * B @ A` of every adapted weight, one decoder layer (whole vLLM modules) at a time.

        `adapter` must hold A and B of exactly the adapted weights (PEFT names); the error names what differs."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in adapter.items():
            weight, factor = adapter_weight(key)
            pairs.setdefault(weight, {})[factor] = t
        extra, missing = sorted(set(pairs) - self._adapted), sorted(self._adapted - set(pairs))
        if extra or missing:
            raise ValueError(f"the adapter does not fit the engine's adapted weights: unexpected {extra[:3]} "
                             f"({len(extra)}), missing {missing[:3]} ({len(missing)})")
        absent = [w for w in self.adapted if w not in self.base]
        if absent:
            raise RuntimeError(f"no copy of the base weight {absent[0]!r} ({len(absent)} missing): the worker "
                               "loaded no base version")
        groups: dict[str, list[str]] = {}
        for weight in self.adapted:
            m = _LAYER.match(weight)
            groups.setdefault(m.group(1) if m else weight, []).append(weight)
        for names in groups.values():
            out = {}
            for weight in names:
                factors = pairs[weight]
                if set(factors) != {"A", "B"}:
                    raise ValueError(f"{weight}: the adapter has lora_{''.join(factors)} only, expected A and B")
                w0 = self.base[weight]
                delta = factors["B"].float() @ factors["A"].float()
                if tuple(delta.shape) != tuple(w0.shape):
                    raise ValueError(f"{weight}: B @ A is {list(delta.shape)}, the base weight {list(w0.shape)}")
                out[weight] = (w0.float() + scale * delta).to(w0.dtype)
            yield out
