"""Datasets: JSONL and Parquet rows, bad rows skipped with their line numbers, prompts through the chat template."""

import json
import os
import sys

import numpy as np
import pytest

from moe_grpo.config import from_hydra, load_model_spec
from moe_grpo.data.dataset import read_rows
from moe_grpo.orchestrator.run_prompts import prompt_source
from moe_grpo.data.tokenizer import ByteTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoint"))

GOOD = [{"question": "What is 1000 + 250?", "answer": "1000 + 250 = 1250\n#### 1,250", "level": 1},
        {"question": "What is 3 + 4?", "answer": "#### 7", "level": 2}]


def write_gsm8k(path):
    lines = [json.dumps(GOOD[0]),                                   # line 1
             "{this is not json",                                   # line 2
             json.dumps({"question": "What is 2 + 2?"}),           # line 3: no answer
             "",                                                    # line 4: blank, not a row
             json.dumps({"question": "  ", "answer": "#### 4"}),   # line 5: empty question
             json.dumps({"question": "2 + 3?", "answer": "five"}), # line 6: no #### N
             json.dumps(["a", "list"]),                             # line 7
             json.dumps(GOOD[1])]                                   # line 8
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def run_config(**data):
    import dataclasses

    return from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "task": {"name": "gsm8k"},
                       "warm_start_steps": 0, "data": data})


def test_gsm8k_jsonl_keeps_good_rows_and_names_each_bad_one_by_line(tmp_path, caplog):
    path = write_gsm8k(tmp_path / "train.jsonl")
    tok = ByteTokenizer(512)
    with caplog.at_level("WARNING", logger="moe_grpo"):
        source = prompt_source(run_config(train_path=path), tok, np.random.default_rng(0), str(tmp_path))
    assert [e.prompt for e in source.train] == [r["question"] for r in GOOD]
    assert source.bad_rows == 5
    assert [b.line for b in source.bad] == [2, 3, 5, 6, 7]
    reasons = {b.line: b.reason for b in source.bad}
    assert "not valid JSON" in reasons[2] and "missing field(s) ['answer']" in reasons[3]
    assert "empty field(s) ['question']" in reasons[5] and "no '#### N'" in reasons[6]
    for line in (2, 3, 5, 6, 7):
        assert f"train.jsonl:{line}:" in caplog.text
    assert (tmp_path / "bad_rows.txt").read_text().count("train.jsonl:") == 5
    # the reward gets every field but the prompt
    assert source.train[0].fields == {"answer": GOOD[0]["answer"], "level": 1}
    assert source.train[0].where == "train.jsonl:1"
    # rows come in a fresh order each pass, each row once per pass
    taken = [e.prompt for e in source.take(6)]
    assert sorted(taken[:2]) == sorted(taken[2:4]) == sorted(r["question"] for r in GOOD)


def test_a_prompt_that_is_not_text_or_chat_messages_is_a_bad_row_named_by_its_type(tmp_path):
    """A number or an object as the prompt was trained on as its Python repr, silently (a user's trial,
    2026-11-28). Now such a row is skipped as a bad row saying what it is and what is expected."""
    rows = [{"prompt": "abc"}, {"prompt": {"text": "hi"}}, {"prompt": 12345}, {"prompt": "de"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = prompt_source(user_reward_run(path), ByteTokenizer(512), np.random.default_rng(0))
    assert [e.prompt for e in source.train] == ["abc", "de"]
    reasons = {b.line: b.reason for b in source.bad}
    assert reasons[2].startswith("field 'prompt' is an object (") and "expected text or a list of chat" in reasons[2]
    assert reasons[3].startswith("field 'prompt' is a number ('12345')"), reasons


def user_reward_run(path, **data):
    import dataclasses

    return from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "warm_start_steps": 0,
                       "reward": {"fn": "user_rewards:length_penalty"}, "data": {"train_path": str(path), **data}})


CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 3 + 4?"}]


