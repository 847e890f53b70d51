"""Async runs with LoRA adapters and adapter-only weight sync, merged in the engine (sync.lora_apply=merge) or served
by vLLM (serve).

One run per family and layout (Qwen3-MoE at EP=2 with in-flight updates 'keep', DeepSeek-V3 at TP=2 with 'abort'),
merged, and one DeepSeek-V3 run at TP=2 with 'keep' whose adapters vLLM serves (no routed-expert targets: vLLM 0.32
cannot serve those on CPU),
from transformers-written checkpoints and a random PEFT adapter (non-zero A and B, so an engine that ignored the
adapters would be far off). Checked without a run: adapter shard placement for each family at each layout in
tests/sync/test_adapter_sync.py (bit-exact); the merge against the learner in tests/rollout/test_lora_merge.py and
serving in tests/rollout/test_lora_serving.py, on toy models (DeepSeek-MoE; DeepSeek-V3's MLA for serving) only, so
these runs are the one check of Qwen3-MoE's and DeepSeek-V3's adapters merged, and DeepSeek-V3's served, by vLLM.
Three runs, no fewer (issue 30): each is a (family, lora_apply) pair no other run covers; keep and abort each
appear once with merging, and both are checked mid-completion on the engine (tests/rollout/test_vllm_engine.py,
test_lora_serving.py).
"""

import json
import os
import sys

import pytest

from moe_grpo.config import from_hydra

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "checkpoint"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "learner"))
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])

MAX_PROBE_KL = 1e-8
"""The probe's k3 estimate of KL(engine || learner) on the same version, replay on: ~half the mean squared per-token
log-prob gap, so 1e-8 is a typical gap of ~1.4e-4 (an engine without the adapters: > 1e-3)."""


def lora_run(hf, cache, layout, on_update, adapter=None, targets=None, lora_apply="merge"):
    steps = 3  # the final version is probed at the run's end (Driver.finish_probes)
    tp, ep = (2, 1) if layout == "TP=2" else (1, 2)
    lora = {"rank": 4, "alpha": 8.0, **({"targets": list(targets)} if targets else {})}
    tree = {"steps": steps, "warm_start_steps": 0, "eval_every": 0, "mode": "async",
            "init": {"hf": hf, "cache_dir": str(cache), **({"adapter": adapter} if adapter else {})},
            "parallel": {"tensor_parallel": tp, "expert_parallel": ep}, "lora": lora,
            "cluster": {"learner_cpus": 0.5, "engine_cpus": 1.0}, "algo": {"prompts_per_step": 4, "group_size": 4},
            "learner": {"lr": 1e-2}, "rollout": {"max_tokens": 8, "max_num_seqs": 32, "on_update": on_update},
            "sync": {"lora_apply": lora_apply}}
    return from_hydra(tree)


@pytest.mark.parametrize("kind,layout,on_update,lora_apply", [("qwen3_moe", "EP=2", "keep", "merge"),
                                                              ("deepseek_v3", "TP=2", "abort", "merge"),
                                                              ("deepseek_v3", "TP=2", "keep", "serve")])
def test_an_async_lora_run_sends_the_base_once_and_engines_match_the_learner(hf_checkpoints, kind, layout, on_update,
                                                                            lora_apply, tmp_path, on_session_ray):
    import lora_scenarios as L
    from moe_grpo.checkpoint.peft import write_peft_adapter
    from moe_grpo.orchestrator.training_run import train
    from moe_grpo.sync.plan import plan_buckets

    paths, root = hf_checkpoints  # tests/conftest.py: shared with test_hf_runs, one conversion per family
    # DeepSeek-V3's MLA attention adapters need TP=1 in the learner (learner/lora.py)
    targets = ("dense_mlp", "experts", "shared_experts") if kind == "deepseek_v3" and layout == "TP=2" else None
    if lora_apply == "serve":
        targets = ("dense_mlp", "shared_experts")
    run = lora_run(paths[kind], root / "cache", layout, on_update, targets=targets, lora_apply=lora_apply)
    write_peft_adapter(tmp_path / "adapter", L.random_adapter_state(run.model, run.lora, b_std=0.02), run.model,
                       run.lora)
    run = lora_run(paths[kind], root / "cache", layout, on_update, str(tmp_path / "adapter"), targets, lora_apply)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = train(on_session_ray(run), run_dir)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    # sync/bytes counts the tensors' bytes the ranks wrote, not the buffers' alignment padding (plan.total_bytes)
    adapter_bytes = plan_buckets(run.model, "float32", lora=run.lora, base=False).tensor_bytes
    base_bytes = plan_buckets(run.model, "float32").tensor_bytes
    print(kind, layout, on_update, lora_apply, f"adapter version {adapter_bytes} B, base {base_bytes} B;",
          [(r["step"], r["sync/bytes"], round(r["sync/seconds"], 4), r["mismatch/kl"], r["mismatch/probe_version"],
            r["train/rollout_kl"]) for r in rows])
    assert [r["step"] for r in rows] == list(range(1, run.steps + 1)), "each step logged once"
    # A row carries the newest version every rank finished publishing (in async mode the step's own publish may
    # still be running: the first row shows the base version or version 1)
    first = plan_buckets(run.model, "float32", lora=run.lora).tensor_bytes
    assert [r["sync/bytes"] for r in rows][1:] == [adapter_bytes] * (run.steps - 1)
    assert rows[0]["sync/bytes"] in (adapter_bytes, first)
    assert adapter_bytes < base_bytes / 5
    measured = [r for r in rows if r["mismatch/probe_version"] is not None]  # null: no probe finished yet
    assert all(r["mismatch/kl"] < MAX_PROBE_KL for r in measured), \
        [(r["mismatch/probe_version"], r["mismatch/kl"]) for r in rows]
    # The rows' probes may all be of version 0 (CI saw it: each adapter version's round still sampling, or cut by
    # 'abort', when its step was logged); the summary's is the final version's, an adapter-only one.
    assert summary["mismatch"]["probe_version"] == run.steps, summary["mismatch"]
    assert summary["mismatch"]["kl"] < MAX_PROBE_KL, summary["mismatch"]
    assert os.path.isfile(os.path.join(summary["policy_dir"], "peft_adapter", "adapter_model.safetensors"))
