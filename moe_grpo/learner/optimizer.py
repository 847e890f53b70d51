"""Megatron's DDP wrapper and optimizer for one learner model chunk.

Mixed precision follows the weights: with bf16/fp16 parameters Megatron's
optimizer keeps fp32 main parameters (and fp32 Adam state), steps on them and
copies the result back into the low-precision weights; gradients accumulate in
fp32 buffers when `grad_reduce_in_fp32`. With `distributed_optimizer` the main
parameters and Adam state are sharded over the data-parallel ranks (ZeRO-1):
gradients are reduce-scattered and the updated weights all-gathered inside
`optimizer.step()`; it is CUDA-only in megatron-core 0.16.1. Checked on one CUDA GPU (NCCL, DP=1).

Run checkpoints (`MegatronLearner.save_run_state`) take the optimizer's state through Megatron's
`sharded_state_dict`, made layout-independent here (`optimizer_sharded_state_dict`); the learning rate and Adam's
step travel beside it (`current_lr` / `set_lr`, `adam_step` / `set_adam_step`).
"""

from __future__ import annotations

import math
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


def lr_scheduler(optimizer: Any, config: LearnerConfig, total_steps: int) -> Any:
    """Megatron's OptimizerParamScheduler for `config`'s schedule in a run of `total_steps` RL steps: linear
    warmup from 0 over `lr_warmup_steps`, then `lr_decay` from `lr` to `min_lr` at step `lr_decay_steps` (None: the
    run's last step), `min_lr` after it."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = config.decay_steps(total_steps)
    if config.lr_warmup_steps >= max(decay_steps, 1) and config.lr_warmup_steps > 0:
        raise ValueError(f"learner.lr_warmup_steps={config.lr_warmup_steps} must be below the run's steps "
                         f"({total_steps}): the learning rate would never reach learner.lr")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr, lr_warmup_steps=config.lr_warmup_steps,
        lr_decay_steps=max(decay_steps, config.lr_warmup_steps + 1), lr_decay_style=config.lr_decay,
        start_wd=config.weight_decay, end_wd=config.weight_decay, wd_incr_steps=1, wd_incr_style="constant")


# --------------------------------------------------------------------------- run checkpoints: optimizer state

CHECKPOINT_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_sharded_model_space"}
"""`metadata` for Megatron's `optimizer.sharded_state_dict` that makes the saved tensors layout-independent.

`ChainedOptimizer` would otherwise prefix every tensor with `chained_{i}.`, and `i` depends on the layout: at EP=1 the
expert weights are ordinary data-parallel parameters of the dense optimizer (one sub-optimizer), at EP>1 they get a
second one, so an EP=2 checkpoint would not load at EP=1. Without the prefix each Adam moment (and fp32 main
parameter) is named `optimizer.state.<exp_avg|exp_avg_sq|fp32_param>.<model tensor key>` and sharded like its model
tensor, which any TP/EP/PP layout can read. `fully_sharded_model_space` does the same for Megatron's
DistributedOptimizer (its state per model parameter rather than per data-parallel buffer)."""


def sub_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside `optimizer` (a ChainedOptimizer's parts, or itself), stubs left out."""
    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    return [o for o in parts if not getattr(o, "is_stub_optimizer", False) and getattr(o, "optimizer", None) is not None]


def _torch_optimizers(optimizer: Any) -> list[Any]:
    return [o.optimizer for o in sub_optimizers(optimizer)]


def current_lr(optimizer: Any, default: float) -> float:
    """The learning rate the next step will use (before any per-group `lr_mult`); `default` without param groups."""
    for group in optimizer.param_groups:
        return float(group["lr"]) / float(group.get("lr_mult", 1.0) or 1.0)
    return default


def set_lr(optimizer: Any, lr: float) -> None:
    """Set the learning rate of every param group of every sub-optimizer (times the group's `lr_mult`). 0 is a
    learning rate a schedule reaches (a decay to `min_lr=0` at its last step), so a state saved there loads."""
    if not (lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"lr={lr}, expected a finite number >= 0")
    for group in optimizer.param_groups:
        group["lr"] = lr * float(group.get("lr_mult", 1.0))


def adam_step(optimizer: Any) -> int:
    """Adam's step counter (bias correction): the same for every parameter, 0 before the first step."""
    steps: set[int] = set()
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" in group and group["params"]:  # Transformer Engine's FusedAdam keeps it per group
                steps.add(int(group["step"] or 0))
            for p in group["params"]:
                state = inner.state.get(p)
                if state and "step" in state:
                    steps.add(int(float(state["step"])))
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's step differs between parameters ({sorted(steps)}); cannot checkpoint it")
    return steps.pop() if steps else 0


def set_adam_step(optimizer: Any, step: int) -> None:
    """Set Adam's step counter of every parameter that has optimizer state (a checkpoint stores it once)."""
    import torch

    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch.optim's choice
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = step
                continue
            on_device = bool(group.get("capturable") or group.get("fused"))
            for p in group["params"]:
                state = inner.state.get(p)
                if state:
                    state["step"] = torch.tensor(float(step), dtype=scalar, device=p.device if on_device else "cpu")


def reset_optimizer_state(optimizer: Any) -> None:
    """Forget Adam's moments and step (what a freshly built optimizer holds) and copy the model weights into the
    fp32 main parameters where there are any."""
    for inner in _torch_optimizers(optimizer):
        inner.state.clear()
    optimizer.reload_model_params()


def optimizer_sharded_state_dict(optimizer: Any, model_sharded_state_dict: Any, *, is_loading: bool) -> dict:
    """Megatron's sharded state dict of every sub-optimizer, with only its tensors persistent.

    The tensors (Adam moments, fp32 main parameters) are keyed by the model tensors they belong to
    (`CHECKPOINT_METADATA`). Everything else Megatron would save in `common.pt` (param groups with their parameter
    ids, the step) describes the saving layout, so it is kept local: a load takes it from the optimizer being loaded
    into, and the caller restores the learning rate and the step (`set_lr`, `set_adam_step`).
    `is_loading=True` first creates zero state for every parameter (Megatron's `init_state_fn`) so that the dict has
    a tensor to load into for each one; call it that way only right before loading."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    out = {i: opt.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=CHECKPOINT_METADATA)
           for i, opt in enumerate(sub_optimizers(optimizer))}

    def local(value: Any) -> Any:
        return value if isinstance(value, (ShardedBase, LocalNonpersistentObject)) else LocalNonpersistentObject(value)

    return dict_list_map_inplace(local, out)


def load_optimizer_state(optimizer: Any, loaded: dict, step: int) -> None:
    """Hand what `dist_checkpointing.load` returned for `optimizer_sharded_state_dict(..., is_loading=True)` to each
    sub-optimizer (Megatron's own `load_state_dict`: moments, and fp32 main parameters for mixed precision), then set
    the step."""
    import torch

    def with_step(tree: Any) -> None:
        # torch.optim refuses per-parameter state without "step" (Megatron's `common_step`, which the checkpoint
        # does not carry: it is the caller's `step`); any {"state", "param_groups"} dict is a torch one.
        if isinstance(tree, dict):
            if isinstance(tree.get("state"), dict) and "param_groups" in tree:
                for param_state in tree["state"].values():
                    if isinstance(param_state, dict) and param_state:
                        param_state.setdefault("step", torch.tensor(float(step)))
            for value in tree.values():
                with_step(value)

    for i, opt in enumerate(sub_optimizers(optimizer)):
        with_step(loaded[i])
        opt.load_state_dict(loaded[i])
    set_adam_step(optimizer, step)
