"""LoRA in the Megatron learner (real megatron-core on CPU): exact start, adapter-only steps, layouts, PEFT format."""

import json

import numpy as np
import pytest
import torch

import lora_scenarios as L
from layout_scenarios import make_sequences, tiny_spec
from moe_grpo.checkpoint.peft import export_learner_adapter, load_learner_adapter
from moe_grpo.learner.lora_config import LoraConfig
from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner


def max_abs_diff(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        a, b = [a[k] for k in sorted(a)], [b[k] for k in sorted(b)]
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))


def base_state(learner):
    return {k: v.detach().clone() for k, v in learner.module.state_dict().items()
            if torch.is_tensor(v) and ".lora." not in k}


@pytest.fixture(scope="module")
def base():
    spec = tiny_spec()
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, seed=3))
    seqs = make_sequences(spec, n=4)
    return spec, base_state(learner), seqs, learner.logprobs(seqs, replay=True)


def lora_learner(spec, state, **lora):
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2, seed=3),
                              lora=L.lora_config(**lora))
    missing, unexpected = learner.module.load_state_dict(state, strict=False)
    assert not unexpected and all(".lora." in k for k in missing)
    return learner


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="lora.rank"):
        LoraConfig(rank=-1)
    with pytest.raises(ValueError, match="lora.targets"):
        LoraConfig(rank=4, targets=("attention", "router"))
    with pytest.raises(ValueError, match="lora.dropout"):
        LoraConfig(rank=4, dropout=1.0)
    assert LoraConfig(rank=8, alpha=16).scale == 2.0 and not LoraConfig().enabled


def test_the_command_line_takes_the_lora_section_and_refuses_a_run_the_sync_cannot_serve():
    from test_config import compose

    from moe_grpo.config import from_hydra

    assert from_hydra(compose([])).lora == LoraConfig()
    with pytest.raises(ValueError, match="lora.targets"):
        from_hydra(compose(["lora.rank=8", "lora.targets=[experts,router]"]))
    run = from_hydra(compose(["lora.rank=8", "lora.targets=[experts]"]))  # shared memory, merged in the engine
    assert run.lora.rank == 8 and run.sync.lora_apply == "merge"
    # Adapter-only versions go through shared memory or the relay; CUDA IPC buffers hold one plan.
    assert from_hydra(compose(["lora.rank=8", "sync.transport=relay"])).sync.transport == "relay"
    with pytest.raises(ValueError, match="sync.transport=cuda_ipc: adapter-only"):
        from_hydra(compose(["lora.rank=8", "sync.transport=cuda_ipc"]))
    run = from_hydra(compose(["lora.rank=8", "lora.targets=[attention]", "sync.lora_apply=serve"]))
    assert run.sync.lora_apply == "serve"
    with pytest.raises(ValueError, match="lora.rank=1024: vLLM serves adapters up to rank 512"):
        from_hydra(compose(["lora.rank=1024", "sync.lora_apply=serve"]))
    with pytest.raises(ValueError, match="sync.lora_apply='both'"):
        from_hydra(compose(["sync.lora_apply=both"]))


def test_adapters_start_at_zero_and_the_model_is_the_base_model_exactly(base):
    spec, state, seqs, ref = base
    learner = lora_learner(spec, state)
    assert max_abs_diff(learner.logprobs(seqs, replay=True), ref) == 0.0
    # Every targeted layer has its adapters, fused layers one per HF target: qkv -> q, k, v; fc1 -> gate, up.
    qkv = learner.adapters["decoder.layers.1.self_attention.linear_qkv"]
    assert sorted(qkv.A) == ["k", "q", "v"] and all(float(b.detach().abs().sum()) == 0.0 for b in qkv.B.values())
    assert sorted(learner.adapters["decoder.layers.1.mlp.experts.local_experts.7.linear_fc1"].A) == ["gate", "up"]
    assert "decoder.layers.0.mlp.linear_fc2" in learner.adapters  # the dense layer
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1" in learner.adapters
    assert not any("router" in name for name in learner.adapters)
    # 4 layers: 3 MoE x (8 routed + 1 shared) x (fc1, fc2) + 1 dense x 2 + 4 x (qkv, proj)
    assert len(learner.adapters) == 3 * 9 * 2 + 2 + 4 * 2


