"""Engine, transformers and learner compute the same model, for every supported family.

Each family's checkpoint is written by transformers itself (random fp32 weights, `save_pretrained`), not by
the project's export, and served by `VllmEngine` as a user would serve it. The engine must match transformers'
per-token log-probs within 1e-4 and its routing on every (token, MoE layer) decision; then a learner at EP=2,
TP=2 and PP=2 (converted from the same checkpoint) takes a step and syncs it into the engine, and the engine
must match the learner the same way. One engine per family (module-scoped), four short sequences, and one pair of
learner processes per family that takes the three layouts in turn (family_learner.py).

DeepSeek-MoE (v1) has no transformers class: its checkpoint is written from a transformers Qwen2-MoE with the
same maths (no qkv bias; the shared expert's sigmoid gate zeroed, i.e. 0.5, folded into its down projection),
under DeepSeek-MoE's tensor names and config keys. DeepSeek-V3 is served twice: with plain RoPE, and with YaRN
scaling in its config (factor 4, original context 64, sequences past it).
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import layout_scenarios as S
from moe_grpo.learner.spawn import run_distributed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ["deepseek_v3", "qwen3_moe", "deepseek_moe", "deepseek_v2", "deepseek_v3_yarn"]
"""The first two are test_engine_tensor_parallel.py's, which runs first in the suite: their shared engines
(family_engines.py) are used up and shut down first."""
LAYOUTS = {"EP=2": (1, 2, 1), "TP=2": (2, 1, 1), "PP=2": (1, 1, 2)}
# fp32 on every side; what is left is summation order in different kernels (~1e-6 measured).
LOGPROB_TOL = 1e-4
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
COMMON = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MLA = dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
           kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)


def _eval_tokens(seed: int = 11) -> list[list[int]]:
    """Four sequences; two run past the YaRN checkpoint's original context of 64."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=n).tolist() for n in (24, 41, 90, 120)]


def _deepseek_moe_from_qwen2_moe(path: str) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from moe_grpo.rollout.export import _DEEPSEEK_V1_CONFIG

    cfg = Qwen2MoeConfig(**{k: v for k, v in COMMON.items()}, num_key_value_heads=4, num_experts=8,
                         shared_expert_intermediate_size=64, mlp_only_layers=[0], qkv_bias=False,
                         norm_topk_prob=False, use_sliding_window=False)
    model = Qwen2MoeForCausalLM(cfg).eval()
    state, out = model.state_dict(), {}
    for name, t in state.items():
        if ".mlp.shared_expert_gate." in name:
            with torch.no_grad():
                t.zero_()  # sigmoid(0) = 0.5 exactly
            continue
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.split(".experts.")[0]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.experts.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.experts.{e}.up_proj.weight"] = up.clone()
            continue
        if ".mlp.experts.down_proj" in name:
            prefix = name.split(".experts.")[0]
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.down_proj.weight"] = t[e].clone()
            continue
        if ".mlp.shared_expert." in name:
            new = name.replace(".shared_expert.", ".shared_experts.")
            out[new] = t.clone() * (0.5 if name.endswith("down_proj.weight") else 1.0)
            continue
        out[name] = t.clone()
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = dict(COMMON, architectures=["DeepseekForCausalLM"], model_type="deepseek", num_key_value_heads=4,
                  n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
                  norm_topk_prob=False, scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                  hidden_act="silu", rope_theta=cfg.rope_parameters["rope_theta"], torch_dtype="float32",
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekConfig"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "configuration_deepseek.py"), "w") as f:
        f.write(_DEEPSEEK_V1_CONFIG)
    return model


def write_checkpoint(family: str, path: str) -> torch.nn.Module:
    """A small random model of `family` saved by transformers; returns the transformers model (the reference)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "deepseek_moe":
        return _deepseek_moe_from_qwen2_moe(path)
    if family == "deepseek_v2":
        model = tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(**COMMON, **MLA, topk_method="greedy"))
    elif family.startswith("deepseek_v3"):
        yarn = dict(rope_parameters=dict(YARN, rope_theta=10000.0)) if family.endswith("yarn") else {}
        cfg = tf.DeepseekV3Config(**COMMON, **MLA, n_group=2, topk_group=1, norm_topk_prob=True,
                                  routed_scaling_factor=2.5, **yarn)
        model = tf.DeepseekV3ForCausalLM(cfg)
        with torch.no_grad():  # a non-zero expert bias, so that it matters to the routing
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.02)
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=32,
                                                         num_experts=8, norm_topk_prob=True))
    model.eval().save_pretrained(path)
    return model


def transformers_reference(model: torch.nn.Module, seqs: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per sequence: log-prob of every next token, and the top-k ids of every MoE layer's router per position."""
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(getattr(layer, "mlp", None), "gate")]
    seen: list = []
    hooks = [g.register_forward_hook(lambda m, i, o: seen.append(o[2].detach().clone())) for g in gates]
    lps, routes = [], []
    try:
        with torch.no_grad():
            for s in seqs:
                seen.clear()
                ids = torch.as_tensor(s).unsqueeze(0)
                logits = model(ids).logits[0, :-1].float()
                lps.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].numpy())
                routes.append(torch.stack(seen, dim=1).numpy())  # [positions, moe_layers, k]
    finally:
        for h in hooks:
            h.remove()
    return lps, routes


