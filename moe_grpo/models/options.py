"""Learner-side switches for building the Megatron model (torch-free, so configs load fast)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from moe_grpo.validate import non_negative, positive, refuse

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class MegatronOptions:
    """Learner-side switches that change how the Megatron model is built (not its shape)."""

    params_dtype: str = "float32"
    """Parameter dtype: 'float32' (CPU), 'bfloat16' (GPU clusters) or 'float16'; a torch.dtype is accepted too."""
    routing_replay: bool = True
    """Build RouterReplay hooks into every router (needed for R3; cheap when unused)."""
    recompute: bool = False
    """Full activation recompute of every layer (replay then uses REPLAY_BACKWARD)."""
    token_dispatcher: str = "alltoall"
    """Megatron MoE token dispatcher: 'alltoall' or 'allgather'."""
    aux_loss_coeff: float = 0.0
    """Sequence-level load-balancing loss coefficient (DeepSeek-V3 style); 0 disables it."""
    init_method_std: float = 0.02
    """Std of the normal weight init for freshly built models."""
    perform_initialization: bool = True
    """Initialise weights (False for meta-device builds and checkpoint loads)."""
    distributed_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 main parameters and Adam state sharded over the data-parallel
    ranks, gradients reduce-scattered and updated weights all-gathered (`learner/optimizer.py`). With
    bf16/fp16 weights the optimizer keeps fp32 main parameters either way; this switch shards them."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 even when the weights are bf16/fp16."""

    def __post_init__(self) -> None:
        name = str(self.params_dtype).removeprefix("torch.")
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"megatron.params_dtype={self.params_dtype!r}, expected 'float32', 'bfloat16' or "
                             "'float16'")
        object.__setattr__(self, "params_dtype", name)
        if self.token_dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"megatron.token_dispatcher={self.token_dispatcher!r}, expected 'alltoall' or "
                             "'allgather'")
        for flag in ("routing_replay", "recompute", "perform_initialization", "distributed_optimizer",
                     "grad_reduce_in_fp32"):
            if not isinstance(getattr(self, flag), bool):
                raise refuse(f"megatron.{flag}", getattr(self, flag), "true or false")
        non_negative("megatron.aux_loss_coeff", self.aux_loss_coeff)
        positive("megatron.init_method_std", self.init_method_std)

    @property
    def dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.params_dtype)


def gloo_dispatcher_problem(tensor_parallel: int, expert_parallel: int, token_dispatcher: str) -> str | None:
    """Why a learner on CPU (gloo) cannot run this layout with this MoE token dispatcher, or None if it can: at TP x EP
    gloo's all_gather refuses the alltoall dispatcher's uneven sizes (allgather gives the same results)."""
    if tensor_parallel > 1 and expert_parallel > 1 and token_dispatcher == "alltoall":
        return (f"parallel.tensor_parallel={tensor_parallel} x parallel.expert_parallel={expert_parallel} on CPU "
                "(gloo) needs the allgather token dispatcher (gloo's all_gather refuses the alltoall dispatcher's "
                "uneven sizes; allgather gives the same results): set megatron.token_dispatcher=allgather")
    return None
