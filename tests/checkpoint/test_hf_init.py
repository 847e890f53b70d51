"""init.hf pieces: the engines' view of a checkpoint, the conversion cache key, exports with the checkpoint's tokenizer."""

import json
import os

import pytest
import torch

from hf_fixtures import make_checkpoint
from moe_grpo.checkpoint.hf_init import InitConfig, engine_dir, fingerprint


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("v3") / "ckpt")


def test_engine_view_completes_what_vllm_needs_and_keeps_the_checkpoint_keys(v3, tmp_path):
    spec = InitConfig(hf=v3).model_spec()
    view = engine_dir(v3, spec, tmp_path / "model_v0")
    cfg = json.loads((view / "config.json").read_text())
    original = json.loads(open(os.path.join(v3, "config.json")).read())
    assert "topk_method" not in original  # transformers leaves it out ...
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"  # ... vLLM needs it
    assert all(cfg[k] == v for k, v in original.items())
    assert os.path.realpath(view / "model.safetensors") == os.path.realpath(os.path.join(v3, "model.safetensors"))
    assert (view / "tokenizer.json").exists()


def test_the_cache_key_follows_the_weights_and_the_config(v3, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(v3, copy)
    before = fingerprint(copy)
    assert fingerprint(copy) == before
    os.utime(copy / "model.safetensors", ns=(1, 1))
    assert fingerprint(copy) != before
    after_touch = fingerprint(copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    assert fingerprint(copy) != after_touch


def test_export_carries_the_checkpoint_tokenizer_and_token_ids(v3, tmp_path):
    from safetensors.torch import load_file

    from moe_grpo.data.tokenizer import HFTokenizer
    from moe_grpo.rollout.export import export_model_dir

    spec = InitConfig(hf=v3).model_spec()
    state = load_file(os.path.join(v3, "model.safetensors"))
    out = export_model_dir(spec, state, tmp_path / "policy", source_dir=v3)
    cfg = json.loads((out / "config.json").read_text())
    original = json.loads(open(os.path.join(v3, "config.json")).read())
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (original["bos_token_id"], original["eos_token_id"])
    assert cfg["topk_method"] == "noaux_tc"
    a, b = HFTokenizer(v3), HFTokenizer(out)
    assert a.encode_prompt("What is 3 + 4?") == b.encode_prompt("What is 3 + 4?") and a.stop_ids == b.stop_ids
    back = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(state[k], back[k]) for k in state)


def test_init_options_fail_by_name(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        InitConfig(hf=str(tmp_path))
    with pytest.raises(ValueError, match="init.megatron=.*without init.hf"):
        InitConfig(megatron=str(tmp_path))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_learners_checkpoint_converts_while_the_run_starts_and_a_stopped_start_stops_it(v3, tmp_path):
    """`train` used to convert init.hf before Ray and the pools started; now the conversion runs on a thread while
    they start (the ranks load it once up): asking for it returns at once. A start that fails or is stopped during
    the conversion stops it: its process killed, nothing in the cache."""
    import time

    import psutil

    from moe_grpo.checkpoint.hf_init import LearnerStartCheckpoint

    t0 = time.perf_counter()
    start = LearnerStartCheckpoint(InitConfig(hf=v3, cache_dir=str(tmp_path / "cache")), tmp_path / "run")
    assert time.perf_counter() - t0 < 1.0, "the conversion (seconds: a spawned process) must not hold up the start"
    path = start.path()
    assert os.path.isfile(os.path.join(path, ".complete")) and path.startswith(str(tmp_path / "cache"))
    again = LearnerStartCheckpoint(InitConfig(hf=v3, cache_dir=str(tmp_path / "cache")), tmp_path / "run")
    assert again.path() == path, "a later run reuses the cache"

    before = {p.pid for p in psutil.Process().children()}  # process servers earlier tests started
    stopped = LearnerStartCheckpoint(InitConfig(hf=v3, cache_dir=str(tmp_path / "other")), tmp_path / "run")
    time.sleep(1.0)  # the conversion's process is starting (it takes seconds to import torch and megatron-core)
    t0 = time.perf_counter()
    stopped.close()
    assert time.perf_counter() - t0 < 30
    assert not [d for d in os.listdir(tmp_path / "other") if not d.startswith(".")], "nothing entered the cache"
    assert not [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    # Another run holds the cache's lock (converting the same checkpoint): a stopped start does not wait for it.
    import fcntl

    (tmp_path / "held").mkdir()
    with open(tmp_path / "held" / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiting = LearnerStartCheckpoint(InitConfig(hf=v3, cache_dir=str(tmp_path / "held")), tmp_path / "run")
        time.sleep(0.5)
        t0 = time.perf_counter()
        waiting.close()
        assert time.perf_counter() - t0 < 5, "the stop ends the wait for the lock"
    assert sorted(os.listdir(tmp_path / "held")) == [".lock"]
    given = LearnerStartCheckpoint(InitConfig(hf=v3, megatron=path), tmp_path / "run")
    assert given.path() == path and LearnerStartCheckpoint(InitConfig(), tmp_path / "run").path() is None


def test_runs_on_different_days_share_one_conversion_cache(tmp_path):
    """Hydra's default run directory is `outputs/<date>/<time>-...`: the cache used to live in the date folder, so a
    run the next day converted the whole checkpoint again (minutes, and another copy on disk). Outside a date
    folder it stays next to the run directory."""
    from moe_grpo.checkpoint.hf_init import default_cache_dir

    monday = default_cache_dir(tmp_path / "outputs" / "2026-11-30" / "09-00-00-1-ab")
    tuesday = default_cache_dir(tmp_path / "outputs" / "2026-12-01" / "18-30-00-2-cd")
    assert monday == tuesday == (tmp_path / "outputs" / "megatron_cache").resolve()
    assert default_cache_dir(tmp_path / "runs" / "r1") == (tmp_path / "runs" / "megatron_cache").resolve()
