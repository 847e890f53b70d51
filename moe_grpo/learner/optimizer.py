"""Megatron's DDP wrapper and optimizer for one learner model chunk.

Mixed precision follows the weights: with bf16/fp16 parameters Megatron's
optimizer keeps fp32 main parameters (and fp32 Adam state), steps on them and
copies the result back into the low-precision weights; gradients accumulate in
fp32 buffers when `grad_reduce_in_fp32`. With `distributed_optimizer` the main
parameters and Adam state are sharded over the data-parallel ranks (ZeRO-1):
gradients are reduce-scattered and the updated weights all-gathered inside
`optimizer.step()`; it is CUDA-only in megatron-core 0.16.1. Checked on one CUDA GPU (NCCL, DP=1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_grpo.learner.config import LearnerConfig
from moe_grpo.models.options import MegatronOptions

if TYPE_CHECKING:
    import torch


def place_on_gpu(module: Any, dtype: "torch.dtype") -> None:
    """Move every parameter and buffer to the current CUDA device and every floating parameter to `dtype`.

    What Megatron's training loop does with `model.cuda()` and `Float16Module`
    (`module.bfloat16()`), without the wrapper, so the GPTModel keeps its module
    paths (weight sync, checkpoints, routing replay address it directly). With the
    local layer spec the torch RMSNorm weights are built on the CPU in fp32;
    buffers keep their dtype (the router's expert bias stays fp32, as Megatron keeps it).
    """
    import torch

    module.cuda(torch.cuda.current_device())
    for p in module.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def build_ddp_and_optimizer(module: Any, mconfig: Any, config: LearnerConfig,
                            options: MegatronOptions) -> tuple[Any, Any]:
    """Wrap `module` in Megatron's DistributedDataParallel and build its optimizer.

    On CUDA the module is first moved to the GPU in the model dtype (`place_on_gpu`).
    Also installs the hooks the pipeline schedules call on `mconfig`
    (`finalize_model_grads_func`, `no_sync_func`). Returns `(ddp_model, optimizer)`.
    """
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dtype = options.dtype
    if options.distributed_optimizer and not torch.cuda.is_available():
        raise ValueError("megatron.distributed_optimizer=True needs CUDA: megatron-core 0.16.1's DistributedOptimizer "
                         "accepts only torch.cuda parameters (TypeError on CPU tensors); set it to false on CPU")
    if dtype != torch.float32 and not torch.cuda.is_available():
        raise ValueError(f"megatron.params_dtype={options.params_dtype!r} needs CUDA: megatron-core 0.16.1's "
                         "mixed-precision optimizer accepts only torch.cuda parameters; use 'float32' on CPU")
    if mconfig.params_dtype != dtype:
        raise ValueError(f"the Megatron config holds params_dtype={mconfig.params_dtype}, but "
                         f"megatron.params_dtype={options.params_dtype!r}; build both from the same options")
    if torch.cuda.is_available():
        place_on_gpu(module, dtype)
    model = DistributedDataParallel(
        mconfig,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=options.grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            use_distributed_optimizer=options.distributed_optimizer,
        ),
        module,
    )
    mconfig.finalize_model_grads_func = finalize_model_grads
    mconfig.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            clip_grad=config.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            main_params_dtype=torch.float32,
            main_grads_dtype=torch.float32,
            use_distributed_optimizer=options.distributed_optimizer,
        ),
        [model],
    )
    if dtype == torch.float16:  # dynamic loss scaling: the schedule scales the loss before backward
        mconfig.grad_scale_func = optimizer.scale_loss
    return model, optimizer