def test_chat_message_prompts_go_through_the_chat_template_and_reach_the_reward_as_messages(tmp_path):
    """TRL's and verl's datasets give each prompt as chat messages (`[{"role": ..., "content": ...}]`); they were
    all bad rows ("expected text"), so such a dataset could not train at all. Now the checkpoint's chat template
    renders the whole conversation (system turn included, generation prompt added), the reward gets the messages as
    the row's prompt (as TRL hands conversational prompts to its reward functions), and a malformed message is a
    bad row naming the message."""
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.tokenizer import HFTokenizer

    rows = [{"prompt": CHAT, "answer": "7"},
            {"prompt": [{"role": "user"}], "answer": "1"},                                        # no content
            {"prompt": [{"role": "user", "content": [{"type": "image"}]}], "answer": "2"},         # not text
            {"prompt": [{"content": "hi"}], "answer": "3"},                                       # no role
            {"prompt": "What is 1 + 1?", "answer": "2"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = HFTokenizer(make_tokenizer(tmp_path / "chat"))
    source = prompt_source(user_reward_run(path), tok, np.random.default_rng(0))
    assert [e.prompt for e in source.train] == [CHAT, "What is 1 + 1?"]
    chat = source.train[0]
    assert tok.tok.decode(chat.prompt_ids) == ("<|user|>Answer with a number.<|end|><|user|>What is 3 + 4?<|end|>"
                                               "<|assistant|>")
    assert chat.fields == {"answer": "7"} and chat.where == "train.jsonl:1"
    reasons = {b.line: b.reason for b in source.bad}
    assert reasons == {2: "field 'prompt': message 1 has no 'content'",
                       3: "field 'prompt': message 1's 'content' part 1 is of type 'image': a text model takes text "
                          "parts only",
                       4: "field 'prompt': message 1 has no 'role'"}, reasons
    # the same rows give the same place in the pass on a resume (messages hashed as they are, not rendered)
    again = prompt_source(user_reward_run(path), tok, np.random.default_rng(0))
    assert again.fingerprint() == source.fingerprint()


QWEN_LIKE = ("{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant', 'tool'] %}<|user|>"
             "{{ m['content'] }}<|end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Qwen's templates' shape: a role they do not know is left out without an error."""
NO_SYSTEM = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<|user|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
             "{% endif %}")
"""Gemma's templates' shape: a system turn raises."""


def test_a_message_the_template_leaves_out_or_refuses_is_a_bad_row_and_a_file_of_them_is_refused_by_its_cause(
        tmp_path):
    """From a review of the chat-prompt change: a ShareGPT role ("human") that Qwen's template skips rendered every
    prompt as the generation prompt alone, with no bad row; a template refusing system turns on every row ended in
    "no prompt of its 3 usable rows fits data.max_prompt_tokens=None", and a held-out file refused whole in "no
    held-out set (data.eval_path is not set)"; a conversation of blank messages was accepted."""
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.tokenizer import HFTokenizer

    rows = [{"prompt": [{"role": "human", "content": "What is 3 + 4?"}]}, {"prompt": CHAT},
            {"prompt": [{"role": "user", "content": "  "}]}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = HFTokenizer(make_tokenizer(tmp_path / "chat"))
    tok.tok.chat_template = QWEN_LIKE
    source = prompt_source(user_reward_run(path), tok, np.random.default_rng(0))
    assert [e.prompt for e in source.train] == [CHAT]
    assert {b.line: b.reason for b in source.bad} == {
        1: "field 'prompt': message 1 (role 'human') is not in the rendered prompt: the chat template dropped it "
           "(a role it does not know?)",
        3: "field 'prompt': no message has any text"}
    tok.tok.chat_template = NO_SYSTEM
    path.write_text(json.dumps({"prompt": CHAT}) + "\n")
    with pytest.raises(ValueError, match=r"data.train_path='.*train.jsonl': none of its 1 readable rows is usable "
                                         r"\(first: .*train.jsonl:1: field 'prompt': the chat template refused it "
                                         r"\(TemplateError: System role not supported\)\)"):
        prompt_source(user_reward_run(path), tok, np.random.default_rng(0))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text(json.dumps({"prompt": CHAT}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "What is 3 + 4?"}) + "\n")
    with pytest.raises(ValueError, match=r"data.eval_path='.*eval.jsonl': none of its 1 readable rows is usable"):
        prompt_source(user_reward_run(tmp_path / "text.jsonl", eval_path=str(held_out)), tok,
                      np.random.default_rng(0))


TOOLS_AWARE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% if 'tool_calls' in m %}"
               "{% for t in m['tool_calls'] %}[{{ t['name'] }}]{% endfor %}{% endif %}<|end|>{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Llama 3's templates' shape: a message's `tool_calls` rendered when the key is there."""


def test_parquet_messages_lose_the_null_keys_of_their_schema_and_a_final_assistant_turn_is_continued(tmp_path):
    """Parquet stores a file's messages as one struct: one message with `tool_calls` gave every other message
    `tool_calls: None`, and a template testing for the key refused every row ("'NoneType' object is not iterable");
    a conversation ending with an assistant turn was closed and a new turn opened, its prefill thrown away (TRL
    continues it). Both from a user's trial, 2026-11-28."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.tokenizer import HFTokenizer

    rows = [{"prompt": [{"role": "user", "content": "What is 3 + 4?"}]},
            {"prompt": [{"role": "user", "content": "Add 3 and 4."},
                        {"role": "assistant", "content": "Calling.", "tool_calls": [{"name": "add"}]},
                        {"role": "tool", "content": "7"}, {"role": "user", "content": "So?"}]},
            {"prompt": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is"}]}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    tok = HFTokenizer(make_tokenizer(tmp_path / "chat"))
    tok.tok.chat_template = TOOLS_AWARE
    source = prompt_source(user_reward_run(path), tok, np.random.default_rng(0))
    assert not source.bad and source.train[0].prompt == rows[0]["prompt"], source.bad
    rendered = [tok.tok.decode(e.prompt_ids) for e in source.train]
    assert rendered[1] == ("<|user|>Add 3 and 4.<|end|><|user|>Calling.[add]<|end|><|user|>7<|end|><|user|>So?<|end|>"
                           "<|assistant|>")
    assert rendered[2] == "<|user|>What is 2 + 2?<|end|><|user|>It is", "continued, no new turn opened"
    # the resume fingerprint hashes the messages as read, nulls included (dropping them changed it: a review)
    import hashlib

    read = pq.read_table(str(path)).to_pylist()
    want = hashlib.sha256()
    for row in read:
        want.update(json.dumps([row["prompt"], {}], sort_keys=True, default=str).encode())
    assert any("tool_calls" in m for m in read[0]["prompt"]) and source.fingerprint() == want.hexdigest()


def test_chat_messages_stored_as_parquet_maps_read_as_messages(tmp_path):
    """A `list<map<string, string>>` prompt column came back from pyarrow as lists of (key, value) pairs: every row
    bad ("message 1 is a list")."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.tokenizer import HFTokenizer

    messages = pa.array([[{"role": "user", "content": "What is 3 + 4?"}]], pa.list_(pa.map_(pa.string(), pa.string())))
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": messages, "answer": ["7"]}), str(path))
    source = prompt_source(user_reward_run(path), HFTokenizer(make_tokenizer(tmp_path / "chat")),
                           np.random.default_rng(0))
    assert [e.prompt for e in source.train] == [[{"role": "user", "content": "What is 3 + 4?"}]] and not source.bad


def test_chat_prompts_without_a_chat_template_stop_the_run_at_start_naming_the_row(tmp_path):
    """The built-in model's byte tokenizer (and a checkpoint's without a template) has no way to render a
    conversation: refused at start in one line naming the row and the remedies, not skipped row by row."""
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "text first", "answer": "1"}) + "\n"
                    + json.dumps({"prompt": CHAT, "answer": "7"}) + "\n")
    with pytest.raises(ValueError, match=r"train.jsonl:2: the prompt is a list of chat messages and the tokenizer "
                                         r"has no chat template .*init.hf=.*as text"):
        prompt_source(user_reward_run(path), ByteTokenizer(512), np.random.default_rng(0))


