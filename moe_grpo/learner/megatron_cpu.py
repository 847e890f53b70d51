"""Make unmodified megatron-core 0.16.1 run on CPU with gloo.

Targets megatron-core == 0.16.1 exactly (`TARGET_VERSION`); `apply()` refuses
any other version, because every patch below names a line of that release.

Why patch instead of fork: megatron-core assumes CUDA in a few dozen places
that do nothing but pick a device (`torch.cuda.current_device()`,
`device="cuda"`, CUDA streams, the CUDA RNG). The maths is device-agnostic.
Rather than edit each call site, each affected megatron module gets its own
view of `torch` (`_CpuTorchView`) whose `torch.cuda` answers for the CPU:
the "current CUDA device" is torch's default device (so `with
torch.device("meta")` still builds on meta), streams and synchronisation are
no-ops, and the "CUDA" RNG is the CPU generator. Only the modules listed in
`CPU_PATCHES` see the view; torch itself and every other library are
untouched.

Every patch is applied explicitly (`apply()`), can be reverted (`revert()`),
and has a probe test in `tests/learner/test_megatron_cpu.py` that fails with
the patch left out.

`GENUINE_BUGS` holds patches of upstream bugs that hit GPU users too; they are
applied on every platform.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

TARGET_VERSION = "0.16.1"


@dataclass(frozen=True)
class Patch:
    """One named change to a megatron-core module."""

    name: str
    """Short identifier used by `apply(only=...)` / `apply(skip=...)` and the tests."""
    break_point: str
    """What fails without it (file and call), so a reader can find the line upstream."""
    apply: Callable[[], Callable[[], None]]
    """Installs the patch; returns a function that undoes it."""


# --------------------------------------------------------------------------- torch view


def _cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling to the CPU (or the current default device)."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.get_default_device()
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.get_default_device()
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.get_default_device()
    return device


class _NoStream:
    """Stands in for torch.cuda.Stream / Event on CPU: CPU work is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "_NoStream":
        return self

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


def _make_cuda_view() -> types.ModuleType:
    cuda = types.ModuleType("torch.cuda[cpu view]")
    cuda.__dict__.update(torch.cuda.__dict__)
    cuda.__getattr__ = lambda name: getattr(torch.cuda, name)  # type: ignore[attr-defined]
    cuda.current_device = lambda: torch.get_default_device()
    cuda.is_available = lambda: False
    cuda.device_count = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    cuda.Stream = _NoStream
    cuda.Event = _NoStream
    cuda.current_stream = lambda *a, **k: _NoStream()
    cuda.default_stream = lambda *a, **k: _NoStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: torch.manual_seed(seed)
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    return cuda


def _device_mapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "wrapped")
    return wrapper


def _make_torch_view() -> types.ModuleType:
    view = types.ModuleType("torch[cpu view]")
    view.__dict__.update(torch.__dict__)
    view.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[attr-defined]
    view.cuda = _make_cuda_view()
    # Factories that megatron calls with a literal device="cuda".
    for name in ("zeros", "ones", "empty", "empty_like", "full", "tensor", "arange", "randn", "rand"):
        setattr(view, name, _device_mapped(getattr(torch, name)))
    return view


_TORCH_VIEW = _make_torch_view()


def _torch_view_patch(module_name: str) -> Callable[[], Callable[[], None]]:
    def apply() -> Callable[[], None]:
        module = importlib.import_module(module_name)
        original = module.torch
        module.torch = _TORCH_VIEW

        def undo() -> None:
            module.torch = original

        return undo

    return apply


def _setattr_patch(module_name: str, attr: str, value_fn: Callable[[Any], Any]) -> Callable[[], Callable[[], None]]:
    def apply() -> Callable[[], None]:
        module = importlib.import_module(module_name)
        missing = object()
        original = module.__dict__.get(attr, missing)
        setattr(module, attr, value_fn(module))

        def undo() -> None:
            if original is missing:
                delattr(module, attr)
            else:
                setattr(module, attr, original)

        return undo

    return apply


# --------------------------------------------------------------------------- RNG tracker


def _drop_cpu_rng_warning(record: logging.LogRecord) -> bool:
    return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _rng_patch() -> Callable[[], None]:
    """The CUDA RNG tracker forks and restores CUDA generator states; use the CPU one."""
    from megatron.core.tensor_parallel import random as mrandom

    originals = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, mrandom.torch)
    # fork() warns when the CPU generator moved inside a "CUDA" RNG context; on CPU
    # the forked generator *is* the CPU one, so the warning is expected noise.
    rng_logger = logging.getLogger(mrandom.__name__)
    rng_logger.addFilter(_drop_cpu_rng_warning)
    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state()
    )
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mrandom.torch = _TORCH_VIEW

    def undo() -> None:
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state, mrandom.torch = originals
        rng_logger.removeFilter(_drop_cpu_rng_warning)

    return undo


# --------------------------------------------------------------------------- gloo all-to-all


