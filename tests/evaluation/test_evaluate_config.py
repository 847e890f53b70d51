"""`python -m moe_grpo.evaluate`: its config refuses what cannot be evaluated, naming the value; --help is instant."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_grpo.evaluation.config import EvaluateConfig, defaults_tree, from_hydra

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def policy(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_defaults_and_overrides_convert(policy):
    tree = defaults_tree()
    tree.update(policy=policy, samples=4, pass_k=[1, 4])
    tree["rollout"] = {**tree["rollout"], "max_tokens": 32}
    cfg = from_hydra(tree)
    assert cfg.samples == 4 and cfg.pass_k == (1, 4) and cfg.rollout.max_tokens == 32 and cfg.task.name == "reverse"


@pytest.mark.parametrize("change,message", [
    (dict(policy=None), "policy is not set"),
    (dict(policy="/nonexistent/policy"), "policy='/nonexistent/policy': expected a model directory with a config.json"),
    (dict(samples=4, pass_k=(1, 8)), r"pass_k=\[1, 8\] with samples=4: expected 1 <= k <= samples"),
    (dict(samples=-1), "samples=-1, expected >= 0"),
])
def test_bad_values_are_refused_by_name(policy, change, message):
    with pytest.raises(ValueError, match=message):
        EvaluateConfig(**{"policy": policy, **change})


def test_dataset_choices_are_checked(policy):
    from moe_grpo.data.config import DataConfig
    from moe_grpo.data.tasks import TaskConfig

    with pytest.raises(ValueError, match="task.name='gsm8k' has no built-in held-out set; set data.eval_path"):
        EvaluateConfig(policy=policy, task=TaskConfig(name="gsm8k"))
    with pytest.raises(ValueError, match="data.train_path='t.jsonl': evaluate does not read training rows"):
        EvaluateConfig(policy=policy, data=DataConfig(train_path="t.jsonl"))
    assert EvaluateConfig(policy=policy, data=DataConfig(eval_path="e.jsonl")).data.eval_path == "e.jsonl"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['steps'\]"):
        from_hydra({**defaults_tree(), "policy": policy, "steps": 3})


def test_help_lists_the_keys_without_importing_torch():
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "moe_grpo.evaluate", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pass_k:" in out.stdout and "policy: null" in out.stdout and "max_model_len: 0" in out.stdout
    # Hydra's default help listed train's groups too (cluster, model), which evaluate refuses (a user's trial,
    # 2026-11-28): the help names the one group evaluate composes, with every file it has.
    assert "cluster:" not in out.stdout and "\nmodel:" not in out.stdout, out.stdout[:600]
    tasks = sorted(p.stem for p in (Path(ROOT) / "conf" / "task").glob("*.yaml"))
    assert f"task=NAME: a file of conf/task/ ({', '.join(tasks)})" in out.stdout, out.stdout[:600]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "vllm", "ray", "megatron"}, "heavy imports before the config is read"
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("override, message", [
    ("sampels=3", "unknown key sampels (did you mean samples?)"),
    ("rollout.max_tokenz=3", "unknown key rollout.max_tokenz (did you mean rollout.max_tokens?); rollout's keys: "),
    ("samples=abc", "samples='abc': expected an integer"),
])
def test_the_command_line_refuses_a_bad_key_or_value_in_one_line_leaving_nothing(policy, tmp_path, override, message):
    """Would have caught: a mistyped key answered by Hydra's several-line message (exit 1), `samples=abc` ending in
    a TypeError traceback from inside the config, and both leaving a run directory behind."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "moe_grpo.evaluate", f"policy={policy}", override,
                          f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(f"[moe_grpo] config error: {message}") and len(out.stderr.splitlines()) == 1
    assert not run_dir.exists()


def test_an_evaluation_names_the_settings_in_which_it_differs_from_the_run_that_exported_the_policy(tmp_path):
    """`evaluate` starts from its own defaults: a `task=gsm8k` run's policy evaluated without `task=gsm8k` was scored
    by the toy tasks' reward, 0, without a word (a user's trial, 2026-11-28). The run directory's config.yaml says
    what the run trained with; what decides a score and differs is named."""
    import dataclasses

    import yaml

    from moe_grpo.evaluation.config import EvaluateConfig
    from moe_grpo.evaluation.run_settings import differences_from_the_run

    run = tmp_path / "run"
    (run / "policy").mkdir(parents=True)
    (run / "policy" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    (run / "config.yaml").write_text(yaml.safe_dump({
        "task": {"name": "gsm8k"}, "reward": {"fn": ["mymod:judge"], "weights": []}, "rollout": {"max_tokens": 1024},
        "data": {"eval_path": "test.parquet", "prompt_key": "prompt", "answer_key": "reward_model.ground_truth"}}))
    policy = str(run / "policy")
    bare = dataclasses.asdict(EvaluateConfig(policy=policy))
    assert differences_from_the_run(bare, policy) == [
        "task.name: the run's 'gsm8k', here 'reverse'", "reward.fn: the run's ['mymod:judge'], here []",
        "rollout.max_tokens: the run's 1024, here 16"]
    same = {**bare, "task": {**bare["task"], "name": "gsm8k"}, "reward": {**bare["reward"], "fn": ["mymod:judge"]},
            "rollout": {**bare["rollout"], "max_tokens": 1024},
            "data": {**bare["data"], "eval_path": "other.parquet", "prompt_key": "prompt"}}
    assert differences_from_the_run(same, policy) == [
        "data.answer_key: the run's 'reward_model.ground_truth', here 'answer'"]
    (run / "metrics.jsonl").unlink()  # a checkpoint directory of one's own, not a run's: nothing to compare
    assert differences_from_the_run(bare, policy) == []
