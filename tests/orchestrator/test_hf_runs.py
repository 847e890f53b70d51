"""Runs from transformers-written checkpoints (own tokenizer files, chat template) with 2 learner ranks.

Each run: init.hf -> model from config.json, learner from the cached Megatron conversion, engine from the
checkpoint, prompts through the chat template; 3 steps (Qwen3-MoE at EP=2, DeepSeek-V3 at TP=2; 1 engine + 2 learner actors on 2
cores); the final policy exported; a fresh vLLM engine serves the export and its sampled log-probs are compared
with a Megatron learner's at the same layout. The Qwen3-MoE EP=2 run also trains on a GSM8K-format JSONL
file with bad rows and a user reward that raises or returns NaN on some rows; the DeepSeek-V3 TP=2 run on verl's
prepared GSM8K layout (Parquet, chat messages, the answer in `reward_model.ground_truth`).
"""

import json
import os
import sys

import pytest

from moe_grpo.config import from_hydra

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "checkpoint"))
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])

# Largest |vLLM - learner| per-token log-prob on tokens vLLM sampled from the export (fp32 both sides).
# Measured 2026-11-23: at most 9.5e-7 for both families at EP=2 and TP=2 (DeepSeek-V3 was 5.6e-4 before the
# cpu_rotary_multihead_3d vLLM patch: the bound would catch that bug coming back).
TOLERANCE = {"qwen3_moe": 1e-4, "deepseek_v3": 1e-4}

QA = [(1000, 250), (3, 4), (48, 24), (12, 50), (7, 8), (100, 900)]


def write_gsm8k(path):
    """GSM8K's format (question, answer ending in '#### N', thousands separators) plus bad rows; returns the
    line numbers of the bad ones. Every third good row's user reward raises, every fourth gives one NaN."""
    good = [json.dumps({"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}",
                        "trap": ["none", "none", "raise", "nan"][i % 4], "source": f"row{i}"})
            for i, (a, b) in enumerate(QA)]
    bad = ["{not json", json.dumps({"question": "What is 2 + 2?"}), json.dumps({"question": "", "answer": "#### 4"}),
           json.dumps({"question": "What is 2 + 3?", "answer": "five"})]
    lines = good[:2] + bad[:1] + good[2:3] + bad[1:] + good[3:]
    path.write_text("\n".join(lines) + "\n")
    return [lines.index(b) + 1 for b in bad]


