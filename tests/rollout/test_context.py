"""The engines' context (`rollout.max_model_len`): decided from the prompts and `max_tokens`, refused when they
cannot fit; and an engine started from it gives completions as long as `max_tokens` asks, past the old 512."""

import asyncio
import json
import os

import numpy as np
import pytest

from moe_grpo.orchestrator.config import RolloutConfig
from moe_grpo.rollout.context import context_length


def test_auto_is_the_longest_prompt_plus_max_tokens():
    assert context_length(RolloutConfig(max_tokens=600), 4096, longest_prompt=7) == 607
    assert context_length(RolloutConfig(max_tokens=600, max_model_len=1000), 4096, longest_prompt=7) == 1000
    assert context_length(RolloutConfig(max_tokens=16), 512) == 512, "prompts unknown: the model's whole context"


def test_prompts_plus_max_tokens_that_cannot_fit_are_refused_with_the_numbers():
    with pytest.raises(ValueError) as e:
        context_length(RolloutConfig(max_tokens=600), 512, longest_prompt=7)
    assert "7 tokens" in str(e.value) and "rollout.max_tokens=600" in str(e.value) and "607" in str(e.value)
    assert "max_position_embeddings=512" in str(e.value)
    with pytest.raises(ValueError) as e:
        context_length(RolloutConfig(max_tokens=100, max_model_len=256), 4096, longest_prompt=200, where="a.jsonl:3")
    assert all(s in str(e.value) for s in ("200 tokens, a.jsonl:3", "rollout.max_tokens=100", "300",
                                             "rollout.max_model_len=256"))
    # The remedies fit the numbers: a prompt longer than the whole context is not fixed by a smaller max_tokens
    # (a user's trial, 2026-11-28: "shorten the prompts or lower rollout.max_tokens" for a 603-token prompt in 512).
    with pytest.raises(ValueError) as e:
        context_length(RolloutConfig(max_tokens=16), 512, longest_prompt=603, where="long.jsonl:8", dataset=True)
    assert str(e.value).endswith("skip longer prompts as bad rows with data.max_prompt_tokens=496"), str(e.value)
    with pytest.raises(ValueError) as e:
        context_length(RolloutConfig(max_tokens=100, max_model_len=256), 4096, longest_prompt=200, where="a.jsonl:3",
                       dataset=True)
    assert str(e.value).endswith("data.max_prompt_tokens=156, or lower rollout.max_tokens to 56, or raise "
                                 "rollout.max_model_len to 300"), str(e.value)
    with pytest.raises(ValueError, match="max_tokens=600 needs 607 tokens, .*; lower rollout.max_tokens to 505$"):
        context_length(RolloutConfig(max_tokens=600), 512, longest_prompt=7, where="task.max_len=5")
    with pytest.raises(ValueError, match=r"rollout.max_model_len=8192 exceeds the model's context "
                                         r"\(max_position_embeddings=4096\)"):
        context_length(RolloutConfig(max_model_len=8192), 4096, longest_prompt=7)
    with pytest.raises(ValueError, match="rollout.max_model_len=-1: expected an integer >= 0"):
        RolloutConfig(max_model_len=-1)


def test_a_run_is_refused_before_anything_starts(tmp_path):
    """The run's own path: the prompt source's longest prompt (task.max_len letters, <bos>, marker)."""
    from moe_grpo.config import from_hydra, load_model_spec
    from moe_grpo.orchestrator.run_prompts import engine_context, prompt_source
    from moe_grpo.data.tokenizer import ByteTokenizer

    import dataclasses

    spec = dataclasses.asdict(load_model_spec("deepseek_moe"))  # max_position_embeddings 512
    run = from_hydra({"model": spec, "task": {"max_len": 9}, "rollout": {"max_tokens": 502}})
    source = prompt_source(run, ByteTokenizer(run.model.vocab_size), np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"longest prompt \(11 tokens, task.max_len=9\) plus rollout.max_tokens=502 "
                                         r"needs 513 tokens, more than the model's context \(max_position_embeddings=512\)"):
        engine_context(run, source)
    run = from_hydra({"model": spec, "task": {"max_len": 9}, "rollout": {"max_tokens": 501}})
    assert engine_context(run, source) == 512


