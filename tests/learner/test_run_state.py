"""Learner run state: save after step 2, resume in a fresh process (same layout or another), and step 3 is the step
the original run took. Compared after step 3's update, so Adam's moments, the learning rate and the KL reference
all had to come back (the control drops Adam's state and visibly lands elsewhere)."""

import os
import re
import shutil

import numpy as np
import pytest

import run_state_scenarios as R
from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.learner.spawn import run_distributed

SAME_LAYOUT_TOL = 1e-7
"""Same layout, fp32 on CPU: the resumed step is the same computation (observed bit-identical: 0.0)."""
RESHARD_TOL = 1e-5
"""EP=2 -> EP=1: reductions run in another order (observed: logprobs after step 3 within 4.8e-7, loss 0.0,
kl/reference 2.7e-9, grad_norm 3.3e-7 relative)."""
CONTROL_MIN = 1e-2
"""Without Adam's state the logprobs after step 3 move by ~0.86 (observed), far outside either tolerance."""


def max_abs_diff(a, b):
    assert set(a) == set(b)
    return max(float(np.abs(a[i] - b[i]).max()) for i in a)


def check_metrics(saved, resumed, tol):
    for key in ("loss", "nll", "kl/reference"):
        assert abs(saved[key] - resumed[key]) <= tol, (key, saved[key], resumed[key])
    assert abs(saved["grad_norm"] - resumed["grad_norm"]) <= tol * saved["grad_norm"]


@pytest.fixture(scope="module")
def same_layout(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("run_state") / "same")
    original = run_distributed(R.train_save_continue, 1, 1, 1, 1, ckpt, 1)[0]
    resumed = run_distributed(R.resume_and_continue, 1, 1, 1, 1, ckpt, 2)[0]
    return original, resumed


@pytest.fixture(scope="module")
def ep2_to_ep1(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("run_state") / "ep2")
    original = run_distributed(R.train_save_continue, 2, 1, 2, 1, ckpt, 1)[0]
    resumed = run_distributed(R.resume_and_continue, 1, 1, 1, 1, ckpt, 2)[0]
    return original, resumed, ckpt


@pytest.mark.slow
@pytest.mark.multiprocess
def test_same_layout_resume_takes_the_same_step_3(same_layout):
    original, resumed = same_layout
    assert resumed["step_count"] == 2 and resumed["step_count_after"] == original["step_count"] == 3
    assert resumed["lr"] == original["lr"] == R.LR * R.LR_FACTOR  # the resumed learner had set 0.123
    check_metrics(original["step3"], resumed["step3"], SAME_LAYOUT_TOL)
    assert max_abs_diff(original["after"], resumed["after"]) <= SAME_LAYOUT_TOL
    assert max_abs_diff(original["after"], resumed["control_after"]) > CONTROL_MIN
    # Same layout: every generator continues where the saving process left it (this one was seeded differently).
    assert resumed["draws"] == original["draws"] and resumed["log"] == []


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resume_at_another_layout_ep2_to_ep1(ep2_to_ep1):
    original, resumed, _ = ep2_to_ep1
    assert resumed["step_count"] == 2 and resumed["step_count_after"] == 3
    assert resumed["lr"] == original["lr"] == R.LR * R.LR_FACTOR
    check_metrics(original["step3"], resumed["step3"], RESHARD_TOL)
    assert max_abs_diff(original["after"], resumed["after"]) <= RESHARD_TOL
    assert max_abs_diff(original["after"], resumed["control_after"]) > CONTROL_MIN
    # Per-rank RNG states of a 2-process layout mean nothing to 1 process: left as seeded, and said once.
    assert len(resumed["log"]) == 1 and "RNG states not restored" in resumed["log"][0]
    assert resumed["draws"] != original["draws"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["same_layout", "ep2_to_ep1"])
def test_kl_reference_survives_save_and_load(case, request):
    """The reference was set after step 1; the resuming learner had set its own (other weights) before loading."""
    original, resumed = request.getfixturevalue(case)[:2]
    assert resumed["has_reference"]
    tol = SAME_LAYOUT_TOL if case == "same_layout" else RESHARD_TOL
    assert original["step3"]["kl/reference"] > 100 * tol  # the reference is not the current policy
    assert abs(original["step3"]["kl/reference"] - resumed["step3"]["kl/reference"]) <= tol


