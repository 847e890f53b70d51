"""The mismatch probe's copy of a version is what the engines hold: with bf16 engines, the weights rounded to bf16."""

import os

import pytest

from moe_grpo.learner.spawn import run_distributed

pytestmark = pytest.mark.multiprocess  # a learner rank (LearnerWorker) in a process of its own


def run_config(overrides):
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_grpo.config import CONF_DIR, defaults_tree, from_hydra

    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return from_hydra(compose(config_name="config", overrides=overrides))


def probe_after_publish(run, root: str) -> dict:
    """A learner rank publishes version 1 with a probe snapshot; its engine-side log-probs come from the same
    weights rounded to bf16 (computed in fp32: only the weights differ from the learner's). Returns the probe of
    version 1 and, for comparison, the probe of the unrounded weights (version 2, a plain snapshot)."""
    import torch

    from layout_scenarios import make_sequences
    from moe_grpo.learner.parallel import SECRET_ENV
    from moe_grpo.orchestrator.learner_actor import LearnerWorker

    worker = LearnerWorker(0, 1, "127.0.0.1", int(os.environ["MASTER_PORT"]), run, root,
                           secret=os.environ[SECRET_ENV])
    learner = worker.learner
    seqs = make_sequences(run.model, n=4, seed=3)
    params = list(learner.module.parameters())
    live = [p.data for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16).to(p.dtype)
    engine_lps = learner.logprobs(seqs, replay=True)
    for p, data in zip(params, live):
        p.data = data
    for s, lp in zip(seqs, engine_lps):
        s.old_logprobs = lp[s.prompt_len - 1:]
    worker.publish(1, background=False, snapshot=True)
    learner.snapshot_weights(2)  # the fp32 weights themselves
    return {"as_served": worker.probe(seqs, 1), "fp32": worker.probe(seqs, 2),
            "dtype": str(next(iter(learner.module.parameters())).dtype)}


def test_with_bf16_engines_the_probe_scores_with_the_weights_rounded_as_the_engines_hold_them(tmp_path):
    """Would have caught: the probe scoring a bf16 engine's samples with the learner's fp32 weights, so that its KL
    mixes the engine's numerics with the weights' rounding (see probe.py's docstring for the figures) instead of
    measuring the gap on the same weights."""
    run = run_config(["rollout.dtype=bfloat16"])
    out = run_distributed(probe_after_publish, 1, run, str(tmp_path / "shm"))[0]
    assert out["dtype"] == "torch.float32"  # the learner's own weights stay fp32
    # Same weights, same (replayed) routing, fp32 arithmetic on both sides: no gap.
    assert out["as_served"]["kl_replay_on"] < 1e-9, out
    # Scored with the unrounded weights, the rounding alone shows up as a gap.
    assert out["fp32"]["kl_replay_on"] > 1e-8, out
