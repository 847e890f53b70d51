"""A learner's checkpoint is saved without the process megatron-core spawns to pass a save's results to itself
(moe_grpo/learner/megatron_sync_save.py): each learner rank's first checkpoint of a run paid ~2.3 s for it."""

import multiprocessing

import pytest
import torch

from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.learner import megatron_sync_save


def test_the_patch_refuses_another_megatron_core_version(monkeypatch):
    import moe_grpo.learner.megatron_cpu as megatron_cpu

    monkeypatch.setattr(megatron_cpu, "megatron_version", lambda: "0.17.0")
    with pytest.raises(RuntimeError, match=r"megatron-core==0\.16\.1, found 0\.17\.0"):
        with megatron_sync_save.in_process_results():
            pass


@pytest.mark.slow
def test_a_learner_checkpoint_starts_no_results_process_and_loads_back(tmp_path, monkeypatch):
    """Would have caught: the first save starting megatron's spawned `Manager` (with `dist_checkpointing.save`
    called outside `in_process_results`, the module's queue is a Manager proxy afterwards and its server process
    a child of this one; seen failing so)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh learner process
    spec = tiny_spec()
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    learner.train_step(make_sequences(spec, n=2))
    saved = {name: p.detach().clone() for name, p in learner.module.named_parameters()}
    children_before = {p.pid for p in multiprocessing.active_children()}

    learner.save_run_state(str(tmp_path / "state"))

    started = [p for p in multiprocessing.active_children() if p.pid not in children_before]
    assert started == [], f"the save left processes running: {started}"
    assert filesystem_async._results_queue is None, "megatron's results queue of a later async save is untouched"
    learner.train_step(make_sequences(spec, n=2, seed=1))
    learner.load_run_state(str(tmp_path / "state"))
    for name, p in learner.module.named_parameters():
        assert torch.equal(p.detach(), saved[name]), f"{name} did not load back as saved"
