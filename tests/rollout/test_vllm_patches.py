"""vLLM patches that need no engine: each test shows the bug without its patch and the fix with it."""

import pytest
import torch

pytestmark = [pytest.mark.vllm]


@pytest.fixture
def rope():
    """vLLM's DeepSeek rotary (interleaved pairs, no scaling) as the CPU platform dispatches it."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        yield get_rope(16, max_position=256, is_neox_style=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.float32)


def _deepseek_q_k(tokens=9, heads=4, nope=16, rope_dim=16, latent=32):
    """q_pe / k_pe as vLLM's MLA-free DeepseekV2Attention passes them: strided 3-D views."""
    torch.manual_seed(0)
    q = torch.randn(tokens, heads, nope + rope_dim)
    latent_cache = torch.randn(tokens, latent + rope_dim).unsqueeze(1)
    return q, latent_cache, q[..., nope:], latent_cache[:, :, latent:]


def _gap(rope, patched: bool) -> float:
    from moe_grpo.rollout import vllm_patches

    q, cache, q_pe, k_pe = _deepseek_q_k()
    positions = torch.arange(q.shape[0])
    want_q, want_k = rope.forward_native(positions, q_pe.clone(), k_pe.clone())
    installed = vllm_patches.apply_cpu_rotary_multihead_3d() if patched else vllm_patches.revert("cpu_rotary_multihead_3d")
    try:
        vllm_patches.rebind_rotary(rope)
        got_q, got_k = rope.forward_cpu(positions, q_pe, k_pe)
        # In place, as the kernel: the views (and so q and the latent cache) hold the rotated values.
        assert torch.equal(got_q, q_pe) and torch.equal(got_k, k_pe)
        return max(float((q_pe - want_q).abs().max()), float((k_pe - want_k).abs().max()))
    finally:  # leave this process as it was
        if installed and patched:
            vllm_patches.revert("cpu_rotary_multihead_3d")
        elif installed and not patched:
            vllm_patches.apply_cpu_rotary_multihead_3d()


def test_cpu_rotary_kernel_rotates_multihead_3d_queries_wrongly_without_the_patch(rope):
    assert _gap(rope, patched=False) > 0.1, "vLLM's CPU rotary kernel is right for [tokens, heads, dim]: drop the patch"


def test_cpu_rotary_patch_matches_vllms_pytorch_rotary(rope):
    assert _gap(rope, patched=True) < 1e-6


def test_cpu_rotary_patch_keeps_the_kernel_for_flat_inputs(rope):
    from moe_grpo.rollout import vllm_patches

    installed = vllm_patches.apply_cpu_rotary_multihead_3d()
    try:
        q, k = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
        want_q, want_k = rope.forward_native(torch.arange(5), q.clone(), k.clone())
        got_q, got_k = rope.forward_cpu(torch.arange(5), q, k)
        assert torch.allclose(got_q, want_q, atol=1e-6) and torch.allclose(got_k, want_k, atol=1e-6)
    finally:
        if installed:
            vllm_patches.revert("cpu_rotary_multihead_3d")


def _moe_backend(lora_targets: list[str]) -> tuple[bool, str]:
    """(is_lora_enabled, the backend vLLM picks) of an MoE layer built under a LoRA config with `lora_targets`."""
    from vllm.config import LoRAConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import select_unquantized_moe_backend

    config = VllmConfig()
    config.lora_config = LoRAConfig(max_lora_rank=8, target_modules=lora_targets)  # as enable_lora sets it
    with set_current_vllm_config(config):
        moe = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=64, intermediate_size=32,
                             num_local_experts=8, num_logical_experts=8, activation=MoEActivation.SILU, device="cpu",
                             routing_method=RoutingMethodType.Renormalize,
                             moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.float32,
                             is_lora_enabled=True)
        return moe.is_lora_enabled, select_unquantized_moe_backend(moe)[0].value


def test_cpu_moe_with_lora_picks_triton_without_the_patch_and_the_cpu_kernel_with_it():
    """Without the patch an engine with LoRA on could not build any MoE layer on CPU (Triton has no CPU backend)."""
    from moe_grpo.rollout import vllm_patches

    was_installed = vllm_patches.revert("cpu_moe_without_expert_lora")  # worker_extension's import installs it
    try:
        assert _moe_backend(["q_proj", "o_proj"]) == (True, "TRITON"), "vLLM keeps the CPU kernel: drop the patch"
        vllm_patches.apply_cpu_moe_without_expert_lora()
        assert _moe_backend(["q_proj", "o_proj"]) == (False, "CPU")
        # Experts that are LoRA targets keep vLLM's choice (the engine refuses them on CPU before vLLM starts).
        assert _moe_backend(["q_proj", "experts"]) == (True, "TRITON")
    finally:
        vllm_patches.revert("cpu_moe_without_expert_lora")
        if was_installed:
            vllm_patches.apply_cpu_moe_without_expert_lora()