def test_a_step_trains_only_the_adapters_and_the_optimizer_holds_only_them(base):
    spec, state, seqs, ref = base
    learner = lora_learner(spec, state)
    adapter_params = [p for n, p in learner.module.named_parameters() if ".lora." in n]
    frozen = [n for n, p in learner.module.named_parameters() if p.requires_grad != (".lora." in n)]
    assert not frozen, f"requires_grad wrong for {frozen[:3]}"
    in_optimizer = [p for g in learner.optimizer.param_groups for p in g["params"]]
    assert len(in_optimizer) == len(adapter_params)
    assert {id(p) for p in in_optimizer} == {id(p) for p in adapter_params}
    # Megatron's DDP allocated gradient buffers for the adapters only.
    buffered = sum(b.grad_data.numel() for b in list(learner.model.buffers) + list(learner.model.expert_parallel_buffers))
    assert buffered == sum(p.numel() for p in adapter_params)

    metrics = learner.train_step(seqs, replay=True)
    assert metrics["grad_norm"] > 0
    after = base_state(learner)
    assert all(torch.equal(after[k], state[k]) for k in state), "a base weight changed"
    states = [s for inner in (o.optimizer for o in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]))
              for s in inner.state.values()]
    assert len(states) == len(adapter_params) and all("exp_avg" in s for s in states)
    moved = max_abs_diff(learner.logprobs(seqs, replay=True), ref)
    assert moved > 1e-3, f"the step (lr 1e-2) did not change the policy: {moved}"
    # From B = 0 only B gets a gradient in the first step (dL/dA = B^T ...), so A is still its initial value.
    fresh = lora_learner(spec, state)
    for name, adapter in learner.adapters.items():
        for piece in adapter.A:
            assert torch.equal(adapter.A[piece], fresh.adapters[name].A[piece])
    assert any(float(b.detach().abs().sum()) > 0 for a in learner.adapters.values() for b in a.B.values())


def test_targets_choose_which_layers_get_adapters(base):
    spec, state, _, _ = base
    learner = lora_learner(spec, state, targets=("experts",))
    assert learner.adapters and all(".mlp.experts.local_experts." in n for n in learner.adapters)
    assert len(learner.adapters) == 3 * 8 * 2


def test_merged_weights_give_the_lora_models_log_probs(base):
    """Non-zero A and B: the LoRA forward equals the base model with W + (alpha/r) B A in HF layout, which checks
    the fused qkv (per query group) and gate/up layouts of the pieces."""
    from moe_grpo.learner.lora import load_adapter_state, merge_into_hf
    from moe_grpo.models.hf_names import param_mappings, to_megatron
    from moe_grpo.rollout.export import hf_state_from_megatron

    spec, state, seqs, ref = base
    cfg = L.lora_config()
    adapter = L.random_adapter_state(spec, cfg)
    learner = lora_learner(spec, state)
    load_adapter_state(learner.adapters, adapter, spec, cfg)
    with_lora = learner.logprobs(seqs, replay=True)
    assert max_abs_diff(with_lora, ref) > 1e-2  # the adapters are applied

    merged_hf = merge_into_hf(hf_state_from_megatron(spec, state), adapter, cfg.scale)
    merged = {m.megatron: to_megatron(m, [merged_hf[h] for h in m.hf], spec) for m in param_mappings(spec)}
    plain = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, seed=3))
    plain.module.load_state_dict({**state, **merged})
    assert max_abs_diff(plain.logprobs(seqs, replay=True), with_lora) < 1e-5


def test_peft_export_and_load_round_trip(base, tmp_path):
    from moe_grpo.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_adapter_weights
    from moe_grpo.learner.lora import load_adapter_state

    spec, state, seqs, _ = base
    cfg = L.lora_config()
    learner = lora_learner(spec, state)
    load_adapter_state(learner.adapters, L.random_adapter_state(spec, cfg), spec, cfg)
    learner.train_step(seqs, replay=True)  # A and B both move
    out = tmp_path / "adapter"
    export_learner_adapter(learner, str(out), base_model="tiny")
    meta = json.loads((out / ADAPTER_CONFIG).read_text())
    assert meta["peft_type"] == "LORA" and meta["r"] == L.RANK and meta["lora_alpha"] == L.ALPHA
    weights = read_adapter_weights(out)
    assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (L.RANK, spec.hidden_size)
    assert weights["base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_B.weight"].shape == (
        spec.moe_ffn_hidden_size, L.RANK)
    assert "base_model.model.model.layers.2.mlp.shared_experts.down_proj.lora_A.weight" in weights
    import re
    assert re.fullmatch(meta["target_modules"], "model.layers.3.mlp.experts.7.up_proj")
    assert not re.fullmatch(meta["target_modules"], "model.layers.3.mlp.gate")

    fresh = lora_learner(spec, state)
    load_learner_adapter(fresh, str(out))
    assert max_abs_diff(fresh.logprobs(seqs, replay=True), learner.logprobs(seqs, replay=True)) == 0.0
    other = tmp_path / "other"
    other.mkdir()
    (other / ADAPTER_CONFIG).write_text(json.dumps({**meta, "r": 8}))
    (other / ADAPTER_WEIGHTS).write_bytes((out / ADAPTER_WEIGHTS).read_bytes())
    with pytest.raises(ValueError, match="r=8"):
        load_learner_adapter(fresh, str(other))
    experts_only = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, seed=3),
                                   lora=L.lora_config(targets=("experts",)))
    with pytest.raises(ValueError, match="unexpected"):
        load_learner_adapter(experts_only, str(out))