BREAKS = [
    ("learner_meta.json", "delete"),
    ("learner_meta.json", "truncate"),
    ("rng_rank0.pt", "truncate"),
    ("rng_rank0.pt", "zero"),
    ("dist/__0_0.distcp", "truncate"),
    ("dist/__0_1.distcp", "delete"),
    ("dist/.metadata", "zero"),
    ("dist/common.pt", "delete"),
    ("dist/common.pt", "zero"),
    ("dist/metadata.json", "truncate"),
    ("dist/moe_grpo_model.json", "zero"),
]


def break_file(path, how):
    if how == "delete":
        os.remove(path)
        return
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
        else:  # same size, unreadable content
            f.write(b"\0" * size)


@pytest.mark.slow
def test_an_incomplete_checkpoint_is_refused_naming_the_file(tmp_path):
    from moe_grpo.learner.megatron_learner import IncompleteCheckpointError, LearnerConfig, MegatronLearner

    spec = tiny_spec()
    seqs = make_sequences(spec, n=2)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    learner.train_step(seqs)
    intact = str(tmp_path / "intact")
    learner.save_run_state(intact)
    at_save = learner.logprobs(seqs)
    learner.set_reference()
    learner.train_step(seqs)
    moved_on = learner.logprobs(seqs)

    for rel, how in BREAKS:
        broken = str(tmp_path / f"{rel.replace('/', '_')}.{how}")
        shutil.copytree(intact, broken)
        break_file(os.path.join(broken, rel), how)
        with pytest.raises(IncompleteCheckpointError) as err:
            learner.load_run_state(broken)
        assert os.path.join(broken, rel) in str(err.value) and "incomplete" in str(err.value), (rel, how, err.value)
        if rel.startswith("dist/") and how != "zero" and rel != "dist/moe_grpo_model.json":
            with pytest.raises(IncompleteCheckpointError, match=re.escape(os.path.join(broken, rel))):
                learner.load_checkpoint(os.path.join(broken, "dist"))  # the weights-only reader checks too
    # Refused before anything changed: the learner is as it was.
    for a, b in zip(moved_on, learner.logprobs(seqs)):
        np.testing.assert_array_equal(a, b)

    # Tensor bytes overwritten in place (same size): only Megatron's load notices; the error names the checkpoint.
    garbled = str(tmp_path / "garbled")
    shutil.copytree(intact, garbled)
    break_file(os.path.join(garbled, "dist", "__0_0.distcp"), "zero")
    with pytest.raises(IncompleteCheckpointError, match=re.escape(os.path.join(garbled, "dist"))):
        learner.load_run_state(garbled)

    # An intact checkpoint still loads, in full: weights, step, no reference (none was saved).
    learner.load_run_state(intact)
    assert learner.step_count == 1 and not learner.has_reference and learner.lr == 1e-2
    for a, b in zip(at_save, learner.logprobs(seqs)):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(learner.train_step(seqs)["loss"]) and learner.step_count == 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_file_only_one_rank_reads_fails_every_rank(ep2_to_ep1, tmp_path):
    """rng_rank1.pt garbled (same size): only rank 1 reads it, yet both ranks raise naming it (none is left waiting
    in the collective load), and the intact checkpoint then loads at EP=2."""
    _, _, ckpt = ep2_to_ep1
    broken = str(tmp_path / "broken")
    shutil.copytree(ckpt, broken)
    break_file(os.path.join(broken, "rng_rank1.pt"), "zero")
    results = run_distributed(R.load_broken_then_intact, 2, 1, 2, 1, broken, ckpt, 3, timeout_s=240)
    for rank, out in enumerate(results):
        assert out["error"] is not None and os.path.join(broken, "rng_rank1.pt") in out["error"], (rank, out)
        assert out["step_count"] == 2 and out["lr"] == R.LR * R.LR_FACTOR
    assert "seen by rank 1" in results[0]["error"]