def test_verls_layout_reads_a_nested_ground_truth_and_scores_a_bare_number_reference(tmp_path):
    """verl's prepared GSM8K (Parquet: `prompt` as chat messages, the answer in `reward_model.ground_truth` as a
    bare number, `data_source`, `extra_info`) trains as it is with `data.answer_key=reward_model.ground_truth`:
    before, the dotted key was never found (every row "missing field(s)") and a reference without `#### ` was a bad
    row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.prompts import group_fields
    from moe_grpo.data.tokenizer import HFTokenizer
    from moe_grpo.reward.functions import Rewards

    def verl_row(q, truth):
        return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
                "reward_model": {"ground_truth": truth, "style": "rule"}, "extra_info": {"split": "train", "index": 0}}

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row("What is 1000 + 250?", "1,250"), verl_row("What is 3 + 4?", "7"),
                                         verl_row("What is 2 + 3?", "five")]), str(path))
    run = run_config(train_path=str(path), prompt_key="prompt", answer_key="reward_model.ground_truth")
    source = prompt_source(run, HFTokenizer(make_tokenizer(tmp_path / "chat")), np.random.default_rng(0))
    assert [e.answer for e in source.train] == ["1,250", "7"]
    assert [(b.line, b.reason) for b in source.bad] == [
        (3, "field 'reward_model.ground_truth' has no '#### N' final answer and is not a number")]
    rewards = Rewards(*run.reward.resolved(run.task.name))
    try:
        scores = rewards.score([source.train[0].prompt] * 3, ["#### 1250", "The answer is \\boxed{1250}", "125"],
                               group_fields(source.train[0], 3))
    finally:
        rewards.close()
    assert scores.rewards.tolist() == [1.0, 1.0, 0.0] and not scores.failed.any()


def test_the_built_in_reward_reads_the_answer_from_data_answer_key(tmp_path):
    """`data.answer_key=solution` with the built-in reward failed every sample ("score() missing 1 required
    positional argument: 'answer'") and stopped the run after 64 groups: the row's field reached the reward under
    its own name. The reward's `answer` is now the value at `data.answer_key`; the row's fields keep their names, a
    row's own `answer` included (a review: it was overwritten, on some rows only), and a built-in reward that would
    read that one is refused. A number as the answer (JSON, Parquet) failed every sample too (`len(4)`)."""
    import dataclasses

    from moe_grpo.data.prompts import group_fields
    from moe_grpo.reward.functions import Rewards

    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "abc=", "solution": "cba"}) + "\n"
                    + json.dumps({"prompt": "2+2=", "solution": 4}) + "\n")
    run = from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "warm_start_steps": 0,
                      "data": {"train_path": str(path), "answer_key": "solution"}})
    source = prompt_source(run, ByteTokenizer(512), np.random.default_rng(0))
    assert source.train[0].fields == {"solution": "cba", "answer": "cba"}
    rewards = Rewards(*run.reward.resolved(run.task.name))
    try:
        scores = rewards.score(["abc="] * 2, ["cba", "abc"], group_fields(source.train[0], 2))
        numeric = rewards.score(["2+2="] * 2, ["4", "5"], group_fields(source.train[1], 2))
    finally:
        rewards.close()
    assert not scores.failed.any() and not numeric.failed.any(), (scores.errors, numeric.errors)
    assert scores.rewards.tolist() == pytest.approx([1.0, 1 / 3]) and numeric.rewards.tolist() == [1.0, 0.0]
    both = tmp_path / "both.jsonl"
    both.write_text(json.dumps({"prompt": "abc=", "solution": "cba", "answer": "worked: c, b, a"}) + "\n")
    mine = user_reward_run(both, answer_key="solution")
    assert prompt_source(mine, ByteTokenizer(512), np.random.default_rng(0)).train[0].fields == {
        "solution": "cba", "answer": "worked: c, b, a"}
    builtin = from_hydra({"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "warm_start_steps": 0,
                          "data": {"train_path": str(both), "answer_key": "solution"}})
    with pytest.raises(ValueError, match=r"data.answer_key='solution', but .*both.jsonl:1 also has a field 'answer', "
                                         r"where moe_grpo.data.tasks:score would read the reference"):
        prompt_source(builtin, ByteTokenizer(512), np.random.default_rng(0))


def test_a_byte_order_mark_keeps_the_first_row_and_a_cut_line_is_named_at_its_end(tmp_path):
    """A JSONL file a Windows editor saved with a byte-order mark lost its first row as "not valid JSON
    (Unexpected UTF-8 BOM)"; a line cut short was reported "at column 1" (the parser saw its newline as line 2)."""
    path = tmp_path / "bom.jsonl"
    cut = '{"prompt": "1+1=", "answer": "2"'
    path.write_bytes(b"\xef\xbb\xbf" + (json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n" + cut + "\n").encode())
    rows = read_rows(path, ["prompt"])
    assert [r["prompt"] for r in rows.rows] == ["2+2="]
    assert [(b.line, b.reason) for b in rows.bad] == [(2, f"not valid JSON (Expecting ',' delimiter at column "
                                                          f"{len(cut) + 1})")]


def test_parquet_rows_and_a_user_prompt_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "hello", "label": 1}, {"text": None, "label": 2},
                                         {"text": "world", "label": 3}]), str(path))
    run = from_hydra({"model": {**__import__("dataclasses").asdict(load_model_spec("deepseek_moe"))},
                      "warm_start_steps": 0, "reward": {"fn": "user_rewards:length_penalty"},
                      "data": {"train_path": str(path), "prompt_key": "text"}})
    source = prompt_source(run, ByteTokenizer(512), np.random.default_rng(0))
    assert [e.prompt for e in source.train] == ["hello", "world"] and [b.line for b in source.bad] == [2]
    assert source.train[1].fields == {"label": 3}