# --------------------------------------------------------------------------- layouts (spawned processes, gloo)

LAYOUTS = {"EP=2": (1, 2, 1), "TP=2+SP": (2, 1, 1), "PP=2": (1, 1, 2)}


@pytest.fixture(scope="module")
def layout_reference(tmp_path_factory):
    """A base checkpoint, a PEFT adapter with non-zero A and B, and the LoRA step on one process."""
    from layout_scenarios import layout_logprobs
    from moe_grpo.checkpoint.peft import write_peft_adapter
    from moe_grpo.learner.spawn import run_distributed

    root = tmp_path_factory.mktemp("lora_layouts")
    ckpt, adapter = str(root / "ckpt"), str(root / "adapter")
    run_distributed(layout_logprobs, 1, 1, 1, 1, None, ckpt, {}, {})
    spec, cfg = tiny_spec(), L.lora_config()
    write_peft_adapter(adapter, L.random_adapter_state(spec, cfg), spec, cfg)
    ref = run_distributed(L.lora_layout_step, 1, 1, 1, 1, ckpt, adapter, {})[0]
    return ckpt, adapter, ref


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_lora_step_is_layout_invariant(layout_reference, name):
    from moe_grpo.learner.spawn import run_distributed

    ckpt, adapter, ref = layout_reference
    tp, ep, pp = LAYOUTS[name]
    out = run_distributed(L.lora_layout_step, tp * ep * pp, tp, ep, pp, ckpt, adapter, {})[0]
    assert ref["base_unchanged"] and out["base_unchanged"]
    assert max_abs_diff(out["before"], ref["before"]) < 1e-5
    m1, m2 = ref["metrics"], out["metrics"]
    assert abs(m1["loss"] - m2["loss"]) < 1e-6
    assert abs(m1["grad_norm"] - m2["grad_norm"]) / m1["grad_norm"] < 1e-4
    assert max_abs_diff(out["after"], ref["after"]) < 1e-4
    assert max_abs_diff(ref["after"], ref["before"]) > 1e-3  # the step moved the policy
    assert set(out["adapter"]) == set(ref["adapter"])
    diffs = torch.cat([(out["adapter"][k] - ref["adapter"][k]).abs().flatten() for k in ref["adapter"]])
    worst, off = float(diffs.max()), float((diffs > 1e-4).float().mean())
    # Adam's first step moves each entry by lr * g / (|g| + eps) (lr 1e-2, eps 1e-8): about lr whatever the
    # gradient's size, and for an entry whose gradient is near eps the summation-order noise of the reductions
    # (float32, ~1e-7 of the gradient) is amplified by up to lr / (4 eps). So nearly every entry agrees within 1%
    # of a step, and the few near-eps ones within 10% (worst seen: 1.35e-4, TP=2+SP, 2026-11-27; it was under
    # 1e-4 in every run before). A layout bug (a wrong shard, a missing reduction) moves many entries by ~lr.
    print(f"{name}: loss diff {abs(m1['loss'] - m2['loss']):.2e}, grad-norm rel diff "
          f"{abs(m1['grad_norm'] - m2['grad_norm']) / m1['grad_norm']:.2e}, log-prob diff after "
          f"{max_abs_diff(out['after'], ref['after']):.2e}, adapter diff {worst:.2e} ({off:.1e} of entries > 1e-4)")
    assert off < 1e-3, f"{off:.1e} of the updated adapter entries differ from the single-process step by > 1e-4"
    assert worst < 1e-3, f"updated adapters differ from the single-process step by {worst}"


