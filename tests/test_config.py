"""The command line: Hydra composes conf/, one conversion into frozen dataclasses, loud errors."""

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from moe_grpo.config import CONF_DIR, defaults_tree, from_hydra, unknown_key
from moe_grpo.orchestrator.config import RolloutConfig

ROOT = Path(__file__).resolve().parent.parent


def compose(overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="moe_grpo_defaults", node=defaults_tree())
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def test_overrides_reach_the_frozen_config():
    run = from_hydra(compose(["model=qwen3_moe_30b_a3b", "learner.lr=0.001", "parallel.expert_parallel=8",
                              "megatron.params_dtype=bfloat16"]))
    assert run.model.architecture == "Qwen3MoeForCausalLM"
    assert run.learner.lr == 0.001 and run.parallel.expert_parallel == 8
    assert run.megatron.params_dtype == "bfloat16"
    with pytest.raises(Exception):
        run.learner.lr = 1.0  # frozen


@pytest.mark.parametrize("override, needle", [
    ("learner.lr=-1", "learner.lr=-1.0: expected a number > 0"),
    ("megatron.token_dispatcher=flex", "megatron.token_dispatcher='flex'"),
    ("parallel.tensor_parallel=0", "parallel.tensor_parallel=0: expected an integer >= 1"),
    ("model.top_k=99", "top_k=99"),
])
def test_bad_values_fail_with_the_key_and_the_expectation(override, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        from_hydra(compose([override]))


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['lrr'\] in learner"):
        from_hydra({"model": dict(compose([])["model"]), "learner": {"lrr": 1.0}})
    with pytest.raises(ValueError, match="routing.replay=r3 needs megatron.routing_replay=True"):
        from_hydra(compose(["megatron.routing_replay=false"]))
    assert from_hydra(compose(["megatron.routing_replay=false", "routing.replay=off"])).routing.replay == "off"


def test_keys_of_older_configs_say_what_replaced_them():
    model = dict(compose([])["model"])
    with pytest.raises(ValueError, match=r"routing.replay=r3\|r2\|off \(replay=true is r3"):
        from_hydra({"model": model, "replay": True})
    with pytest.raises(ValueError, match="algo.correction=tis algo.correction_high"):
        from_hydra({"model": model, "algo": {"tis_clip": 2.0}})
    with pytest.raises(ValueError, match=r"routing.replay='r1', expected one of \['r3', 'r2', 'off'\]"):
        from_hydra(compose(["routing.replay=r1"]))


def test_a_loss_chosen_on_the_command_line_brings_its_presets_and_explicit_values_win():
    dapo = from_hydra(compose(["algo.loss=dapo"])).algo
    assert (dapo.clip_ratio_high, dapo.dynamic_sampling, dapo.loss_agg) == (0.28, True, "token-mean")
    dr = from_hydra(compose(["algo.loss=dr_grpo", "algo.normalize_std=true"])).algo
    assert dr.normalize_std is True and dr.loss_agg == "seq-mean-token-sum-norm"
    assert from_hydra(compose([])).algo.normalize_std is True  # grpo's preset


def test_cluster_slurm_chooses_the_launcher_and_everything_else_keeps_its_dataclass_default():
    from moe_grpo.orchestrator.config import ClusterConfig

    local = from_hydra(compose([])).cluster
    assert local == ClusterConfig()  # conf/cluster/local.yaml chooses nothing
    slurm = from_hydra(compose(["cluster=slurm", "cluster.nodes=[gpu01,gpu02]", "cluster.training_nodes=1"])).cluster
    assert slurm == ClusterConfig(launcher="slurm", nodes=("gpu01", "gpu02"), training_nodes=1)


def test_help_answers_without_importing_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "moe_grpo.train", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "deepseek_v3" in out.stdout
    import re

    assert not re.search(r"\|\s+torch$", out.stderr, re.MULTILINE), "--help imported torch"


@pytest.mark.parametrize("override, message", [
    ("steps=2.5", "steps=2.5: expected an integer"),
    ("steps=abc", "steps='abc': expected an integer"),
    ("learner.lr=abc", "learner.lr='abc': expected a finite number"),
    ("algo.group_size=abc", "algo.group_size='abc': expected an integer"),
    ("algo.group_size=true", "algo.group_size=True: expected an integer"),
    ("rollout.request_timeout_s=-1", "rollout.request_timeout_s=-1.0: expected a number > 0"),
    ("reward.timeout_s=-5", "reward.timeout_s=-5.0: expected a number > 0"),
    ("cluster.learner_timeout_s=0", "cluster.learner_timeout_s=0.0: expected a number > 0"),
    ("cluster.start_timeout_s=-1", "cluster.start_timeout_s=-1.0: expected a number > 0"),
    ("rollout.restart_window_s=0", "rollout.restart_window_s=0.0: expected a number > 0"),
    ("rollout.temperature=inf", "rollout.temperature=inf: expected a finite number"),
    ("resume=maybe", "resume='maybe': expected true or false"),
    ("cluster.learner_ranks=1.5", "cluster.learner_ranks=1.5: expected an integer or null"),
    ("reward.weights=[1,x]", "reward.weights[1]='x': expected a finite number"),
    ("model.num_layers=abc", "model.num_layers='abc': expected an integer"),
    ("logger.wandb.mode=3", "logger.wandb.mode=3: expected a string"),
    # ranges, in the same shape, named with their section
    ("steps=0", "steps=0: expected an integer >= 1"),
    ("eval_every=-1", "eval_every=-1: expected an integer >= 0"),
    ("algo.group_size=1", "algo.group_size=1: expected an integer >= 2"),
    ("algo.clip_ratio_high=1.5", "algo.clip_ratio_high=1.5: expected a number > 0 and < 1"),
    ("algo.kl_coef=-0.1", "algo.kl_coef=-0.1: expected a number >= 0"),
    ("learner.adam_beta2=1", "learner.adam_beta2=1.0: expected a number >= 0 and < 1"),
    ("learner.weight_decay=-1", "learner.weight_decay=-1.0: expected a number >= 0"),
    ("learner.packed_seq_len=0", "learner.packed_seq_len=0: expected an integer >= 1 or null"),
    ("learner.seed=-3", "learner.seed=-3: expected an integer >= 0"),
    ("megatron.init_method_std=0", "megatron.init_method_std=0.0: expected a number > 0"),
    ("parallel.expert_parallel=0", "parallel.expert_parallel=0: expected an integer >= 1"),
    ("rollout.top_p=0", "rollout.top_p=0.0: expected a number > 0 and <= 1"),
    ("cluster.engine_cpus=-1", "cluster.engine_cpus=-1.0: expected a number >= 0"),
    ("checkpoint.keep=0", "checkpoint.keep=0: expected an integer >= 1"),
    ("routing.rollback_lr_factor=2", "routing.rollback_lr_factor=2.0: expected a number > 0 and <= 1"),
    ("task.eval_seed=-1", "task.eval_seed=-1: expected an integer >= 0"),
    ("cluster.gpu_memory_gib=0", "cluster.gpu_memory_gib=0.0: expected a number > 0"),
    ("cluster.engine_tensor_parallel=0", "cluster.engine_tensor_parallel=0: expected an integer >= 1"),
    ("cluster.dry_run=maybe", "cluster.dry_run='maybe': expected true or false"),
    ("cluster.launcher=pbs", "cluster.launcher='pbs', expected 'local' or 'slurm'"),
    ("cluster.training_nodes=2", "cluster.nodes / inference_nodes / training_nodes split the nodes of cluster=slurm"),
    ("data.eval_size=0", "data.eval_size=0: expected an integer >= 1 or null"),
    ("sync.delta_max_fraction=0", "sync.delta_max_fraction=0.0: expected a fraction in (0, 1]"),
    ("sync.full_every=-1", "sync.full_every=-1: expected an integer >= 0"),
    ("sync.delta=maybe", "sync.delta='maybe': expected true or false"),
    ("rollout.routing_source=hooks", "rollout.routing_source='hooks', expected 'auto' (native on a GPU, extension on"),
])
def test_every_value_is_checked_for_its_type_and_range_with_the_key_named(override, message):
    """What a user typing a wrong value sees: the key, the value and what was expected, never a TypeError from
    inside the code (`steps=2.5` used to train 3 steps, `steps=abc` failed with a TypeError naming no key)."""
    with pytest.raises(ValueError) as info:
        from_hydra(compose([override]))
    assert message in str(info.value)


def test_whole_numbers_written_as_floats_are_integers():
    assert from_hydra(compose(["steps=2.0"])).steps == 2 and isinstance(from_hydra(compose(["steps=2.0"])).steps, int)
    assert from_hydra(compose(["learner.lr=1"])).learner.lr == 1.0


@pytest.mark.parametrize("override, message", [
    ("steps=abc", "steps='abc': expected an integer"),
    ("rollout.request_timeout_s=-1", "rollout.request_timeout_s=-1.0: expected a number > 0"),
    ("algo.grup_size=16", "unknown key algo.grup_size (did you mean algo.group_size?); algo's keys: "),
])
def test_the_command_line_refuses_a_bad_value_at_once_naming_it(override, message, tmp_path):
    """One line naming the key, exit status 2 (a usage error), no traceback to read through, and no run directory
    left behind.

    Would have caught: a mistyped key answered by Hydra's several-line 'Could not override' with exit status 1, and
    a bad value's refusal leaving the run directory Hydra had made (`.hydra/`, an empty train.log)."""
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", override,
                          f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith(f"[moe_grpo] config error: {message}") and len(out.stderr.splitlines()) == 1
    assert not run_dir.exists()


def test_a_mistyped_key_is_named_with_the_nearest_known_one():
    assert unknown_key("algo.group_size") is None and unknown_key("steps") is None and unknown_key("task") is None
    assert unknown_key("model.extra_hf_config.rope_scaling") is None, "below a field: the conversion's to judge"
    assert unknown_key("stepz").startswith("unknown key stepz (did you mean steps?)")
    assert unknown_key("model.top_kk").startswith("unknown key model.top_kk (did you mean model.top_k?)")
    assert unknown_key("rollout.zzz") == ("unknown key rollout.zzz; rollout's keys: " + ", ".join(
        sorted(f.name for f in fields(RolloutConfig))))
    assert unknown_key("replay").startswith("replay= was replaced by routing.replay")
    # A section inside a section: logger.wandb.mod got Hydra's six-line error, exit 1 (a newcomer's trial, 2026-11-28)
    assert unknown_key("logger.wandb.mode") is None
    assert unknown_key("logger.wandb.mod").startswith("unknown key logger.wandb.mod (did you mean logger.wandb.mode?); "
                                                      "logger.wandb's keys: ")
    assert unknown_key("logger.wandbb.mode").startswith("unknown key logger.wandbb.mode (did you mean logger.wandb?)")


def test_a_refused_resume_is_one_line_exit_2_before_anything_starts(tmp_path):
    """`resume=true` in a directory whose record holds steps but no checkpoint: the reason in one line, exit 2 (as
    a bad value), no traceback, the record untouched.

    Would have caught: the refusal (run_checkpoint.resume_point, check_resumable) ending in a traceback, exit 1;
    and the refused command's config written over the run's config.yaml (a user's trial, 2026-11-28)."""
    record = tmp_path / "metrics.jsonl"
    record.write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / "config.yaml").write_text("the run's own config\n")
    out = subprocess.run([sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", "resume=true",
                          f"hydra.run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("[moe_grpo] resume=true:") and "records 2 step(s)" in last, last
    assert record.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "config.yaml").read_text() == "the run's own config\n"


@pytest.mark.parametrize("override, message", [
    ("data.train_path={tmp}/missing.jsonl", "dataset {tmp}/missing.jsonl does not exist"),
    ("reward.fn=user_rewards:no_such_function", "reward.fn='user_rewards:no_such_function': 'user_rewards' has no "
                                                "'no_such_function'"),
])
def test_inputs_that_cannot_be_used_are_one_line_exit_2_before_anything_starts(override, message, tmp_path):
    """A missing data file or a reward path that does not import: the reason in one line, exit 2, as a bad value.

    Would have caught: each ending in Hydra's ~15-line traceback with exit status 1 (a user's trial, 2026-11-28),
    while `reward.fn=user_rewards.x` (a malformed path, a config error) got one line and exit 2."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "orchestrator"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", override.format(tmp=tmp_path),
                          f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"[moe_grpo] {message.format(tmp=tmp_path)}", out.stderr[-3000:]


@pytest.mark.parametrize("overrides, message", [
    (["sync.delta=true", "lora.rank=4", "lora.alpha=8"], "versions after the first are its adapters only already"),
])
def test_delta_versions_are_refused_where_they_would_mean_nothing(overrides, message):
    """A user asking for deltas where they would silently not happen learns it before the run starts."""
    with pytest.raises(ValueError, match=message):
        from_hydra(compose(overrides))
    assert from_hydra(compose(["sync.delta=true"])).sync.delta is True


def test_the_gsm8k_preset_gives_completions_room_and_the_command_line_still_wins():
    """Would have caught: `task=gsm8k` sampling completions of at most 16 tokens (the built-in toy tasks' length),
    every worked answer cut before its `#### N`."""
    assert compose(["task=gsm8k"]).rollout.max_tokens == 1024 and compose(["task=gsm8k"]).task.name == "gsm8k"
    assert compose(["task=gsm8k", "rollout.max_tokens=512"]).rollout.max_tokens == 512
    assert compose([]).rollout.max_tokens == 16 and compose(["task=sort"]).rollout.max_tokens == 16


def test_lora_on_mla_attention_at_learner_tp_2_is_refused_at_config():
    """Would have caught: `model=deepseek_v3_tiny lora.rank=8 parallel.tensor_parallel=2` accepted, the refusal
    coming only once the learner ranks built their models, after Ray, the engines and the learner had started."""
    with pytest.raises(ValueError, match=r"lora.targets with 'attention' on an MLA model \(deepseek_v3_tiny\) needs "
                                         r"parallel.tensor_parallel=1, got 2"):
        from_hydra(compose(["model=deepseek_v3_tiny", "lora.rank=8", "lora.alpha=16", "parallel.tensor_parallel=2"]))
    run = from_hydra(compose(["model=deepseek_v3_tiny", "lora.rank=8", "lora.alpha=16", "parallel.tensor_parallel=2",
                              "lora.targets=[experts,shared_experts]"]))
    assert run.parallel.tensor_parallel == 2, "without attention adapters TP=2 stays allowed"


def test_help_says_what_a_null_default_means():
    """`--help` lists `algo.clip_ratio_low: null` and a dozen other nulls; without a word on them a newcomer reads
    "unset". Would catch the footer (conf/config.yaml `hydra.help`) lost."""
    out = subprocess.run([sys.executable, "-m", "moe_grpo.train", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert "clip_ratio_low: null" in out.stdout and 'null is not "unset"' in out.stdout
    assert "the preset of algo.loss" in out.stdout


def test_a_weight_sync_root_others_can_write_is_one_line_exit_2_before_anything_starts(tmp_path):
    """`sync.root` on a directory writable by others (a shared tmpfs mounted 1777): refused in one line, exit 2.

    Would have caught: the refusal (sync.transport.secure_root, made when the run's session opens) ending in Hydra's
    ~15-line traceback with exit status 1 (2026-11-28)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    out = subprocess.run([sys.executable, "-m", "moe_grpo.train", "model=deepseek_moe", f"sync.root={shared}",
                          f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last == (f"[moe_grpo] weight-sync root {shared} has mode 0o1777, writable by group and others; expected "
                    "0700 (remove it, or chmod 700 it if every file in it is yours)"), last


def test_a_run_directory_on_a_read_only_file_system_is_one_line_exit_2_before_anything_starts(tmp_path):
    """`hydra.run.dir` on a read-only mount: Hydra's traceback ending in `OSError: [Errno 30] Read-only file system`
    (a directory that did not exist), or, for one that existed, a warning that a second driver would not be refused
    and a 33-line traceback ending `Unable to configure handler 'file'` (a user's trial, 2026-11-28). Now one line
    naming the directory, exit 2, either way. (A read-only tmpfs in a mount namespace of its own: skipped where
    `unshare` cannot make one.)"""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    script = (f'mount -t tmpfs tmpfs "$0" && mkdir "$0/existing" && mount -o remount,ro "$0" && '
              f'for d in "$0/new/run" "$0/existing"; do "$1" -m moe_grpo.train model=deepseek_moe "hydra.run.dir=$d"; '
              f'echo "exit $?"; done; cd "$0" && "$1" -m moe_grpo.train --help > /dev/null; echo "help $?"')
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount -t tmpfs tmpfs "$0" && mount -o remount,ro "$0"',
                            str(mnt)], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs in a namespace here: {probe.stderr.strip()}")
    out = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mnt), sys.executable], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stderr.splitlines() if line.startswith("[moe_grpo]")]
    # --help from a read-only directory writes nothing and answers (the check skips a command line with flags)
    assert out.stdout.split() == ["exit", "2", "exit", "2", "help", "0"], out.stdout + out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "would not be refused" not in out.stderr, out.stderr[-3000:]
    assert lines == [f"[moe_grpo] hydra.run.dir={mnt}/new/run cannot be written: {mnt} is on a read-only file "
                     "system; choose a writable directory",
                     f"[moe_grpo] hydra.run.dir={mnt}/existing cannot be written: {mnt}/existing is on a read-only "
                     "file system; choose a writable directory"], out.stderr[-3000:]
