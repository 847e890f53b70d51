"""HF <-> Megatron conversion on checkpoints written by transformers' own save_pretrained."""

import glob
import json
import os
import re
import shutil

import pytest
import torch

from moe_grpo.checkpoint.convert import hf_to_megatron, megatron_to_hf, megatron_to_megatron
from moe_grpo.checkpoint.hf_io import CheckpointFileError


def load_dir(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        out.update(load_file(f))
    return out


def make_hf(kind, path):
    """A small random model of the family, saved by transformers; top_k / group_top_k = 2 as in DeepSeek-V3."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if kind == "deepseek_v3":
        cfg = DeepseekV3Config(**common, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.5)
        model = DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # a non-zero expert bias, so its mapping is tested
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    else:
        cfg = Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, num_experts=8)
        model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf(request.param, root / "hf")
    hf_to_megatron(hf, root / "mg", progress=False)
    return request.param, root, hf, str(root / "mg")


def test_hf_megatron_hf_is_bit_exact(converted):
    _, root, hf, mg = converted
    megatron_to_hf(mg, root / "back", progress=False)
    orig, back = load_dir(hf), load_dir(root / "back")
    assert set(orig) == set(back)
    for name in orig:
        assert orig[name].dtype == back[name].dtype and torch.equal(orig[name], back[name]), name
    cfg = json.loads((root / "back" / "config.json").read_text())
    if converted[0] == "deepseek_v3":  # what vLLM needs and transformers leaves out
        assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["TP=2", "EP=2", "PP=2"])
def test_round_trip_through_a_sharded_learner_is_bit_exact_and_logits_match_hf(converted, layout, tmp_path):
    import layout_scenarios as S
    from moe_grpo.checkpoint.verify import verify
    from moe_grpo.learner.spawn import run_distributed

    _, _, hf, mg = converted
    tp, ep, pp = layout
    report = verify(hf, mg, tp=tp, ep=ep, pp=pp)
    assert report["max_abs_logprob_diff"] < 1e-5, report
    resharded = str(tmp_path / "mg_layout")
    run_distributed(S.reshard_and_save, tp * ep * pp, tp, ep, pp, mg, resharded)
    megatron_to_hf(resharded, tmp_path / "back", progress=False)
    orig, back = load_dir(hf), load_dir(tmp_path / "back")
    assert set(orig) == set(back)
    for name in orig:
        assert torch.equal(orig[name], back[name]), name


def test_megatron_to_megatron_casts_dtype(converted, tmp_path):
    _, _, hf, mg = converted
    megatron_to_megatron(mg, tmp_path / "bf16", dtype=torch.bfloat16, progress=False)
    megatron_to_hf(tmp_path / "bf16", tmp_path / "back", progress=False)
    orig, back = load_dir(hf), load_dir(tmp_path / "back")
    w = "model.embed_tokens.weight"
    assert back[w].dtype == torch.bfloat16 and torch.equal(orig[w].to(torch.bfloat16), back[w])


# ---------------------------------------------------------------------------- bad input


@pytest.fixture
def hf_copy(converted, tmp_path):
    _, _, hf, _ = converted
    dst = tmp_path / "hf"
    shutil.copytree(hf, dst)
    return dst


def nothing_left(dst):
    return not dst.exists() and not any(p.name.startswith(dst.name) for p in dst.parent.iterdir())


def test_truncated_file_is_named_and_nothing_is_written(hf_copy, tmp_path):
    f = hf_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    dst = tmp_path / "out" / "mg"
    dst.parent.mkdir()
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors: tensor .* truncated"):
        hf_to_megatron(hf_copy, dst, progress=False)
    assert nothing_left(dst)


def test_corrupt_header_is_named(hf_copy, tmp_path):
    f = hf_copy / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors: header is not valid JSON"):
        hf_to_megatron(hf_copy, tmp_path / "mg", progress=False)
    assert nothing_left(tmp_path / "mg")


def test_missing_tensor_is_named(hf_copy, tmp_path):
    from safetensors.torch import load_file, save_file

    f = hf_copy / "model.safetensors"
    tensors = load_file(str(f))
    victim = "model.layers.2.mlp.experts.5.down_proj.weight"
    del tensors[victim]
    save_file(tensors, str(f))
    with pytest.raises(CheckpointFileError, match=f"missing tensor.*{victim}"):
        hf_to_megatron(hf_copy, tmp_path / "mg", progress=False)
    assert nothing_left(tmp_path / "mg")


def test_config_that_does_not_match_the_tensors_is_named(hf_copy, tmp_path):
    cfg = json.loads((hf_copy / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48
    (hf_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointFileError, match=r"has shape \[32, 64\], but config.json implies \[48, 64\]"):
        hf_to_megatron(hf_copy, tmp_path / "mg", progress=False)
    assert nothing_left(tmp_path / "mg")


def test_existing_destination_is_not_overwritten(converted, tmp_path):
    _, _, hf, _ = converted
    (tmp_path / "mg").mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        hf_to_megatron(hf, tmp_path / "mg", progress=False)


@pytest.mark.slow
def test_command_line_converts_and_verifies(converted, tmp_path):
    import subprocess
    import sys

    _, _, hf, _ = converted
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py")
    out = subprocess.run([sys.executable, tool, "--from", "hf", "--to", "megatron", "--src", hf,
                          "--dst", str(tmp_path / "mg"), "--verify", "--tp", "2", "--ep", "2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # TP x EP on CPU: the tool picks the allgather dispatcher itself (gloo refuses alltoall's uneven all_gather)
    assert report["verify"]["tp"] == 2 and report["verify"]["ep"] == 2
    assert report["verify"]["token_dispatcher"] == "allgather" and report["verify"]["max_abs_logprob_diff"] < 1e-5
    assert "[convert] HF -> Megatron tensors" in out.stderr  # progress is shown


def test_command_line_names_a_bad_path_at_once(tmp_path):
    """A wrong --src or an existing --dst fails before torch is imported, naming the path, without a traceback."""
    import subprocess
    import sys

    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py")
    (tmp_path / "empty").mkdir()
    cases = {("--src", str(tmp_path / "nope")): "no such directory",
             ("--src", str(tmp_path / "empty")): "no config.json",
             ("--dst", str(tmp_path / "empty")): "exists; remove it or choose another"}
    for (flag, path), message in cases.items():
        paths = {"--src": str(tmp_path / "empty"), "--dst": str(tmp_path / "new"), flag: path}
        if flag == "--dst":
            (tmp_path / "src").mkdir(exist_ok=True)
            (tmp_path / "src" / "config.json").write_text("{}")
            paths["--src"] = str(tmp_path / "src")
        bad = subprocess.run([sys.executable, "-X", "importtime", tool, "--from", "hf", "--to", "megatron",
                              "--src", paths["--src"], "--dst", paths["--dst"]],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and f"{flag} {path}" in bad.stderr and message in bad.stderr, bad.stderr[-2000:]
        assert "Traceback" not in bad.stderr, bad.stderr[-2000:]
        assert not re.search(r"\|\s*torch$", bad.stderr, re.M), "failed before importing torch, at any depth"
    assert not (tmp_path / "new").exists()


def test_hf_shapes_from_the_spec_match_transformers_checkpoints(converted):
    """The weight sync plans its buckets from `hf_shapes(spec)`; transformers' own tensors are the truth."""
    from moe_grpo.models.spec import read_spec
    from moe_grpo.models.hf_names import hf_shapes

    _, _, hf, mg = converted
    truth = {k: tuple(v.shape) for k, v in load_dir(hf).items()}
    assert hf_shapes(read_spec(mg)) == truth