# --------------------------------------------------------------------------- formats users have: HF base + PEFT adapter


@pytest.mark.slow
def test_an_exported_adapter_merged_by_the_tool_gives_transformers_the_learners_log_probs(tmp_path):
    """HF base (written by transformers, GQA: 4 query heads in 2 groups) -> Megatron -> LoRA learner with non-zero
    adapters -> PEFT export (both expert forms) -> tools/convert_checkpoint.py --merge-adapter -> transformers scores
    the merged model."""
    import sys

    from moe_grpo.checkpoint.peft import read_adapter_config, read_adapter_modules, write_peft_adapter
    from moe_grpo.checkpoint.verify import hf_logprobs

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "tools"))
    import convert_checkpoint

    targets = ("attention", "dense_mlp", "experts", "shared_experts")
    base_dir, adapter_dir, tokens, learner, lora_lp, base_lp = _hf_base_with_adapter(tmp_path, "qwen3_moe", targets)
    assert learner.spec.query_groups == 2 and learner.spec.num_attention_heads == 4
    assert read_adapter_config(adapter_dir)["target_parameters"]  # transformers 5 fuses experts: the fused form
    per_expert_dir, merged_dir, merged2_dir = (str(tmp_path / n) for n in ("per_expert", "merged", "merged2"))
    write_peft_adapter(per_expert_dir, learner.adapter_state(), learner.spec, learner.lora, experts="per_expert")
    assert not read_adapter_config(per_expert_dir).get("target_parameters")

    for adapter, out in ((adapter_dir, merged_dir), (per_expert_dir, merged2_dir)):
        assert convert_checkpoint.main(["--from", "hf", "--to", "hf", "--src", base_dir, "--dst", out,
                                        "--merge-adapter", adapter]) == 0
    from test_convert import load_dir

    base_w, merged_w, merged2_w = load_dir(base_dir), load_dir(merged_dir), load_dir(merged2_dir)
    assert set(merged_w) == set(merged2_w) and all(torch.equal(merged_w[k], merged2_w[k]) for k in merged_w)
    adapter, scale = read_adapter_modules(adapter_dir)
    for module in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.experts.2.up_proj"):
        a, b = (adapter[f"base_model.model.{module}.lora_{f}.weight"] for f in "AB")
        torch.testing.assert_close(merged_w[f"{module}.weight"], base_w[f"{module}.weight"] + scale * b @ a)
    assert torch.equal(merged_w["model.layers.1.mlp.gate.weight"], base_w["model.layers.1.mlp.gate.weight"])

    hf_lp = hf_logprobs(merged_dir, tokens)
    moved = max_abs_diff(lora_lp, base_lp)
    gap = max_abs_diff(hf_lp, lora_lp)
    print(f"adapters moved log-probs by {moved:.3e}; transformers on the merged model vs the LoRA learner: {gap:.3e}")
    assert moved > 1e-2
    assert gap < 1e-4


QWEN3_TARGETS = ("attention", "experts")  # Qwen3-MoE has no dense MLP layer and no shared experts
V3_TARGETS = ("attention", "dense_mlp", "experts", "shared_experts")


def _hf_base(tmp_path, kind):
    """A base written by transformers, converted to Megatron: Qwen3-MoE (GQA, 4 query heads in 2 groups) or
    DeepSeek-V3 (MLA, a dense first layer, a shared expert, expert bias). Returns (hf dir, megatron dir)."""
    from hf_fixtures import make_checkpoint
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moe_grpo.checkpoint.convert import hf_to_megatron

    base_dir, mg = str(tmp_path / f"hf_{kind}"), str(tmp_path / f"mg_{kind}")
    if kind == "qwen3_moe":
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(base_dir)
    else:
        make_checkpoint(kind, base_dir)
    hf_to_megatron(base_dir, mg, progress=False)
    return base_dir, mg


def _tokens(spec):
    rng = np.random.default_rng(0)
    return [rng.integers(0, spec.vocab_size, size=20) for _ in range(3)]


def _learner_logprobs(learner, tokens):
    from moe_grpo.learner.batch import LearnerSequence

    return learner.logprobs([LearnerSequence(t, prompt_len=1) for t in tokens], replay=False)


