"""The dtype a weight version travels in: the one rule both sides of a sync and the placement plan read.

Torch-free: a dry run (`cluster.dry_run=true`) prints the plan's bytes per version without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moe_grpo.learner.lora_config import LoraConfig

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""Element types a version can travel in (`sync/plan.py` maps them to torch's)."""


def version_dtype(engine_dtype: str, lora: LoraConfig | None = None) -> str:
    """The dtype versions travel in to engines serving `engine_dtype` (`rollout.dtype`): that dtype, so the
    engine loads them as they are; with LoRA adapters (`lora.rank > 0`) float32 whatever the engines serve.

    Why float32 with LoRA: a merging engine (`sync.lora_apply=merge`) computes W0 + (alpha/r) B @ A in fp32 from
    its copy of W0 and rounds once to its dtype, which is what the learner's weights give rounded to it; with W0
    and A, B arriving in bfloat16 it would round twice: with W0 ~ N(0, 0.02) in fp32 (a randomly initialised
    model), rank 8, alpha 16 and |scale B A| / |W0| from 1e-3 to 1, 18-45% of the merged elements then differed
    from the learner's weights rounded once by one bfloat16 step (a bf16 W0 alone: 18-27%; bf16 adapters
    alone: 0.2-39%).
    An adapter version is small and the base is sent once per learner, so the float32 bytes cost little; a
    serving engine (`sync.lora_apply=serve`) casts adapters to its own dtype on load either way (vLLM 0.32's
    `lora_dtype='auto'`)."""
    if engine_dtype not in DTYPE_NAMES:
        raise ValueError(f"engine dtype {engine_dtype!r}, expected one of {', '.join(DTYPE_NAMES)}")
    return "float32" if lora is not None and lora.enabled else engine_dtype
