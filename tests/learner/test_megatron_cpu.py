"""Every megatron-core CPU patch is needed: leave it out and the learner's CPU path breaks."""

import math
import os

import pytest

import patch_probe
from moe_grpo.learner import megatron_cpu
from moe_grpo.learner.spawn import DistributedRunError, run_distributed

# patch -> (layout (tp, ep, pp), model variant, text expected in the failure)
PROBES = {
    "rng_tracker": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "alltoall_streams": ((1, 1, 1), "default", "torch.cuda.Stream requires CUDA"),
    "router_device": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "rotary_device": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "yarn_rotary_device": ((1, 1, 1), "yarn", "Torch not compiled with CUDA"),
    "causal_mask_device": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "global_memory_buffer": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "tp_layers_device": ((2, 1, 1), "default", "Torch not compiled with CUDA"),
    "tp_mappings": ((1, 2, 1), "default", "Torch not compiled with CUDA"),
    "pp_schedules": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "ddp_buffers": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "optimizer_device": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "clip_grads_cpu": ((1, 1, 1), "default", "AssertionError"),
    "dist_checkpointing_device": ((1, 1, 1), "default", "Torch not compiled with CUDA"),
    "torch_norm_sp": ((2, 1, 1), "default", "sequence parallel not supported by torch LayerNorm"),
    "pp_p2p": ((1, 1, 2), "default", "Torch not compiled with CUDA"),
    "te_general_gemm_undefined": ((1, 1, 1), "default", "name 'te_general_gemm' is not defined"),
    "mla_have_te_stub": ((1, 1, 1), "mla", "isinstance() arg 2 must be a type"),
}


def test_every_patch_has_a_probe():
    names = {p.name for p in megatron_cpu.CPU_PATCHES + megatron_cpu.GENUINE_BUGS}
    assert names == set(PROBES)


def test_patches_name_their_target_version_and_refuse_another(monkeypatch):
    assert megatron_cpu.TARGET_VERSION == "0.16.1"
    monkeypatch.setattr(megatron_cpu, "megatron_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError, match=r"targets megatron-core==0.16.1, found 0.17.0"):
        megatron_cpu.apply()
    with pytest.raises(ValueError, match="unknown megatron-core patch 'nope'"):
        monkeypatch.setattr(megatron_cpu, "megatron_version", lambda: "0.16.1")
        megatron_cpu.apply(skip=("nope",))


def test_revert_restores_the_original_module_state():
    import megatron.core.transformer.moe.router as router
    import torch

    megatron_cpu.apply()
    assert router.torch is not torch
    megatron_cpu.revert()
    assert router.torch is torch
    megatron_cpu.apply()
    assert router.torch is not torch


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(PROBES))
def test_learner_cpu_path_fails_without_patch(name, tmp_path):
    (tp, ep, pp), variant, expected = PROBES[name]
    with pytest.raises(DistributedRunError) as err:
        run_distributed(patch_probe.learner_path, tp * ep * pp, (name,), tp, ep, pp, str(tmp_path / "ck"), variant,
                        timeout_s=300)
    assert expected in str(err.value)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gloo_needs_the_all_to_all_split_size_conversion(tmp_path):
    """tp_mappings does two things; with only its device half, gloo's all_to_all refuses numpy split sizes."""
    with pytest.raises(DistributedRunError, match="all_to_all"):
        run_distributed(patch_probe.learner_path_plain_mappings_view, 2, 1, 2, 1, str(tmp_path / "ck"), timeout_s=300)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", ["default", "mla", "aux_loss"])
def test_learner_cpu_path_passes_with_all_patches(variant, tmp_path):
    loss = run_distributed(patch_probe.learner_path, 1, (), 1, 1, 1, str(tmp_path / "ck"), variant, timeout_s=300)[0]
    assert math.isfinite(loss)
    assert os.path.isdir(tmp_path / "ck")
