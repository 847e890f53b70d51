"""Applying LoRA adapters through vLLM's LoRA serving (`sync.lora_apply=serve`): the engine-side bookkeeping.

Each version's adapters become one vLLM LoRA adapter (a PEFT directory the engine writes, loaded by
`AsyncLLM.add_lora` before any request uses it), and every request names the adapter of the version
current when it was submitted. The base weights are the ones the engine started with and never change.
Compared with merging (rollout/lora_merge.py) nothing in the served weights is rewritten, so:

- a version that fails to load leaves the engine on the one it served (nothing to roll back);
- with `on_update=keep` requests in flight finish on their own adapter instead of switching weights
  mid-sequence, so every token of a request is of the version it started on (its per-token versions
  say so); `abort` ends them and they are resubmitted on the new adapter, as with full weights;
- every forward pays for the low-rank products (vLLM's punica ops) instead of a one-off merge.

vLLM 0.32 on CPU serves adapters on linear layers only: its CPU punica wrapper has no fused-MoE LoRA
op, so routed experts (`lora.targets` with `experts`) are refused there (vllm_patches.py
`cpu_moe_without_expert_lora` keeps the CPU experts kernel when they are not targets).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_grpo.learner.lora_config import LoraConfig
    from moe_grpo.models.spec import MoEModelSpec

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for `max_lora_rank` (config/lora.py `MaxLoRARanks`)."""

MAX_SERVED_ADAPTERS = 2
"""vLLM's `max_loras`: adapters in one batch - the current version's and the one `keep` requests finish on."""


def max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"lora.rank={rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]}; "
                     "use sync.lora_apply=merge")


def check_servable(targets: tuple[str, ...], on_gpu: bool) -> None:
    """Refuse what vLLM 0.32 cannot serve: routed-expert adapters on CPU."""
    if "experts" in targets and not on_gpu:
        raise ValueError(f"lora.targets={list(targets)} with sync.lora_apply=serve: vLLM 0.32 on CPU has no LoRA op "
                         "for fused MoE experts, so routed-expert adapters cannot be served; use "
                         "sync.lora_apply=merge, or drop 'experts' from lora.targets")


def target_modules(adapted_hf: list[str]) -> list[str]:
    """vLLM's deploy-time `lora_target_modules`: the module suffixes of the adapted HF weights
    (`model.layers.0.self_attn.q_proj.weight` -> `q_proj`). Leaving `experts` and the router's `gate` out
    keeps vLLM from wrapping them."""
    names = {name.removesuffix(".weight").split(".")[-1] for name in adapted_hf}
    if not names:
        raise ValueError("no adapted weights: nothing for vLLM's LoRA serving to target")
    return sorted(names)


@dataclass
class ServedAdapter:
    """One version's adapter as vLLM knows it."""

    version: int
    request: Any
    """The vLLM LoRARequest requests of this version carry."""
    directory: Path
    owned: bool
    """Whether the engine wrote `directory` (and removes it when the adapter is retired)."""
    in_flight: int = 0


@dataclass
class ServedAdapters:
    """The adapters an engine's vLLM holds: the current version's, and older ones while requests use them."""

    root: Path
    """Where this engine writes each version's PEFT directory (removed at shutdown)."""
    current: ServedAdapter | None = None
    older: dict[int, ServedAdapter] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    @classmethod
    def under(cls, parent: str | None, name: str) -> ServedAdapters:
        return cls(Path(tempfile.mkdtemp(prefix=f"moe_grpo-lora-{name}-", dir=parent)))

    def prepare(self, version: int, directory: str | Path | None = None, state: dict | None = None, *,
                spec: MoEModelSpec | None = None, lora: LoraConfig | None = None) -> ServedAdapter:
        """The adapter of `version`: an existing PEFT directory, or `state` (PEFT names -> whole A / B)
        written as one under `root`. Not served until `switch`."""
        from vllm.lora.request import LoRARequest

        lora_id = next(self._ids)  # vLLM's id of an adapter; never reused, so a cached old one is never served
        owned = directory is None
        if owned:
            from moe_grpo.checkpoint.peft import write_peft_adapter

            # Routed experts (served on GPU only) one module adapter per expert, the form vLLM's MoE LoRA reads.
            directory = write_peft_adapter(self.root / f"v{version}-{lora_id}", state, spec, lora, experts="per_expert")
        request = LoRARequest(f"moe_grpo-v{version}-{lora_id}", lora_id, str(directory))
        return ServedAdapter(version, request, Path(directory), owned)

    def switch(self, adapter: ServedAdapter) -> list[ServedAdapter]:
        """Make `adapter` the one new requests use; returns the adapters no request uses any more (to remove)."""
        if self.current is not None:
            self.older[self.current.request.lora_int_id] = self.current
        self.current = adapter
        return self._idle()

    def acquire(self) -> ServedAdapter | None:
        """The current adapter, counted as used by one more request (None: no adapter, the base model)."""
        if self.current is not None:
            self.current.in_flight += 1
        return self.current

    def release(self, adapter: ServedAdapter | None) -> list[ServedAdapter]:
        """A request that used `adapter` ended; returns the adapters no request uses any more."""
        if adapter is None:
            return []
        adapter.in_flight -= 1
        return self._idle()

    def _idle(self) -> list[ServedAdapter]:
        idle = [a for a in self.older.values() if a.in_flight <= 0]
        for a in idle:
            del self.older[a.request.lora_int_id]
        return idle

    def discard(self, adapter: ServedAdapter) -> None:
        """Remove what the engine wrote for `adapter` (vLLM no longer holds it)."""
        if adapter.owned:
            shutil.rmtree(adapter.directory, ignore_errors=True)

    def reset(self) -> None:
        """A new vLLM process holds no adapters: forget them all (requests in flight were lost with the old one)."""
        for adapter in [*self.older.values(), *([self.current] if self.current else [])]:
            self.discard(adapter)
        self.older.clear()
        self.current = None

    def close(self) -> None:
        self.reset()
        shutil.rmtree(self.root, ignore_errors=True)
