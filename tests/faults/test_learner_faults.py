"""Faults inside the learner, injected into a real run: a NaN gradient, a learner that keeps producing NaN, and a
sustained rollout-KL jump with the collapse guard on (`routing.on_jump=rollback`)."""

import dataclasses
import json
import logging

import pytest

from moe_grpo.config import from_hydra, load_model_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def small_run(**overrides):
    tree = {"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "warm_start_steps": 2, "eval_every": 0,
            "algo": {"prompts_per_step": 4, "group_size": 4}, "rollout": {"max_tokens": 8, "max_num_seqs": 32},
            "mode": "sync"}
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[name] = value
    return from_hydra(tree)


def test_nan_gradients_are_skipped_a_sustained_jump_rolls_back_and_nan_in_a_row_stops_the_run(tmp_path, caplog,
                                                                                               on_session_ray):
    """One run (16 steps planned, a checkpoint every 3): a NaN gradient at step 3, a sustained jump at steps 9-10
    with the collapse guard on, then NaN gradients at steps 13 and 14 with learner.max_skipped_in_a_row=2. Step 9's
    checkpoint is written on the jump's first step: before 2026-11-26 the guard restored it (the newest), weights
    trained on the jumped batch."""
    from faulty_learner import FaultyLearner
    from moe_grpo.orchestrator.training_run import train

    run = small_run(steps=16, **{"learner.lr_decay": "constant",  # the rollback's halving reads off learner/lr
                                 "checkpoint.every": 3, "routing.on_jump": "rollback", "routing.jump_sustain": 2,
                                 "routing.rollback_lr_factor": 0.5, "learner.max_skipped_in_a_row": 2})
    with caplog.at_level(logging.INFO, logger="moe_grpo"):
        with pytest.raises(RuntimeError, match=r"2 steps in a row \(through step 14\) had a non-finite loss or "
                                               r"gradient.*learner.max_skipped_in_a_row=2.*last checkpoint: "
                                               r".*step_000012"):
            train(on_session_ray(run), tmp_path, learner_cls=FaultyLearner)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 15)), "the run stopped after step 14, every step logged"
    # Step 3's gradient held a NaN: no update, counted; the steps around it trained.
    assert [r["faults/steps_skipped"] for r in rows][1:4] == [0, 1, 1]
    # Steps 9 and 10 jumped: step 10's weights were never published; the checkpoint of step 6 (the newest from
    # before the jump; step 9's is inside it) was restored at half the learning rate, published as version 10, and
    # training went on from it.
    assert [r["watch/rollbacks"] for r in rows][8:12] == [0, 1, 1, 1]
    assert [r["learner/lr_scale"] for r in rows][8:12] == [1.0, 0.5, 0.5, 0.5]
    assert [r["learner/lr"] for r in rows][10] == pytest.approx(0.5 * run.learner.lr)
    assert [r["watch/jumps"] for r in rows][8:12] == [1, 2, 2, 2], "the running level restored: no jump after"
    # Steps 13 and 14: two non-finite steps in a row stop the run (no update taken by either).
    assert [r["faults/steps_skipped"] for r in rows][11:] == [1, 2, 3]
    text = caplog.text
    assert "step 3 skipped (learner: " in text and "non-finite" in text
    assert "collapse guard" in text and "restored step_000006" in text
    assert "checkpoint of step 10 written" in text and ", on rollback)" in text, "the restored state, checkpointed"