def test_a_file_with_no_good_row_or_no_file_fails_by_name(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl has no usable row"):
        read_rows(bad, ["prompt"])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_rows(tmp_path / "missing.jsonl", ["prompt"])
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_rows(tmp_path / "broken.parquet", ["prompt"])


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"data.train_path='x.xlsx': expected a file ending in"):
        run_config(train_path="x.xlsx")
    with pytest.raises(ValueError, match="task.name='gsm8k' reads its prompts from a dataset"):
        run_config()


def test_prompts_go_through_the_checkpoint_chat_template(tmp_path):
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.tokenizer import HFTokenizer

    make_tokenizer(tmp_path / "chat")
    make_tokenizer(tmp_path / "plain", chat_template=False)
    chat, plain = HFTokenizer(tmp_path / "chat"), HFTokenizer(tmp_path / "plain")
    ids = chat.encode_prompt("What is 3 + 4?")
    assert chat.tok.decode(ids) == "<|user|>What is 3 + 4?<|end|><|assistant|>"
    assert plain.tok.decode(plain.encode_prompt("What is 3 + 4?"), skip_special_tokens=True) == "What is 3 + 4?"
    assert chat.stop_ids == (chat.tok.convert_tokens_to_ids("<|end|>"),)
    answer = chat.encode_answer("#### 7")
    assert answer[-1] == chat.eos_id and chat.completion_text(answer + [5, 6]) == "#### 7"
    with pytest.raises(ValueError, match="vocab_size is 100"):
        HFTokenizer(tmp_path / "chat", vocab_size=100)
    with pytest.raises(ValueError, match="no usable tokenizer files"):
        HFTokenizer(tmp_path)


