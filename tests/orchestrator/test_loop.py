"""The driver on real parts (Ray actors, Megatron learner, vLLM engine): schedules, staleness, the run record."""

import json
import os
import sys

import pytest

from moe_grpo.config import from_hydra, load_model_spec
from moe_grpo.orchestrator.run_record import REQUIRED_KEYS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])


def small_run(**overrides):
    import dataclasses

    tree = {"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "steps": 6, "warm_start_steps": 2,
            "eval_every": 3, "algo": {"prompts_per_step": 4, "group_size": 4},
            "rollout": {"max_tokens": 8, "max_num_seqs": 32}}
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[name] = value
    return from_hydra(tree)


def rows_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_with_a_slow_learner_no_trained_token_is_older_than_max_staleness(tmp_path):
    from moe_grpo.orchestrator.driver import train
    from slow_learner import SlowLearner

    run = small_run(**{"algo.max_staleness": 1, "eval_every": 0, "steps": 5})
    summary = train(run, tmp_path, learner_cls=SlowLearner)
    rows = rows_of(tmp_path)
    assert summary["steps"] == 5 and len(rows) == 5
    assert all(r["staleness/max"] <= 1 for r in rows), [r["staleness/max"] for r in rows]
    # The engine ran ahead of the slow learner: stale tokens existed and were either trained at the bound or dropped.
    assert max(r["staleness/max"] for r in rows) == 1 or rows[-1]["buffer/dropped_stale"] > 0


def test_sync_mode_trains_on_policy_and_records_every_key(tmp_path):
    from moe_grpo.orchestrator.driver import train

    summary = train(small_run(mode="sync", steps=4, eval_every=2), tmp_path)
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert not [k for k in REQUIRED_KEYS if k not in r]
        assert r["staleness/max"] == 0, "sync: every batch is sampled by the weights it trains"
        assert r["replay/applied"] == 1.0
        assert 0 <= r["mismatch/router_disagreement"] <= 1 and r["mismatch/kl"] >= 0
    assert [s for s, _ in summary["evals"]] == [0, 2, 4]
    assert (tmp_path / "metrics.png").stat().st_size > 10_000
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tensorboard").iterdir())


def test_r2_and_dapo_with_a_kl_penalty_train_and_record_their_keys(tmp_path):
    from moe_grpo.orchestrator.driver import train

    run = small_run(mode="sync", steps=3, eval_every=0,
                    **{"routing.replay": "r2", "algo.loss": "dapo", "algo.kl_coef": 0.05})
    assert run.algo.dynamic_sampling and run.algo.clip_ratio_high == 0.28
    train(run, tmp_path)
    rows = rows_of(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert not [k for k in REQUIRED_KEYS if k not in r]
        assert r["replay/applied"] == 1.0, "r2 replays the learner's recorded routing in every router call"
        assert 0 <= r["correction/truncated_fraction"] <= 1 and 0 <= r["correction/masked_fraction"] <= 1
    # The reference is the warm-started weights: no distance at the first step, some after two updates.
    assert abs(rows[0]["kl/reference"]) < 1e-6 and rows[-1]["kl/reference"] > 0