@pytest.mark.slow
def test_a_state_saved_before_the_first_step_loads_as_a_fresh_optimizer(tmp_path):
    """Adam holds no state before its first step: the load drops the moments this learner gathered since, so the
    first step is taken again exactly."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    spec = tiny_spec()
    seqs = make_sequences(spec, n=2)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2, seed=5))
    learner.save_run_state(str(tmp_path / "step0"))
    first = learner.train_step(seqs)
    after_first = learner.logprobs(seqs)
    learner.train_step(seqs)
    learner.load_run_state(str(tmp_path / "step0"))
    assert learner.step_count == 0
    again = learner.train_step(seqs)
    assert again["loss"] == first["loss"] and again["grad_norm"] == first["grad_norm"]
    for a, b in zip(after_first, learner.logprobs(seqs)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_state_saved_where_the_schedule_reached_zero_loads_and_an_extended_schedule_goes_on(tmp_path):
    """Would have caught: a finished run (cosine decayed to learner.min_lr=0 at its last step) could not be extended:
    `load_run_state` refused its saved learning rate (`ValueError: lr=0.0, expected a positive finite number`)."""
    import math

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner

    spec = tiny_spec()
    seqs = make_sequences(spec, n=2)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    for step in (1, 2):  # a 2-step run: the learning rate of its step 2 is min_lr
        learner.schedule_lr(step, 2)
        learner.train_step(seqs)
    assert learner.lr == 0.0
    learner.save_run_state(str(tmp_path / "end"))
    for decay_steps, want in ((2, 0.0), (4, 1e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))):
        again = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2, lr_decay_steps=decay_steps))
        again.load_run_state(str(tmp_path / "end"))
        assert again.step_count == 2 and again.lr == 0.0
        # Extended to steps=4: lr_decay_steps keeps the saved schedule (2) or stretches it (4); never steps alone.
        assert again.schedule_lr(3, 4) == pytest.approx(want, rel=1e-12, abs=0.0)
        assert np.isfinite(again.train_step(seqs)["loss"]) and again.step_count == 3


def adam_moments(learner):
    """Every parameter's Adam moments, in the optimizer's order."""
    from moe_grpo.learner.optimizer import sub_optimizers

    out = []
    for opt in sub_optimizers(learner.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state.get(p, {})
                out += [state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


@pytest.mark.slow
def test_a_rollback_restores_the_checkpoint_from_before_the_jump_tensor_by_tensor(tmp_path):
    """The collapse guard's restore on a real learner: a checkpoint after every step (as the driver writes them,
    with the jump watch's count), a rollout-KL jump first seen at step 6 and acted on at step 7
    (routing.jump_sustain=2). Would have caught: the guard restored the newest checkpoint, step 6's, written on the
    jump's first step with weights trained on the jumped batch (and spent a rollback on it); the checkpoint from
    before the jump (step 5) is the target, and every parameter and Adam moment comes back as saved."""
    import torch

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.orchestrator import run_checkpoint as rc
    from moe_grpo.orchestrator.watch import JumpWatch

    spec = tiny_spec()
    seqs = make_sequences(spec, n=2)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    watch = JumpWatch(5.0, 20)
    saved = {}
    for step, kl in enumerate([1e-3] * 5 + [0.5, 0.5], start=1):
        learner.train_step(seqs)
        watch.update({"step": step, "train/rollout_kl": kl})
        if watch.in_a_row >= 2:
            break  # the guard acts before this step's checkpoint
        tmp = rc.begin(tmp_path, step)
        learner.save_run_state(str(tmp / "learner"))
        rc.finish(tmp, {"step": step}, {"step": step, "jump_in_a_row": watch.in_a_row}, keep=3)
        saved[step] = ([p.detach().clone() for p in learner.module.parameters()], adam_moments(learner))
    assert step == 7 and sorted(saved) == [1, 2, 3, 4, 5, 6]
    target = rc.rollback_target(tmp_path, step - watch.in_a_row + 1)
    assert target == tmp_path / "checkpoints" / "step_000005", "kept: 4, 5, 6; 6 is inside the jump"
    learner.load_run_state(str(target / "learner"))
    params, moments = saved[5]
    restored_params, restored_moments = list(learner.module.parameters()), adam_moments(learner)
    assert len(restored_params) == len(params) and len(restored_moments) == len(moments) > 0
    for i, (want, got) in enumerate(zip(params + moments, restored_params + restored_moments)):
        assert torch.equal(want, got.detach()), f"tensor {i} differs from the checkpoint's"
    jumped_params, jumped_moments = saved[6]
    assert any(not torch.equal(a, b) for a, b in zip(jumped_params + jumped_moments, params + moments)), \
        "step 6's checkpoint differs from step 5's, so restoring the wrong one shows"
