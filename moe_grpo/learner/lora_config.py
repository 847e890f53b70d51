"""The `lora` config section (torch-free, so configs load fast). The adapters themselves: learner/lora.py."""

from __future__ import annotations

from dataclasses import dataclass

from moe_grpo.validate import at_least, between, positive

LORA_TARGETS = ("attention", "dense_mlp", "experts", "shared_experts")
"""`lora.targets`: groups of linear layers that get adapters.

- attention: the attention projections (q, k, v and o; for MLA models the q/kv down and up projections and o);
- dense_mlp: gate, up and down of the dense MLP layers (DeepSeek's first-k-dense);
- experts: gate, up and down of every routed expert, one adapter per expert;
- shared_experts: gate, up and down of the shared experts.
The router is never a target: it stays frozen (learner/lora.py says why)."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters in the Megatron learner (learner/lora.py); `rank: 0` trains the full model."""

    rank: int = 0
    """Adapter rank r; 0 = no adapters (full fine-tuning). With r > 0 every base weight (embeddings, norms, router,
    output layer included) is frozen and only the adapters train."""
    alpha: float = 16.0
    """Scale numerator: an adapter adds (alpha / rank) * B A x (PEFT's `lora_alpha`, without rsLoRA)."""
    dropout: float = 0.0
    """Dropout on an adapter's input in training (PEFT's `lora_dropout`); 0 keeps the step layout-invariant."""
    targets: tuple[str, ...] = LORA_TARGETS
    """Which linear layers get adapters: a subset of 'attention', 'dense_mlp', 'experts', 'shared_experts'."""

    def __post_init__(self) -> None:
        at_least("lora.rank", self.rank, 0, "(0 = no adapters)")
        positive("lora.alpha", self.alpha)
        between("lora.dropout", self.dropout, 0.0, 1.0, high_open=True)
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ValueError(f"lora.targets={list(targets)!r}: expected a non-empty subset of {list(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ValueError(f"lora.targets={list(targets)!r} names a group twice")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: what B A x is multiplied by."""
        return self.alpha / self.rank
