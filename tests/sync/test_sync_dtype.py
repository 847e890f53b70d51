"""Versions travel in the engines' dtype: a float32 learner publishing for bfloat16 engines casts its own shards
into the buckets, its weights untouched; the bytes reported follow; an engine refuses a version in another dtype."""

import pytest
import torch

from layout_scenarios import tiny_spec
from moe_grpo.learner.spawn import run_distributed
from moe_grpo.sync.plan import check_plan, plan_buckets
from moe_grpo.sync.weight_sync import BoundCopy


def publish_both(tp: int, fp32_root: str, bf16_root: str) -> dict:
    """A float32 learner at TP=`tp` publishes version 1 as float32 and version 2 (the same weights) as bfloat16;
    returns both reports and whether its parameters came out of the bf16 publish bit for bit as they went in."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(), ParallelLayout(tp, 1, 1), LearnerConfig(seed=5))
    params = list(learner.module.parameters())
    before = [p.detach().clone() for p in params]
    fp32 = WeightSync(learner, SharedMemoryTransport(fp32_root), max_bucket_bytes=1 << 16).sync(1).wait()
    bf16 = WeightSync(learner, SharedMemoryTransport(bf16_root), max_bucket_bytes=1 << 16,
                      dtype="bfloat16").sync(2).wait()
    untouched = all(p.dtype == torch.float32 and torch.equal(p.detach(), b) for p, b in zip(params, before))
    return {"fp32": fp32, "bf16": bf16, "untouched": untouched}


@pytest.mark.multiprocess
def test_a_bf16_version_holds_the_fp32_weights_cast_to_bf16_in_half_the_bytes(tmp_path):
    """Would have caught: a bf16 engine receiving float32 (the plan made in the learner's dtype: twice the bytes,
    vLLM casting on load), a cast that is not round-to-nearest (the bucket would differ from `.to(bfloat16)`),
    `sync/bytes` counting the learner's 4 bytes per element, or a publish that casts the learner's own weights."""
    from moe_grpo.sync.transport import SharedMemoryTransport

    fp32_root, bf16_root = str(tmp_path / "fp32"), str(tmp_path / "bf16")
    out = run_distributed(publish_both, 2, 2, fp32_root, bf16_root)  # TP=2: strided shards (qkv groups, gate/up)
    transport = SharedMemoryTransport(bf16_root)
    plan = transport.wait_complete(2, timeout_s=5)[1]
    assert plan.dtype == "bfloat16"
    want, got = SharedMemoryTransport(fp32_root).read_version(1), transport.read_version(2)
    assert set(got) == set(want) and len(plan.buckets) > 2
    for name, t in want.items():
        assert t.dtype == torch.float32 and got[name].dtype == torch.bfloat16, name
        assert torch.equal(got[name], t.to(torch.bfloat16)), name
    assert all(rank["untouched"] for rank in out)  # the fp32 master weights are as they were
    elements = sum(t.numel() for t in want.values())
    assert sum(rank["bf16"].bytes_written for rank in out) == 2 * elements  # each element written once, 2 bytes
    assert sum(rank["fp32"].bytes_written for rank in out) == 4 * elements
    fp32_bytes, bf16_bytes = out[0]["fp32"].version_bytes, out[0]["bf16"].version_bytes
    assert bf16_bytes == plan.total_bytes
    assert plan.tensor_bytes == 2 * elements  # the buffers' padding is not sent
    # `sync/bytes`: what each rank wrote, added up over the ranks by the driver.
    assert sum(rank["bf16"].metrics()["sync/bytes"] for rank in out) == 2 * elements
    # Half, up to each tensor's padding to a 64-byte boundary in the buckets.
    assert 0 <= bf16_bytes - fp32_bytes / 2 <= 64 * len(want), (fp32_bytes, bf16_bytes)


def test_an_engine_refuses_a_version_in_another_dtype_naming_both():
    """Would have caught: a float32 version loaded by a bfloat16 engine (vLLM casts it silently) or the reverse (a
    learner configured for other engines), which a delta against the engine's own values would then corrupt."""
    spec = tiny_spec()
    check_plan(plan_buckets(spec, torch.bfloat16), spec, None, engine_dtype="bfloat16")
    with pytest.raises(ValueError, match="the version is in float32, the engine serves bfloat16"):
        check_plan(plan_buckets(spec, torch.float32), spec, None, engine_dtype="bfloat16")
    with pytest.raises(ValueError, match="the version is in bfloat16, the engine serves float32"):
        check_plan(plan_buckets(spec, "bfloat16"), spec, None, engine_dtype="float32")


def test_lora_versions_travel_in_float32_whatever_the_engines_serve():
    """Would have caught: adapters (and the base W0 a merging engine keeps) rounded to bf16 before the merge, which
    rounds W0 + scale B A a second time (see `version_dtype`)."""
    from lora_scenarios import lora_config
    from moe_grpo.sync.dtypes import version_dtype

    lora = lora_config()
    assert version_dtype("bfloat16") == "bfloat16" and version_dtype("float32", None) == "float32"
    assert version_dtype("bfloat16", lora) == "float32"
    spec = tiny_spec()
    check_plan(plan_buckets(spec, torch.float32, lora=lora), spec, lora, engine_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"the version is in bfloat16, the engine serves bfloat16 and takes versions "
                                         r"in float32 \(LoRA versions travel in float32\)"):
        check_plan(plan_buckets(spec, torch.bfloat16, lora=lora), spec, lora, engine_dtype="bfloat16")