def test_command_line_names_task_data_reward_and_init(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from hf_fixtures import make_checkpoint
    from test_config import compose

    data = tmp_path / "train.jsonl"
    write_gsm8k(data)
    hf = make_checkpoint("qwen3_moe", tmp_path / "ckpt")
    run = from_hydra(compose(["task=gsm8k", f"data.train_path={data}", f"init.hf={hf}",
                              "reward.fn=[user_rewards:length_penalty,moe_grpo.reward.math_answer:math_answer_reward]",
                              "reward.weights=[0.5,1]"]))
    assert run.task.name == "gsm8k" and run.data.train_path == str(data)
    assert run.warm_start == 0 and from_hydra(compose([f"init.hf={hf}"])).warm_start == 0  # a pretrained model
    assert run.reward.fn == ("user_rewards:length_penalty", "moe_grpo.reward.math_answer:math_answer_reward")
    assert run.reward.weights == (0.5, 1.0)
    # the model description is the checkpoint's config.json, whatever `model=` says
    assert run.model.architecture == "Qwen3MoeForCausalLM" and run.model.num_experts == 4
    with pytest.raises(ValueError, match="init.hf=.*expected an existing checkpoint directory"):
        from_hydra(compose([f"init.hf={tmp_path / 'nope'}"]))


def test_a_resume_on_a_dataset_whose_rows_changed_is_refused_before_anything_starts(tmp_path):
    """The checkpoint holds its place in the shuffled pass over the rows: 200 other rows in place of the 200 it had
    were accepted silently, and 50 rows were a traceback 19 s into the start-up, after the pools were up (a user's
    trial, 2026-11-28). Both are now refused by the rows' sha256 and count, in one line, with the checkpoint named."""
    from moe_grpo.orchestrator.resume import resume_point
    from moe_grpo.orchestrator.run_checkpoint import ResumeRefused

    def source_of(rows):
        path = tmp_path / f"train{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return prompt_source(run_config(train_path=str(path)), ByteTokenizer(512), np.random.default_rng(0),
                             str(tmp_path))

    first = source_of(GOOD)
    saved = first.state_dict()
    source_of(GOOD).check_resumable(saved)  # the same rows in another file: fine
    changed = [dict(r, question=r["question"] + " Think.") for r in GOOD]
    with pytest.raises(ValueError, match=r"data.train_path's 2 usable rows are not the checkpoint's \(sha256 "):
        source_of(changed).check_resumable(saved)
    with pytest.raises(ValueError, match=r"data.train_path now has 1 usable rows, the checkpoint's run had 2"):
        source_of(GOOD[:1]).check_resumable(saved)
    # where `train` asks, before the pools start: a refusal naming the checkpoint (exit 2, one line)
    import dataclasses

    from moe_grpo.orchestrator import resume as resume_module
    from moe_grpo.orchestrator.state import RunState

    resumed = dataclasses.replace(run_config(train_path=str(tmp_path / "train0.jsonl")), resume=True)
    fake = {"config": {}, "source": saved, "run_state": RunState(step=4).state_dict()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(resume_module.run_checkpoint, "resume_point", lambda d: (tmp_path / "step_000004", None))
        patch.setattr(resume_module.run_checkpoint, "load_driver_state", lambda p: fake)
        patch.setattr(resume_module, "check_resumable", lambda *a: None)
        with pytest.raises(ResumeRefused, match=r"resume=true from .*step_000004: data.train_path's 2 usable rows "
                                                r"are not the checkpoint's"):
            resume_point(resumed, str(tmp_path), RunState(), source_of(changed))


def test_a_prompts_only_dataset_with_a_reward_function_runs_without_a_warm_start_unless_one_is_asked_for(tmp_path):
    """A dataset of prompts alone and a user reward (a user's usual RL setup) was refused: "has no usable row
    (... missing field(s) ['answer'])", because the warm start (100 supervised steps by default, meant for the
    embedded model's random weights) read each row's answer, and it silently fine-tuned a pretrained `init.hf` model
    on a dataset's reference answers (a newcomer's trial, 2026-11-28). Unset, the warm start now runs only on a
    built-in task's randomly initialised model; asked for on rows without answers, the refusal says why."""
    import dataclasses

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["abc", "defg", "hij"]))
    tree = {"model": dataclasses.asdict(load_model_spec("deepseek_moe")),
            "reward": {"fn": "user_rewards:length_penalty"}, "data": {"train_path": str(path)}}
    run = from_hydra(tree)
    assert run.warm_start == 0
    assert [e.prompt for e in prompt_source(run, ByteTokenizer(512), np.random.default_rng(0)).train] == \
        ["abc", "defg", "hij"]
    assert from_hydra({"model": tree["model"]}).warm_start == 100  # the built-in task on random weights
    asked = from_hydra({**tree, "warm_start_steps": 5})
    assert asked.warm_start == 5
    with pytest.raises(ValueError, match=r"missing field\(s\) \['answer'\].*warm_start_steps=5 trains on each row's "
                                         r"'answer'; data.answer_key=FIELD names the field that holds them, or "
                                         r"warm_start_steps=0 runs without"):
        prompt_source(asked, ByteTokenizer(512), np.random.default_rng(0), str(tmp_path))
    # a refused dataset still lists its rows and why (a user's trial, 2026-11-28: no bad_rows.txt then)
    assert (tmp_path / "bad_rows.txt").read_text().count("missing field(s) ['answer']") == 3