def test_data_max_prompt_tokens_skips_longer_prompts_as_bad_rows_and_the_run_fits(tmp_path, caplog):
    """Over-long rows refused the whole run; `data.max_prompt_tokens` (verl's filter_overlong_prompts with
    max_prompt_length) skips them instead, counted and listed with their lines, in training and held-out files,
    and logged one by one as other bad rows are (they were in bad_rows.txt only, and the count joined both files:
    a user's trial, 2026-11-28)."""
    from moe_grpo.config import from_hydra, load_model_spec
    from moe_grpo.orchestrator.run_prompts import engine_context, prompt_source
    from moe_grpo.data.tokenizer import ByteTokenizer

    import dataclasses

    rows = [{"prompt": "ab"}, {"prompt": "x" * 600}, {"prompt": "abcd"}]
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = dataclasses.asdict(load_model_spec("deepseek_moe"))  # max_position_embeddings 512
    data = {"train_path": str(tmp_path / "train.jsonl"), "eval_path": str(tmp_path / "eval.jsonl")}
    tokenizer = ByteTokenizer(512)
    run = from_hydra({"model": spec, "warm_start_steps": 0, "reward": {"fn": "user_rewards:length_penalty"},
                      "data": data})
    with pytest.raises(ValueError, match=r"600 tokens|60\d tokens"):
        engine_context(run, prompt_source(run, tokenizer, np.random.default_rng(0)))
    run = from_hydra({"model": spec, "warm_start_steps": 0, "reward": {"fn": "user_rewards:length_penalty"},
                      "data": {**data, "max_prompt_tokens": 100}})
    with caplog.at_level("INFO", logger="moe_grpo"):
        source = prompt_source(run, tokenizer, np.random.default_rng(0), str(tmp_path))
    assert "data: skipped " in caplog.text and "train.jsonl:2: prompt of" in caplog.text
    assert "eval.jsonl:2: prompt of" in caplog.text
    assert "2 bad row(s) skipped (1 training, 1 held-out)" in caplog.text
    assert [e.prompt for e in source.train] == ["ab", "abcd"] and [e.prompt for e in source.held_out] == ["ab", "abcd"]
    assert [(b.path.rsplit("/", 1)[-1], b.line) for b in source.bad] == [("train.jsonl", 2), ("eval.jsonl", 2)]
    assert "more than data.max_prompt_tokens=100" in (tmp_path / "bad_rows.txt").read_text()
    assert engine_context(run, source) == source.longest_prompt()[0] + run.rollout.max_tokens
    run = from_hydra({"model": spec, "warm_start_steps": 0, "reward": {"fn": "user_rewards:length_penalty"},
                      "data": {**data, "max_prompt_tokens": 1}})
    with pytest.raises(ValueError, match=r"data.train_path='.*train.jsonl': none of its 3 readable rows is usable "
                                         r"\(first: .*train.jsonl:1: prompt of \d+ tokens, more than "
                                         r"data.max_prompt_tokens=1\)"):
        prompt_source(run, tokenizer, np.random.default_rng(0))


@pytest.mark.vllm
def test_an_engine_with_max_tokens_600_gives_completions_past_512_tokens(tmp_path):
    """The engine actor's path (EngineWorker, made and then started as the run does, with the context the run
    decides) on a random model whose context is 1024: a completion that does not stop runs to max_tokens=600."""
    import torch

    from layout_scenarios import tiny_spec
    from moe_grpo.data.prompts import TaskPrompts
    from moe_grpo.data.tasks import TaskConfig
    from moe_grpo.data.tokenizer import ByteTokenizer
    from moe_grpo.orchestrator.engine_actor import EngineWorker
    from moe_grpo.rollout.context import context_length
    from moe_grpo.rollout.export import export_model_dir
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.sync.plan import plan_buckets

    spec = tiny_spec(max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)
    state = {e.name: (torch.ones(e.shape) if "norm" in e.name else 0.05 * torch.randn(e.shape, generator=g))
             for b in plan_buckets(spec, torch.float32, 1 << 16).buckets for e in b.entries}
    model_dir = export_model_dir(spec, state, tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == 1024
    source = TaskPrompts(TaskConfig(), ByteTokenizer(spec.vocab_size), np.random.default_rng(0))
    longest, _ = source.longest_prompt()
    rollout = RolloutConfig(max_tokens=600, max_num_seqs=4, request_timeout_s=300)
    rollout = RolloutConfig(**{**rollout.__dict__, "max_model_len": context_length(rollout, 1024, longest)})
    assert rollout.max_model_len == longest + 600 > 512
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # As a run starts it: the actor gets ready before its model directory exists, then starts on it.
    worker = EngineWorker("engine0", None, spec, rollout, str(tmp_path), str(tmp_path / "sync"))
    try:
        assert asyncio.run(worker.pid()) == 0, "no vLLM process before start"
        pid = asyncio.run(worker.start(str(model_dir)))
        assert pid == worker.engine.worker_pid > 0
        never_stops = SamplingSettings(n=1, temperature=0.0, max_tokens=rollout.max_tokens, stop_token_ids=())
        prompt = source.held_out[0].prompt_ids
        (out,) = asyncio.run(worker.generate(prompt, never_stops))
        assert out.ok, out.error
        assert len(out.token_ids) == 600 > 512 and out.finish_reason == "length"
        assert worker.engine.max_model_len == longest + 600
    finally:
        asyncio.run(worker.shutdown())