def _cast_pairs(device):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=g).to(device) for n in (3, 64, 1000, 7)]
    dsts = [torch.zeros(len(srcs[0]), dtype=torch.bfloat16, device=device),
            torch.zeros(64, dtype=torch.float32, device=device),  # a same-dtype pair among the cast ones
            torch.zeros(1000, dtype=torch.bfloat16, device=device)[::1],
            torch.zeros(14, dtype=torch.bfloat16, device=device)[::2]]  # strided (a TP slab of a wider tensor)
    return dsts, srcs


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bound_copy_casts_pairs_of_two_dtypes_and_fuses_only_same_dtype_pairs(device):
    """Would have caught: a cast pair put into a fused group (its int64-word view would copy float32 bits into
    bfloat16 storage, or fail on the size mismatch)."""
    dsts, srcs = _cast_pairs(device)
    copy = BoundCopy(dsts, srcs)
    for (_, dtype), (group_dsts, group_srcs) in copy.fused.items():
        assert all(d.dtype == s.dtype for d, s in zip(group_dsts, group_srcs)), dtype
    if device == "cuda":
        assert len(copy.fused) == 1 and len(copy.single) == 3  # the fp32 pair fused, the casts one by one
    copy()
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.to(d.dtype)), (d.dtype, d.shape)


@pytest.mark.gpu
def test_an_fp32_cuda_learner_publishes_bf16_through_cuda_ipc(tmp_path):
    """Would have caught: cuda_ipc buffers sized or filled in the learner's dtype, or a fused copy of fp32 words
    into bf16 buffers (BoundCopy), when an fp32 learner on a GPU feeds bf16 engines."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.cuda_ipc import CudaIpcTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    assert {p.dtype for p in learner.module.parameters()} == {torch.float32}
    transport = CudaIpcTransport(str(tmp_path / "ipc"), slots=2)
    try:
        sync = WeightSync(learner, transport, max_bucket_bytes=1 << 16, dtype="bfloat16")
        report = sync.sync(1).wait()
        want = hf_state_from_megatron(learner.spec, dict(learner.module.state_dict()))
        got = transport.read_version(1)
        assert report.bytes_written == 2 * sum(t.numel() for t in want.values())
        for name, t in want.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name].cpu(), t.to(torch.bfloat16)), name
    finally:
        transport.close()


def publish_bf16_and_keep_fp32(root: str, version: int, weights_file: str) -> None:
    """A float32 learner publishes `version` for bf16 engines and writes its float32 weights (HF names) to a file."""
    from safetensors.torch import save_file

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(seed=11))
    WeightSync(learner, SharedMemoryTransport(root), max_bucket_bytes=1 << 20, dtype="bfloat16").sync(version).wait()
    save_file(hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())), weights_file)


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_a_bf16_engine_after_a_sync_holds_the_weights_cast_to_bf16_bit_for_bit(tmp_path):
    """A bf16 engine refuses a float32 version (nothing applied), takes the learner's bf16 version, and then holds,
    tensor by tensor (sha256 of vLLM's own parameters), what loading the learner's float32 weights cast to bf16 from
    a file gives. Would have caught: a float32 version served to a bf16 engine, a version that leaves any tensor
    unapplied, or a cast on the learner's side that differs from `.to(bfloat16)`."""
    from safetensors.torch import load_file

    from moe_grpo.rollout.export import export_model_dir
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport, SyncError
    from publishing import publish_version, serve_published

    spec = tiny_spec()
    weights_file = str(tmp_path / "learner.safetensors")
    run_distributed(publish_bf16_and_keep_fp32, 1, str(tmp_path / "bf16"), 2, weights_file)
    learner_fp32 = load_file(weights_file)
    g = torch.Generator().manual_seed(3)
    other = {k: t + 0.3 * t.abs().mean().clamp_min(1e-3) * torch.randn(t.shape, generator=g)
             for k, t in learner_fp32.items()}  # the engine starts on weights the learner does not hold
    engine = VllmEngine(export_model_dir(spec, other, tmp_path / "model"), spec, max_model_len=128, max_num_seqs=4,
                        dtype="bfloat16")
    transport = SharedMemoryTransport(str(tmp_path / "bf16"))
    fp32_transport = SharedMemoryTransport(str(tmp_path / "fp32"))
    try:
        started = engine.weight_digests()
        publish_version(fp32_transport, 1, spec, tensors=learner_fp32)
        with pytest.raises(SyncError, match=rf"engine {engine.engine_id} refused version 1: the version is in "
                                            "float32, the engine serves bfloat16"):
            apply_version(engine, fp32_transport, 1)
        assert engine.policy_version == 0 and engine.weight_digests() == started
        apply_version(engine, transport, 2)
        synced = engine.weight_digests()
        assert engine.policy_version == 2 and synced != started
        serve_published(engine, {k: t.to(torch.bfloat16) for k, t in learner_fp32.items()}, 3)
        loaded = engine.weight_digests()
        assert [n for n in loaded if loaded[n] != synced[n]] == []
    finally:
        engine.shutdown()
        transport.unpin(engine.engine_id)
        transport.close()
        fp32_transport.close()