@pytest.mark.parametrize("release", ["0.32.0", "0.32.1"])
def test_on_a_gpu_nothing_is_patched_and_no_release_is_refused(monkeypatch, release):
    """vLLM's platform faked as a GPU and its release as `release`: importing the worker extension (what every
    vLLM engine does before it builds the model) and installing it patch nothing and raise nothing.

    Would have caught: the worker extension installing the CPU MoE-backend patch on every platform, whose version
    check refused any release but 0.32.0 (a GPU engine from the `gpu` extra's 0.32.x would not start), and which
    would have switched LoRA off on a GPU's MoE layers, where vLLM's Triton kernels support it."""
    import importlib

    from moe_grpo.rollout import vllm_patches

    saved = dict(vllm_patches._applied)
    vllm_patches.revert_all()
    monkeypatch.setattr(vllm_patches, "on_cpu", lambda: False)
    monkeypatch.setattr(vllm_patches, "vllm_version", lambda: release)
    try:
        import moe_grpo.rollout.worker_extension as worker_extension

        importlib.reload(worker_extension)
        assert vllm_patches.apply_cpu_patches_after_build(torch.nn.Linear(2, 2)) == []
        assert vllm_patches._applied == {}, "a CPU patch was installed on a GPU platform"
    finally:
        monkeypatch.undo()
        vllm_patches.revert_all()
        for name in saved:  # leave the process as it was
            getattr(vllm_patches, f"apply_{name}")()


def test_on_cpu_a_patch_refuses_a_release_it_was_not_read_against_and_names_itself(monkeypatch):
    from moe_grpo.rollout import vllm_patches

    saved = dict(vllm_patches._applied)
    vllm_patches.revert_all()
    monkeypatch.setattr(vllm_patches, "on_cpu", lambda: True)
    monkeypatch.setattr(vllm_patches, "vllm_version", lambda: "0.32.1")
    try:
        with pytest.raises(RuntimeError, match=r"vllm_patches.cpu_moe_without_expert_lora targets vLLM 0.32.0, "
                                               r"found 0.32.1"):
            vllm_patches.apply_cpu_patches_before_build()
    finally:
        monkeypatch.undo()
        vllm_patches.revert_all()
        for name in saved:
            getattr(vllm_patches, f"apply_{name}")()


def test_on_cpu_the_sampler_patch_is_installed_before_the_model_is_built():
    """The worker extension's import (before vLLM builds the model and samples) installs the CPU patches that
    cannot wait for the engine's first call: the MoE backend and the seeded partial-prefill rewind."""
    import importlib

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import moe_grpo.rollout.worker_extension as worker_extension
    from moe_grpo.rollout import vllm_patches

    vllm_patches.revert_all()
    importlib.reload(worker_extension)  # what vLLM's worker does: import it
    assert {"cpu_moe_without_expert_lora", "cpu_seeded_partial_prefill"} <= set(vllm_patches._applied)
    assert GPUModelRunner._bookkeeping_sync.__module__ == vllm_patches.__name__


def _gather_logprobs_compiles(logprobs: torch.Tensor, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Frames Dynamo compiled while vLLM's sampler gathered the log-probs of `tokens` (what every rollout request
    asks for), and the ranks it gave."""
    from torch._dynamo.utils import counters
    from vllm.v1.sample.sampler import Sampler

    before = counters["frames"]["total"]
    ranks = Sampler.gather_logprobs(logprobs, 0, tokens).selected_token_ranks
    return counters["frames"]["total"] - before, ranks


def test_cpu_sampler_counts_token_ranks_without_compiling():
    """vLLM 0.32 compiles its token-rank count (torch.compile, inductor on CPU) at a worker's first sampled token,
    `enforce_eager` or not: ~5 s of every engine start and restart. With cpu_eager_token_ranks nothing is compiled
    and the ranks are the count vLLM's compiled expression makes."""
    from moe_grpo.rollout import vllm_patches

    torch.manual_seed(0)
    logprobs = torch.randn(5, 512).log_softmax(-1)
    tokens = torch.randint(0, 512, (5,))
    installed = vllm_patches.apply_cpu_eager_token_ranks()  # the worker extension's import installs it in a worker
    try:
        compiled, ranks = _gather_logprobs_compiles(logprobs, tokens)
        assert compiled == 0, f"Dynamo compiled {compiled} frame(s) for the sampler's token ranks"
        assert torch.equal(ranks, (logprobs >= logprobs.gather(-1, tokens[:, None])).sum(-1))
    finally:
        if installed:
            vllm_patches.revert("cpu_eager_token_ranks")