def write_verl_gsm8k(path):
    """The layout of verl's examples/data_preprocess/gsm8k.py: `prompt` as chat messages, the answer as a bare number
    in `reward_model.ground_truth`, beside `data_source`, `ability` and `extra_info`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "ability": "math", "extra_info": {"split": "train", "index": i},
             "prompt": [{"role": "system", "content": "Reply with the number."},
                        {"role": "user", "content": f"What is {a} + {b}?"}],
             "reward_model": {"style": "rule", "ground_truth": f"{a + b:,}"}} for i, (a, b) in enumerate(QA)]
    pq.write_table(pa.Table.from_pylist(rows), str(path))


def hf_run(hf, cache, layout, **extra):
    tp, ep = (2, 1) if layout == "TP=2" else (1, 2)
    tree = {"steps": 3, "warm_start_steps": 0, "eval_every": 0, "mode": "sync",
            "init": {"hf": hf, "cache_dir": str(cache)}, "parallel": {"tensor_parallel": tp, "expert_parallel": ep},
            "cluster": {"learner_cpus": 0.5, "engine_cpus": 1.0}, "algo": {"prompts_per_step": 4, "group_size": 4},
            "learner": {"lr": 1e-3}, "rollout": {"max_tokens": 8, "max_num_seqs": 32}}
    tree.update(extra)
    return from_hydra(tree), tp, ep


# Each family once and each layout once (every run starts two engines: ~3 min each on 2 cores). Each family at
# every learner layout is checked without a run: conversion in tests/checkpoint/test_convert.py, the engine after
# a sync from that layout in tests/rollout/test_families.py.
@pytest.mark.parametrize("kind,layout", [("qwen3_moe", "EP=2"), ("deepseek_v3", "TP=2")])
def test_run_from_a_transformers_checkpoint_trains_exports_and_vllm_serves_the_export(
        hf_checkpoints, kind, layout, tmp_path, caplog, monkeypatch, on_session_ray):
    from export_check import served_vs_learner
    from moe_grpo.orchestrator.training_run import train

    paths, root = hf_checkpoints  # tests/conftest.py: shared with test_lora_runs, one conversion per family
    gsm8k = kind == "qwen3_moe" and layout == "EP=2"
    extra = {}
    if gsm8k:
        data = tmp_path / "train.jsonl"
        bad_lines = write_gsm8k(data)
        monkeypatch.setenv("USER_REWARD_LOG", str(tmp_path / "reward_calls.jsonl"))
        extra = {"task": {"name": "gsm8k"}, "data": {"train_path": str(data)},
                 "reward": {"fn": ["moe_grpo.reward.math_answer:math_answer_reward", "user_rewards:length_penalty"],
                            "weights": [1.0, 0.5]}}
    else:  # verl's prepared GSM8K as it is: Parquet, chat messages with a system turn, a bare-number ground truth
        data = tmp_path / "train.parquet"
        write_verl_gsm8k(data)
        # A KL penalty without a warm start (the usual set-up from a checkpoint): the reference is the checkpoint's
        # weights (before, no reference was set without a warm start and the first step raised).
        extra = {"task": {"name": "gsm8k"},
                 "data": {"train_path": str(data), "prompt_key": "prompt", "answer_key": "reward_model.ground_truth"},
                 "algo": {"prompts_per_step": 4, "group_size": 4, "kl_coef": 0.05}}
    run, tp, ep = hf_run(paths[kind], root / "cache", layout, **extra)
    assert run.model.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[kind]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with caplog.at_level("INFO", logger="moe_grpo"):
        summary = train(on_session_ray(run), run_dir)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/rollout_kl"] < 1e-3 for r in rows), [r["train/rollout_kl"] for r in rows]
    assert rows[-1]["mismatch/kl"] < 1e-3, "the probe measured the engine-vs-learner gap on the same weights"
    # the learner started from the checkpoint's weights (converted once per checkpoint, then reused)
    assert "converted" in caplog.text or "reusing the Megatron checkpoint" in caplog.text
    assert len([d for d in os.listdir(root / "cache") if d.startswith(kind)]) == 1
    if not gsm8k:  # the penalty was computed each step (NaN without a reference); the first step's weights are it
        kl = [r["kl/reference"] for r in rows]
        assert all(k >= 0 for k in kl) and abs(kl[0]) < 1e-6, kl  # NaN fails k >= 0
        # every verl row trained (none bad), the rewards scored (none failed: the built-in reward read the nested
        # ground truth), through the chat template with the system turn
        assert "data: 6 training rows" in caplog.text and summary["bad_rows"] == 0
        assert all(r["reward/failed"] == 0 for r in rows), [r["reward/failed"] for r in rows]
    if gsm8k:
        assert "data: 6 training rows" in caplog.text
        assert summary["bad_rows"] == 4 and all(r["data/bad_rows"] == 4 for r in rows)
        for line in bad_lines:
            assert f"train.jsonl:{line}:" in caplog.text, line
        assert rows[-1]["reward/failed"] > 0, "rows marked raise / nan were sampled and counted"
        calls = [json.loads(line) for line in open(tmp_path / "reward_calls.jsonl")]
        assert {"answer", "trap", "source"} == set(calls[0]["fields"])  # the row's fields, prompt excluded
        assert all(len(set(c["fields"]["source"])) == 1 and len(c["prompts"]) == 4 for c in calls)
        assert calls[0]["prompts"][0].startswith("What is ")  # the row's text, not the chat-templated prompt
        # the run's rewards on its rows: `#### 1,250` is 1250 (plus the user's weighted length penalty)
        import numpy as np

        from moe_grpo.data.prompts import group_fields
        from moe_grpo.orchestrator.run_prompts import prompt_source
        from moe_grpo.data.tokenizer import HFTokenizer
        from moe_grpo.reward.functions import Rewards

        source = prompt_source(run, HFTokenizer(paths[kind]), np.random.default_rng(0))
        row = next(e for e in source.train if e.fields["answer"].endswith("#### 1,250"))
        scores = Rewards(*run.reward.resolved(run.task.name)).score([row.prompt] * 2, ["1250", "125"],
                                                                     group_fields(row, 2))
        assert scores.rewards.tolist() == pytest.approx([1.0 - 0.5 * 0.04, -0.5 * 0.03])
    policy = summary["policy_dir"]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(policy))
    config = json.loads(open(os.path.join(policy, "config.json")).read())
    original = json.loads(open(os.path.join(paths[kind], "config.json")).read())
    assert config["eos_token_id"] == original["eos_token_id"]
    report = served_vs_learner(policy, tp, ep, ["What is 3 + 4?", "What is 1000 + 250?"], tmp_path)
    print(kind, layout, report)
    assert report["max_abs_logprob_diff"] < TOLERANCE[kind], report