def _hf_base_with_adapter(tmp_path, kind, targets):
    """`_hf_base`; a LoRA learner on `targets` with non-zero adapters, exported by `export_learner_adapter` (the form
    'auto' picks). Returns (base_dir, adapter_dir, tokens, learner, its log-probs, the base model's log-probs)."""
    from moe_grpo.models.spec import read_spec
    from moe_grpo.learner.lora import load_adapter_state

    base_dir, mg = _hf_base(tmp_path, kind)
    adapter_dir = str(tmp_path / "adapter")
    spec, cfg = read_spec(mg), L.lora_config(targets=targets)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2), lora=cfg)
    learner.load_checkpoint(mg)  # a base checkpoint: the adapters keep their initial values (B = 0)
    tokens = _tokens(spec)
    base_lp = _learner_logprobs(learner, tokens)
    load_adapter_state(learner.adapters, L.random_adapter_state(spec, cfg), spec, cfg)
    lora_lp = _learner_logprobs(learner, tokens)
    export_learner_adapter(learner, adapter_dir, base_model=base_dir)
    return base_dir, adapter_dir, tokens, learner, lora_lp, base_lp


def _peft_model(base_dir, adapter_dir):
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                           adapter_dir)
    return model.eval()


def _hf_logprobs(model, tokens):
    out = []
    with torch.no_grad():
        for t in tokens:
            ids = torch.as_tensor(t, dtype=torch.long).unsqueeze(0)
            logits = model(input_ids=ids).logits.float()
            out.append(torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0].numpy())
    return out


@pytest.mark.slow
def test_peft_applies_the_exported_attention_adapters_to_the_transformers_base(tmp_path):
    """The PEFT library itself loading our export onto the transformers model: the same log-probs as the learner."""
    base_dir, adapter_dir, tokens, _, lora_lp, base_lp = _hf_base_with_adapter(tmp_path, "qwen3_moe", ("attention",))
    gap = max_abs_diff(_hf_logprobs(_peft_model(base_dir, adapter_dir), tokens), lora_lp)
    print(f"transformers + peft (attention adapters) vs the LoRA learner: {gap:.3e}")
    assert max_abs_diff(lora_lp, base_lp) > 1e-2
    assert gap < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind,targets", [("qwen3_moe", QWEN3_TARGETS), ("deepseek_v3", V3_TARGETS)])
def test_peft_applies_the_exported_expert_adapters_to_the_transformers_base(tmp_path, kind, targets):
    """transformers 5 holds the routed experts as fused 3-D parameters: the export writes them as PEFT
    `target_parameters` (gate_up at rank 2r, block-diagonal B), and PEFT gives the learner's log-probs."""
    from moe_grpo.checkpoint.peft import read_adapter_config

    base_dir, adapter_dir, tokens, _, lora_lp, base_lp = _hf_base_with_adapter(tmp_path, kind, targets)
    meta = read_adapter_config(adapter_dir)
    assert "mlp.experts.gate_up_proj" in meta["target_parameters"]
    model = _peft_model(base_dir, adapter_dir)
    experts = model.base_model.model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "ParamWrapper" and experts.parameter_name == "down_proj"
    if kind == "deepseek_v3":  # the dense MLP and the shared experts stay adapted where they are
        layers = model.base_model.model.model.layers
        assert {type(layers[0].mlp.gate_proj).__name__, type(layers[1].mlp.shared_experts.up_proj).__name__} == {
            "ParamWrapper"}
    moved, gap = max_abs_diff(lora_lp, base_lp), max_abs_diff(_hf_logprobs(model, tokens), lora_lp)
    print(f"{kind}: adapters moved log-probs by {moved:.3e}; transformers + peft vs the LoRA learner: {gap:.3e}")
    assert moved > 1e-2
    assert gap < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_an_adapter_peft_wrote_with_target_parameters_loads_into_the_learner(tmp_path, kind):
    """A user's adapter: `peft.get_peft_model` with `target_parameters` on the fused experts (gate_up at rank r, one
    A for gate and up) and `target_modules` on attention, non-zero, saved by PEFT -> `init.adapter=DIR` (the
    learner's `load_adapter`) gives transformers + PEFT's log-probs."""
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")
    from transformers import AutoModelForCausalLM

    from moe_grpo.models.spec import read_spec

    base_dir, mg = _hf_base(tmp_path, kind)
    attention = (["q_proj", "k_proj", "v_proj", "o_proj"] if kind == "qwen3_moe"
                 else ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        peft.LoraConfig(r=L.RANK, lora_alpha=L.ALPHA, target_modules=attention,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if ".lora_B." in name else 0.3))
    model.eval()
    spec = read_spec(mg)
    tokens = _tokens(spec)
    peft_lp = _hf_logprobs(model, tokens)
    adapter_dir = str(tmp_path / "peft_adapter")
    model.save_pretrained(adapter_dir)

    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2),
                              lora=L.lora_config(targets=("attention", "experts")))
    learner.load_checkpoint(mg)
    base_lp = _learner_logprobs(learner, tokens)
    load_learner_adapter(learner, adapter_dir)
    lora_lp = _learner_logprobs(learner, tokens)
    moved, gap = max_abs_diff(lora_lp, base_lp), max_abs_diff(lora_lp, peft_lp)
    print(f"{kind}: PEFT's adapter moved log-probs by {moved:.3e}; "
          f"the learner with it vs transformers + peft: {gap:.3e}")
    assert moved > 1e-2
    assert gap < 1e-4


