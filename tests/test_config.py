"""The command line: Hydra composes conf/, one conversion into frozen dataclasses, loud errors."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_grpo.config import CONF_DIR, defaults_tree, from_hydra

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
    ("learner.lr=-1", "lr=-1"),
    ("megatron.token_dispatcher=flex", "token_dispatcher='flex'"),
    ("parallel.tensor_parallel=0", "tensor_parallel=0"),
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


def test_help_answers_without_importing_torch():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "moe_grpo.train", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "deepseek_v3" in out.stdout
    import re

    assert not re.search(r"\|\s+torch$", out.stderr, re.MULTILINE), "--help imported torch"
