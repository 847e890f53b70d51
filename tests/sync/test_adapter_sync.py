"""Adapter-only weight sync (LoRA): the plan, its checks, and every learner layout's adapter shards in place."""

import pytest
import torch

import lora_scenarios as L
from layout_scenarios import tiny_spec
from moe_grpo.models.peft_names import peft_shapes
from moe_grpo.models.hf_names import hf_shapes
from moe_grpo.sync.plan import BucketPlan, check_plan, plan_buckets
from test_gather import QWEN, V3

NO_MLA_ATTENTION = ("dense_mlp", "experts", "shared_experts")
"""DeepSeek-V3's MLA attention adapters need TP=1 in the learner (learner/lora.py)."""


def test_a_base_plan_carries_base_and_adapters_and_an_adapter_plan_only_the_adapters():
    spec, lora = tiny_spec(**QWEN), L.lora_config()
    base, adapters = plan_buckets(spec, torch.float32, 1 << 14, lora=lora), \
        plan_buckets(spec, torch.float32, 1 << 14, lora=lora, base=False)
    assert set(base.shapes()) == set(hf_shapes(spec)) | set(peft_shapes(spec, lora))
    assert adapters.shapes() == peft_shapes(spec, lora)
    assert not any(".mlp.gate." in n for n in adapters.shapes()), "router weights are never shipped as adapters"
    assert base.lora.base and not adapters.lora.base and adapters.lora.scale == L.ALPHA / L.RANK
    assert BucketPlan.from_json(adapters.to_json()) == adapters
    check_plan(base, spec, lora)
    check_plan(adapters, spec, lora)
    print(f"adapter version {adapters.total_bytes} B, base version {base.total_bytes} B")
    assert adapters.total_bytes < base.total_bytes / 5


@pytest.mark.parametrize("engine_lora,message", [
    (None, "engine was started without lora"),
    ({"rank": 8}, "rank=4"),
    ({"alpha": 4.0}, "alpha=8.0"),
    ({"targets": ("experts",)}, "targets="),
])
def test_the_engine_refuses_adapters_that_do_not_fit_it_before_applying_any(engine_lora, message):
    spec = tiny_spec(**QWEN)
    plan = plan_buckets(spec, torch.float32, lora=L.lora_config(), base=False)
    with pytest.raises(ValueError, match=message):
        check_plan(plan, spec, None if engine_lora is None else L.lora_config(**engine_lora))
    with pytest.raises(ValueError, match="carries no adapters"):
        check_plan(plan_buckets(spec, torch.float32), spec, L.lora_config())


# --------------------------------------------------------------------------- every layout (spawned processes, gloo)

CASES = {"qwen3-EP=2": ("qwen3", (1, 2, 1)), "qwen3-TP=2": ("qwen3", (2, 1, 1)), "qwen3-PP=2": ("qwen3", (1, 1, 2)),
         "v3-TP=2": ("deepseek_v3", (2, 1, 1)), "v3-EP=2": ("deepseek_v3", (1, 2, 1))}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(CASES))
def test_every_layout_places_its_adapter_shards_where_a_one_rank_learner_holds_them(name, tmp_path):
    """Each rank writes only its adapter shards (TP: B rows of column-parallel, A columns of row-parallel layers;
    EP: its experts; PP: its layers; replicas nothing) and the assembled version equals, bit for bit, the adapters
    a one-rank learner holds after loading the same PEFT adapter (load_adapter is an exact copy)."""
    from moe_grpo.checkpoint.peft import write_peft_adapter
    from moe_grpo.learner.spawn import run_distributed
    from moe_grpo.sync.sync_metrics import combine_sync_metrics
    from moe_grpo.sync.transport import SharedMemoryTransport

    family, (tp, ep, pp) = CASES[name]
    changes = {"qwen3": QWEN, "deepseek_v3": V3}[family]
    lora_changes = {"targets": NO_MLA_ATTENTION} if family == "deepseek_v3" and tp > 1 else {}
    spec, lora = tiny_spec(**changes), L.lora_config(**lora_changes)
    want = L.random_adapter_state(spec, lora)
    write_peft_adapter(tmp_path / "adapter", want, spec, lora)
    root = str(tmp_path / "shm")
    ranks = run_distributed(L.lora_sync, tp * ep * pp, tp, ep, pp, changes, lora_changes, str(tmp_path / "adapter"),
                            root)
    transport = SharedMemoryTransport(root)
    base_version, adapter_version = transport.read_version(0), transport.read_version(1)
    plan = transport.wait_complete(1, 5)[1]
    assert set(adapter_version) == set(want) and plan.lora is not None and not plan.lora.base
    for key, t in want.items():
        assert torch.equal(adapter_version[key], t), f"{key} differs from the one-rank adapter"
        assert torch.equal(base_version[key], t), f"{key} differs in the base version"
    assert set(base_version) == set(want) | set(hf_shapes(spec))
    sent = {kind: combine_sync_metrics([r[kind] for r in ranks])["sync/bytes"] for kind in ("base", "adapter")}
    adapter_bytes = sum(e.numel for b in plan.buckets for e in b.entries) * plan.torch_dtype.itemsize
    assert sent["adapter"] == adapter_bytes < sent["base"] / 5  # each element sent once, by one rank