def _gloo_all_to_all_patch() -> Callable[[], None]:
    """Gloo's all_to_all_single wants split sizes as Python lists of ints.

    The alltoall dispatcher moves its split sizes to the host as numpy arrays
    (`maybe_move_tensor_to_cpu(..., as_numpy=True)`), which NCCL accepts and
    gloo rejects.
    """
    from megatron.core.tensor_parallel import mappings

    original = mappings.torch

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):  # type: ignore[no-untyped-def]
        as_list = lambda s: None if s is None else [int(x) for x in s]  # noqa: E731
        return torch.distributed.all_to_all_single(
            output, input, as_list(output_split_sizes), as_list(input_split_sizes), **kw
        )

    view = types.ModuleType("torch[cpu view, gloo]")
    view.__dict__.update(_TORCH_VIEW.__dict__)
    dist_view = types.ModuleType("torch.distributed[gloo view]")
    dist_view.__dict__.update(torch.distributed.__dict__)
    dist_view.all_to_all_single = all_to_all_single
    view.distributed = dist_view
    mappings.torch = view

    def undo() -> None:
        mappings.torch = original

    return undo


# --------------------------------------------------------------------------- grad clipping


def _clip_grads_patch() -> Callable[[], None]:
    """clip_grad_by_total_norm_fp32 asserts `grad.type() == 'torch.cuda.FloatTensor'`.

    Same maths on CPU: scale every fp32 gradient in place by max_norm / total_norm.
    """
    from megatron.core.optimizer import clip_grads, optimizer

    original = clip_grads.clip_grad_by_total_norm_fp32

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):  # type: ignore[no-untyped-def]
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        for g in grads:
            if g.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"gradient dtype {g.dtype}, expected float32 or bfloat16 main grads")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

    def undo() -> None:
        clip_grads.clip_grad_by_total_norm_fp32 = original
        optimizer.clip_grad_by_total_norm_fp32 = original

    return undo


# --------------------------------------------------------------------------- torch norms under SP