def test_the_fused_form_reads_back_exactly_and_auto_follows_transformers(tmp_path):
    """Both forms of the tiny model's adapters (dense MLP, shared and routed experts, attention) read back to the
    same tensors, bit for bit; 'auto' writes the fused form for the architectures transformers fuses."""
    from moe_grpo.checkpoint.peft import (read_adapter_config, read_adapter_weights, read_peft_adapter,
                                          resolve_experts_form, write_peft_adapter)
    from moe_grpo.config import load_model_spec

    spec, cfg = tiny_spec(), L.lora_config()
    state = L.random_adapter_state(spec, cfg)
    for form in ("fused", "per_expert"):
        out = write_peft_adapter(tmp_path / form, state, spec, cfg, experts=form)
        back = read_peft_adapter(out, cfg)
        assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state), form
    meta, raw = read_adapter_config(tmp_path / "fused"), read_adapter_weights(tmp_path / "fused")
    import re
    assert "model.layers.0.mlp.gate_proj.weight" in meta["target_parameters"]
    assert "model.layers.2.mlp.shared_experts.down_proj.weight" in meta["target_parameters"]
    assert not re.fullmatch(meta["target_modules"], "model.layers.0.mlp.gate_proj")  # not also a module target
    assert meta["rank_pattern"] == {r"mlp\.experts\.gate_up_proj": 2 * L.RANK}
    n_exp, ffn = spec.num_experts, spec.moe_ffn_hidden_size
    gate_up_b = raw["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]
    assert gate_up_b.shape == (2 * ffn, 2 * L.RANK * n_exp)
    assert raw["base_model.model.model.layers.1.mlp.experts.lora_A.weight"].shape == (L.RANK * n_exp, ffn)
    assert not any(".experts.3." in k for k in raw)
    assert resolve_experts_form("auto", spec) == "per_expert"  # DeepSeek-MoE: no fused transformers class
    for name in ("qwen3_moe_30b_a3b", "deepseek_v3"):
        assert resolve_experts_form("auto", load_model_spec(name)) == "fused"

    # A rank-2r gate_up adapter that is not two rank-r blocks cannot be the learner's rank-r gate and up.
    from safetensors.torch import save_file

    raw["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"] = gate_up_b + 1e-3
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(meta))
    save_file(raw, str(tmp_path / "bad" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="not block-diagonal"):
        read_peft_adapter(tmp_path / "bad", cfg)


def test_checkpoints_and_run_state_carry_the_adapters_and_their_optimizer_state(base, tmp_path):
    from moe_grpo.learner.optimizer import adam_step

    spec, state, seqs, _ = base
    learner = lora_learner(spec, state)
    learner.train_step(seqs, replay=True)
    learner.save_run_state(str(tmp_path / "run"))
    learner.save_checkpoint(str(tmp_path / "weights"))
    expected = learner.logprobs(seqs, replay=True)
    next_step = learner.train_step(seqs, replay=True)

    resumed = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2, seed=3), lora=L.lora_config())
    resumed.load_run_state(str(tmp_path / "run"))
    assert adam_step(resumed.optimizer) == 1
    assert max_abs_diff(resumed.logprobs(seqs, replay=True), expected) == 0.0
    again = resumed.train_step(seqs, replay=True)
    assert abs(again["loss"] - next_step["loss"]) < 1e-7 and abs(again["grad_norm"] - next_step["grad_norm"]) < 1e-6

    weights_only = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, seed=3), lora=L.lora_config())
    weights_only.load_checkpoint(str(tmp_path / "weights"))  # holds the adapters: they are loaded too
    assert max_abs_diff(weights_only.logprobs(seqs, replay=True), expected) == 0.0