def test_a_glob_of_shards_and_json_arrays_read_as_one_dataset_each_row_named_by_its_file(tmp_path, caplog):
    """A Hugging Face hub download leaves a split as shards (`data/train-00000-of-00002.parquet`, ...), and many
    datasets come as one JSON array (`.json`, or a `.jsonl` that holds an array): the shards' glob was "does not
    exist", a directory and `.json` were refused by suffix, and the array in a `.jsonl` was 82 bad rows (a user's
    trial, 2026-11-28). Now a glob reads its files in name order, each row (and each bad row) named by its own
    file; a `.json` is JSON Lines or an array; a directory is refused naming a glob to give instead."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "hub" / "data"
    shards.mkdir(parents=True)
    for name, rows in (("train-00000-of-00002", [{"prompt": "ab"}, {"prompt": "cd"}]),
                       ("train-00001-of-00002", [{"prompt": "ef"}, {"prompt": None}])):
        pq.write_table(pa.Table.from_pylist(rows), str(shards / f"{name}.parquet"))
    pq.write_table(pa.Table.from_pylist([{"prompt": "test"}]), str(shards / "test-00000-of-00001.parquet"))
    source = prompt_source(user_reward_run(shards / "train-*.parquet"), ByteTokenizer(512), np.random.default_rng(0))
    assert [(e.prompt, e.where) for e in source.train] == [
        ("ab", "train-00000-of-00002.parquet:1"), ("cd", "train-00000-of-00002.parquet:2"),
        ("ef", "train-00001-of-00002.parquet:1")]
    assert [str(b) for b in source.bad] == [f"{shards}/train-00001-of-00002.parquet:2: empty field(s) ['prompt']"]
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "gh"}) + "\n")
    with caplog.at_level("INFO", logger="moe_grpo"):  # a glob's bad rows name their files: counted as held-out
        prompt_source(user_reward_run(tmp_path / "train.jsonl", eval_path=str(shards / "train-*.parquet")),
                      ByteTokenizer(512), np.random.default_rng(0))
    assert "3 held-out rows from" in caplog.text and "1 bad row(s) skipped (held-out)" in caplog.text
    with pytest.raises(FileNotFoundError, match=r"is a directory: name its files, e.g. '.*/data/train-\*.parquet'"):
        read_rows(shards, ["prompt"])
    with pytest.raises(FileNotFoundError, match="valid-\\*.parquet: no file matches"):
        read_rows(shards / "valid-*.parquet", ["prompt"])
    # a file whose name has a glob's characters is that file (a review: data[1].jsonl was "no file matches", and
    # beside a data1.jsonl it silently read that one)
    (tmp_path / "data[1].jsonl").write_text(json.dumps({"prompt": "own"}) + "\n")
    (tmp_path / "data1.jsonl").write_text(json.dumps({"prompt": "other"}) + "\n")
    assert [r["prompt"] for r in read_rows(tmp_path / "data[1].jsonl", ["prompt"]).rows] == ["own"]
    rows = [{"prompt": "ab"}, {"prompt": "cd"}, "not an object"]
    for name, text in (("a.json", json.dumps(rows, indent=2)), ("b.jsonl", json.dumps(rows, indent=2)),
                       ("c.json", "".join(json.dumps(r) + "\n" for r in rows))):
        (tmp_path / name).write_text(text)
        read = read_rows(tmp_path / name, ["prompt"])
        assert [r["prompt"] for r in read.rows] == ["ab", "cd"], name
        assert [(b.line, b.reason) for b in read.bad] == [(3, "expected a JSON object, got str")], name


def test_a_csv_file_with_a_header_reads_its_rows_named_by_their_lines(tmp_path):
    """A CSV of prompts and answers was refused by its suffix (a user's trial, 2026-11-28)."""
    path = tmp_path / "train.csv"
    path.write_text('prompt,answer,level\n"What is 3 + 4?",7,1\n,5,2\n"Say ""hi"", then stop",hi,3\n')
    rows = read_rows(path, ["prompt", "answer"])
    assert [(r["prompt"], r["answer"]) for r in rows.rows] == [("What is 3 + 4?", "7"), ('Say "hi", then stop', "hi")]
    assert rows.lines == [2, 4] and [(b.line, b.reason) for b in rows.bad] == [(3, "empty field(s) ['prompt']")]
    source = prompt_source(user_reward_run(path), ByteTokenizer(512), np.random.default_rng(0))
    assert source.train[0].where == "train.csv:2" and source.train[0].answer == "7"


def test_content_given_as_text_parts_is_rendered_as_the_text_they_join_into(tmp_path):
    """OpenAI's and TRL's multimodal layout gives a message's content as parts (`[{"type": "text", "text": ...}]`);
    text-only parts were a bad row ("expected text"). Now they are joined with newlines, as vLLM joins them for a text
    model, and rendered as that text; a part that is not text, or text that is not a string, is a bad row naming it."""
    from hf_fixtures import make_tokenizer
    from moe_grpo.data.tokenizer import HFTokenizer

    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer with a number."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "3 + 4?"}]}]
    rows = [{"prompt": parts, "answer": "7"}, {"prompt": CHAT, "answer": "7"},
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": 3}]}], "answer": "3"},
            {"prompt": [{"role": "user", "content": ["What is 3 + 4?"]}], "answer": "7"}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = HFTokenizer(make_tokenizer(tmp_path / "chat"))
    source = prompt_source(user_reward_run(path), tok, np.random.default_rng(0))
    assert [e.where for e in source.train] == ["train.jsonl:1", "train.jsonl:2"]
    assert tok.tok.decode(source.train[0].prompt_ids) == ("<|user|>Answer with a number.<|end|><|user|>What is\n3 + 4?"
                                                          "<|end|><|assistant|>")
    assert source.train[0].prompt[1]["content"] == "What is\n3 + 4?", "the reward gets the text the model read"
    reasons = {b.line: b.reason for b in source.bad}
    assert reasons == {3: "field 'prompt': message 1's 'content' part 1's 'text' is a number, expected text",
                       4: "field 'prompt': message 1's 'content' part 1 is text, expected an object with 'type' and "
                          "'text'"}, reasons