def _torch_norm_sp_patch() -> Callable[[], None]:
    """WrappedTorchNorm refuses sequence parallel (only Apex/TE norms were meant for it).

    A torch RMSNorm is correct under SP as long as its weight gradients are
    summed over the TP group, which finalize_model_grads does for every
    parameter marked `sequence_parallel=True` (what TE and Apex norms set).
    """
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original = cls.__dict__["__new__"]

    def __new__(klass, config, hidden_size, eps=1e-5, persist_layer_norm=False,  # type: ignore[no-untyped-def]
                zero_centered_gamma=False, normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original(klass, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        norm = original(klass, _no_sp(config),
                        hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(__new__)

    def undo() -> None:
        cls.__new__ = original

    return undo


class _no_sp:
    """A read-only view of a TransformerConfig with sequence_parallel=False."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name == "sequence_parallel":
            return False
        return getattr(self._config, name)


# --------------------------------------------------------------------------- the lists

_MC = "megatron.core"

CPU_PATCHES: tuple[Patch, ...] = (
    Patch("rng_tracker", "tensor_parallel/random.py: CudaRNGStatesTracker.add/fork read and set CUDA generator states", _rng_patch),
    Patch("alltoall_streams", "transformer/moe/token_dispatcher.py: MoEAlltoAllTokenDispatcher creates torch.cuda.Stream()", _torch_view_patch(f"{_MC}.transformer.moe.token_dispatcher")),
    Patch("router_device", "transformer/moe/router.py: Router moves weight and expert-bias buffers to torch.cuda.current_device()", _torch_view_patch(f"{_MC}.transformer.moe.router")),
    Patch("rotary_device", "models/common/embeddings/rotary_pos_embedding.py: inv_freq.to(torch.cuda.current_device())", _torch_view_patch(f"{_MC}.models.common.embeddings.rotary_pos_embedding")),
    Patch("yarn_rotary_device", "models/common/embeddings/yarn_rotary_pos_embedding.py: YarnRotaryEmbedding picks "
          "torch.cuda.current_device() at init and moves inv_freq_extra/inter there in get_emb",
          _torch_view_patch(f"{_MC}.models.common.embeddings.yarn_rotary_pos_embedding")),
    Patch("causal_mask_device", "transformer/utils.py: get_default_causal_mask builds torch.ones(..., device='cuda')", _torch_view_patch(f"{_MC}.transformer.utils")),
    Patch("global_memory_buffer", "utils.py: GlobalMemoryBuffer.get_tensor allocates on torch.cuda.current_device()", _torch_view_patch(f"{_MC}.utils")),
    Patch("tp_layers_device", "tensor_parallel/layers.py: sequence-parallel all-gather and weight allocation use torch.cuda.current_device()", _torch_view_patch(f"{_MC}.tensor_parallel.layers")),
    Patch("tp_mappings", "tensor_parallel/mappings.py: gathers allocate on torch.cuda.current_device(), and _AllToAll "
          "passes the dispatcher's numpy split sizes to all_to_all_single, which gloo rejects", _gloo_all_to_all_patch),
    Patch("pp_schedules", "pipeline_parallel/schedules.py: total_num_tokens = torch.zeros(..., device='cuda')", _torch_view_patch(f"{_MC}.pipeline_parallel.schedules")),
    Patch("ddp_buffers", "distributed/param_and_grad_buffer.py and distributed_data_parallel.py: grad buffers on torch.cuda.current_device()", lambda: _chain(
        _torch_view_patch(f"{_MC}.distributed.param_and_grad_buffer")(),
        _torch_view_patch(f"{_MC}.distributed.distributed_data_parallel")(),
    )),
    Patch("optimizer_device", "optimizer/optimizer.py and clip_grads.py: scale and norm tensors built with device='cuda'", lambda: _chain(
        _torch_view_patch(f"{_MC}.optimizer.optimizer")(),
        _torch_view_patch(f"{_MC}.optimizer.clip_grads")(),
    )),
    Patch("clip_grads_cpu", "optimizer/clip_grads.py: clip_grad_by_total_norm_fp32 asserts grad.type() == 'torch.cuda.FloatTensor'", _clip_grads_patch),
    Patch("dist_checkpointing_device", "dist_checkpointing/strategies/filesystem_async.py and state_dict_saver.py: torch.cuda.synchronize() and device='cuda' flags", lambda: _chain(
        _torch_view_patch(f"{_MC}.dist_checkpointing.strategies.filesystem_async")(),
        _torch_view_patch(f"{_MC}.dist_checkpointing.strategies.state_dict_saver")(),
    )),
    Patch("torch_norm_sp", "transformer/torch_norm.py: WrappedTorchNorm asserts not config.sequence_parallel", _torch_norm_sp_patch),
    Patch("pp_p2p", "pipeline_parallel/p2p_communication.py: shape buffers on CUDA and torch.cuda.synchronize()", _torch_view_patch(f"{_MC}.pipeline_parallel.p2p_communication")),
)


def _chain(*undos: Callable[[], None]) -> Callable[[], None]:
    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


def _te_general_gemm_patch() -> Callable[[], None]:
    moe_utils = importlib.import_module(f"{_MC}.transformer.moe.moe_utils")
    if hasattr(moe_utils, "te_general_gemm"):
        return lambda: None
    return _setattr_patch(moe_utils.__name__, "te_general_gemm", lambda m: None)()


def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def _mla_have_te_patch() -> Callable[[], None]:
    if _transformer_engine_importable():
        return lambda: None
    return _setattr_patch(f"{_MC}.transformer.multi_latent_attention", "HAVE_TE", lambda m: False)()


GENUINE_BUGS: tuple[Patch, ...] = (
    Patch(
        "te_general_gemm_undefined",
        "transformer/moe/moe_utils.py: RouterGatingLinearFunction reads te_general_gemm, which is only "
        "defined when Transformer Engine imports (NameError without TE, on GPU as well)",
        _te_general_gemm_patch,
    ),
    Patch(
        "mla_have_te_stub",
        "transformer/multi_latent_attention.py: without Transformer Engine, extensions/transformer_engine.py "
        "hands out MagicMock stand-ins, so HAVE_TE is True and isinstance(x, TELinear) raises TypeError",
        _mla_have_te_patch,
    ),
)

_applied: dict[str, Callable[[], None]] = {}
_left_out: set[str] = set()


def megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def apply(*, only: tuple[str, ...] | None = None, skip: tuple[str, ...] = (), force_cpu: bool | None = None) -> list[str]:
    """Apply the genuine-bug patches everywhere and the CPU patches when CUDA is absent.

    `only` / `skip` select CPU patches by name (the tests use them to show that
    each one is needed). Returns the names applied by this call. Idempotent.
    """
    version = megatron_version()
    if version != TARGET_VERSION:
        raise RuntimeError(
            f"moe_grpo.learner.megatron_cpu targets megatron-core=={TARGET_VERSION}, found {version}; "
            "re-check every patch against the new release before changing TARGET_VERSION"
        )
    on_cpu = (not torch.cuda.is_available()) if force_cpu is None else force_cpu
    names = {p.name for p in CPU_PATCHES + GENUINE_BUGS}
    for n in (only or ()) + tuple(skip):
        if n not in names:
            raise ValueError(f"unknown megatron-core patch {n!r}; expected one of {sorted(names)}")
    # What an explicit call leaves out stays out for later plain apply() calls
    # (init_distributed calls apply()), until revert().
    _left_out.update(skip)
    if only is not None:
        _left_out.update(names - set(only))
    chosen = [p for p in GENUINE_BUGS if p.name not in _left_out]
    if on_cpu:
        chosen += [p for p in CPU_PATCHES if p.name not in _left_out]
    done = []
    for patch in chosen:
        if patch.name in _applied:
            continue
        _applied[patch.name] = patch.apply()
        done.append(patch.name)
    return done


def revert() -> None:
    """Undo every applied patch (tests use this to probe one patch at a time)."""
    for name in list(reversed(list(_applied))):
        _applied.pop(name)()
    _left_out.clear()


def applied() -> list[str]:
    return list(_applied)
