"""What `python -m moe_grpo.evaluate` scores: the held-out set as a run builds it, and the policy's own tokenizer."""

import json

from moe_grpo.orchestrator.run_prompts import held_out_source
from moe_grpo.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, policy_tokenizer, write_tokenizer
from moe_grpo.evaluation.config import EvaluateConfig


def test_the_task_held_out_set_is_the_runs(tmp_path):
    from moe_grpo.data.tasks import TaskConfig, eval_examples

    (tmp_path / "config.json").write_text("{}")
    cfg = EvaluateConfig(policy=str(tmp_path), task=TaskConfig(name="sort", eval_size=12))
    tok = ByteTokenizer(512)
    source = held_out_source(cfg, tok)
    assert source.held_out == eval_examples(cfg.task, tok) and len(source.held_out) == 12
    assert all(e.answer == "".join(sorted(e.prompt[:-1])) for e in source.held_out)


def test_eval_path_rows_alone_with_bad_rows_counted_and_eval_size(tmp_path):
    from moe_grpo.data.config import DataConfig
    from moe_grpo.data.tasks import TaskConfig

    (tmp_path / "config.json").write_text("{}")
    rows = [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "no answer"},
            {"question": "2 + 2?", "answer": "#### 4"}, {"question": "3 + 3?", "answer": "#### 6"}]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = EvaluateConfig(policy=str(tmp_path), task=TaskConfig(name="gsm8k"),
                         data=DataConfig(eval_path=str(path), eval_size=2))
    source = held_out_source(cfg, ByteTokenizer(512))
    assert [e.prompt for e in source.held_out] == ["1 + 1?", "2 + 2?"] and source.bad_rows == 1
    assert [e.where for e in source.held_out] == ["test.jsonl:1", "test.jsonl:3"]
    assert source.longest_prompt() == (7, "test.jsonl:1")  # <bos> + 6 bytes


def test_a_runs_policy_gets_the_byte_tokenizer_a_checkpoint_its_own(tmp_path):
    from moe_grpo.config import load_model_spec

    spec = load_model_spec("deepseek_moe")
    write_tokenizer(tmp_path / "ours", spec.vocab_size)
    assert isinstance(policy_tokenizer(spec, tmp_path / "ours"), ByteTokenizer)
    other = json.loads((tmp_path / "ours" / "tokenizer.json").read_text())
    other["truncation"] = {"direction": "Right", "max_length": 1000, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "theirs").mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "theirs" / name).write_text((tmp_path / "ours" / name).read_text())
    (tmp_path / "theirs" / "tokenizer.json").write_text(json.dumps(other))
    assert isinstance(policy_tokenizer(spec, tmp_path / "theirs"), HFTokenizer)


def test_training_from_a_runs_policy_encodes_prompts_as_the_policy_was_trained(tmp_path):
    """`init.hf=<a run's policy/>`: prompts start with <bos> as in the run that trained it."""
    from moe_grpo.config import load_model_spec

    spec = load_model_spec("deepseek_moe")
    write_tokenizer(tmp_path, spec.vocab_size)
    tokenizer = load_tokenizer(spec, str(tmp_path))
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.encode("abc<rev>") == ByteTokenizer(spec.vocab_size).encode("abc<rev>")
    assert tokenizer.encode("abc")[0] == 1  # <bos>