def engine_routing(engine, seqs: list[list[int]]) -> list[np.ndarray]:
    """The engine's routing of every position of each sequence but the last, as the learner feeds it."""
    from moe_grpo.rollout.types import SamplingSettings

    out = engine.generate([s[:-1] for s in seqs], SamplingSettings(n=1, max_tokens=1, temperature=0.0))
    return [group[0].routing.expert_ids for group in out]


def set_agreement(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        x, y = np.sort(x.astype(np.int64), -1), np.sort(y.astype(np.int64), -1)
        same += int((x == y).all(-1).sum())
        total += x.shape[0] * x.shape[1]
    return same / total


def max_gap(a, b) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """One family: the transformers model, its checkpoint as HF and Megatron directories, and an engine on it (the
    session's, family_engines.py: test_engine_tensor_parallel.py's TP=1 side serves from it too)."""
    from moe_grpo.checkpoint.convert import hf_to_megatron
    from moe_grpo.models.spec import read_spec
    from moe_grpo.models.hf_config import read_hf_config, spec_from_hf_config

    import family_engines

    shared = family_engines.acquire(request.param, tmp_path_factory)
    root = tmp_path_factory.mktemp(f"{request.param}_learner")
    hf, engine = shared.hf, shared.engine
    seqs = _eval_tokens()
    ref_lps, ref_routes = transformers_reference(shared.model, seqs)
    hf_to_megatron(hf, root / "mg", progress=False)
    spec = read_spec(root / "mg")  # the learner's description of the checkpoint, which the sync is checked against
    assert spec == spec_from_hf_config(read_hf_config(hf), name=spec.name)
    assert spec == engine.spec, "the engine serves the checkpoint the learner was converted from"
    fam = {"name": request.param, "spec": spec, "engine": engine, "seqs": seqs, "ref_lps": ref_lps,
           "ref_routes": ref_routes, "mg": str(root / "mg"), "root": root, "transports": []}
    yield fam
    family_engines.release(request.param, request)  # before the transports its versions came from go
    for transport in fam["transports"]:
        transport.close()


def test_engine_matches_transformers(family, record_property):
    engine, seqs = family["engine"], family["seqs"]
    gap = max_gap(engine.score(seqs), family["ref_lps"])
    routes = engine_routing(engine, seqs)
    agree = set_agreement(routes, [r[:-1] for r in family["ref_routes"]])
    record_property("engine_vs_transformers", {"family": family["name"], "max_logprob_gap": gap, "routing": agree})
    print(f"{family['name']}: engine vs transformers max |logprob gap| {gap:.2e}, routing agreement {agree}")
    assert gap < LOGPROB_TOL, f"{family['name']}: engine log-probs are {gap} away from transformers'"
    assert agree == 1.0, f"{family['name']}: engine routing agrees with transformers' on {agree:.4f} of decisions"


def test_rotary_patch_is_what_makes_mla_families_match(family):
    """vllm_patches.cpu_rotary_multihead_3d: without it DeepSeek-V2/V3 attention drifts from transformers."""
    if not family["spec"].uses_mla or family["spec"].yarn_rope is not None:
        pytest.skip("only MLA attention with plain RoPE takes vLLM's CPU rotary kernel with 3-D queries "
                    "(YaRN runs vLLM's PyTorch rotary)")
    engine, seqs = family["engine"], family["seqs"]
    assert engine._rpc("moe_grpo_set_rotary_patch", (False,))[0] > 0  # vLLM shares one rotary module (get_rope cache)
    try:
        without = max_gap(engine.score(seqs), family["ref_lps"])
        routing = set_agreement(engine_routing(engine, seqs), [r[:-1] for r in family["ref_routes"]])
    finally:
        engine._rpc("moe_grpo_set_rotary_patch", (True,))
    print(f"{family['name']} without the rotary patch: max |logprob gap| {without:.2e}, routing agreement {routing}")
    assert without > 1e-3, f"{family['name']}: the engine matches transformers without the patch ({without})"
    assert max_gap(engine.score(seqs), family["ref_lps"]) < LOGPROB_TOL


def _layouts_to_run(request, name: str) -> list[str]:
    """The layouts whose sync test of family `name` this session runs, in the order it runs them."""
    out = []
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if getattr(item, "module", None) is request.module and params and params.get("family") == name \
                and "layout" in params:
            out.append(params["layout"])
    return out


def _wait_for(ready, learner, what: str, timeout_s: float = 480.0) -> None:
    """Until `ready()`; fails at once with the learner's error if its processes ended first."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if learner.done():
            learner.result()  # raises the learner's error
            if ready():
                return
            raise AssertionError(f"the learner processes ended without {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def learner(family, request):
    """One pair of learner processes per family for every layout the session runs (family_learner.py): each layout's
    learner steps from the family's checkpoint, publishes the next version into a transport of its own, and measures
    itself against the engine's routing once the test has handed it over. Versions follow the order the tests run
    in, as when each test started its own pair."""
    from moe_grpo.sync.transport import SharedMemoryTransport
    from family_learner import sync_then_route_each_layout

    plan, args = {}, []
    for i, layout in enumerate(_layouts_to_run(request, family["name"])):
        tp, ep, pp = LAYOUTS[layout]
        handoff = family["root"] / f"handoff_{layout}"
        handoff.mkdir()
        transport = SharedMemoryTransport(str(family["root"] / f"shm_{layout}"))
        family["transports"].append(transport)
        version = family["engine"].policy_version + 1 + i
        plan[layout] = (version, transport, handoff)
        args.append((tp, ep, pp, version, str(transport.root), str(handoff), 100 + tp + 2 * ep + 4 * pp))
    pool = ThreadPoolExecutor(1)
    future = pool.submit(run_distributed, sync_then_route_each_layout, 2, args, family["mg"], family["seqs"],
                         timeout_s=480 * len(args))
    yield {"plan": plan, "future": future}
    left = [h for _, _, h in plan.values() if not (h / "traces.npz").exists()]
    for handoff in left:  # a test that did not hand its routing over: let the learner fail fast, not time out
        np.savez(handoff / "traces.npz")
    try:
        future.result()
    except Exception:
        if not left:  # every layout's test ran to its hand-over: the learner's failure is news
            raise
    finally:
        pool.shutdown()


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_matches_the_learner_after_a_sync(family, learner, layout, record_property):
    """Every family at EP=2, TP=2 and PP=2 (world size 2 each): after one learner step is published and applied,
    the engine's log-probs match the learner's and the learner's routers agree with the engine's routing."""
    import pickle

    from moe_grpo.sync.deliver import apply_version

    engine, seqs = family["engine"], family["seqs"]
    version, transport, handoff = learner["plan"][layout]
    before = engine.score(seqs)
    _wait_for(lambda: (transport.latest_complete() or -1) >= version, learner["future"], f"version {version}")
    try:
        apply_version(engine, transport, version, timeout_s=300)
        routes = engine_routing(engine, seqs)
        tmp = handoff / "traces.tmp.npz"
        np.savez(tmp, **{f"t{i}": r for i, r in enumerate(routes)})
        os.replace(tmp, handoff / "traces.npz")
    finally:
        if not (handoff / "traces.npz").exists():  # let the learner fail fast instead of waiting out its timeout
            np.savez(handoff / "traces.npz")
    _wait_for((handoff / "learner.pkl").exists, learner["future"], f"{layout} learner's result")
    with open(handoff / "learner.pkl", "rb") as f:
        result = pickle.load(f)
    learner_lps = [result["logprobs"][i] for i in range(len(seqs))]
    moved = max_gap(before, learner_lps)
    gap = max_gap(engine.score(seqs), learner_lps)
    record_property("engine_vs_learner", {"family": family["name"], "layout": layout, "before_sync": moved,
                                          "max_logprob_gap": gap, "router_disagreement": result["router_disagreement"]})
    print(f"{family['name']} {layout}: engine vs learner max |logprob gap| {moved:.2e} before the sync, {gap:.2e} "
          f"after; router disagreement {result['router_disagreement']}")
    assert moved > 10 * LOGPROB_TOL, f"the learner's step did not move its log-probs away from the engine's ({moved})"
    assert gap < LOGPROB_TOL, f"{family['name']} {layout}: engine log-probs are {gap} away from the learner's"
    assert result["router_disagreement"] == 0.0, (
        f"{family['name']} {layout}: the learner's routers disagree with the engine on "
        f"{result['router_disagreement']:.4f} of decisions")
