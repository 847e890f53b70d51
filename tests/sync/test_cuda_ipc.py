"""The CUDA-IPC transport: learner weights on the GPU, read by another process through IPC handles."""

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu]

READER = r"""
import sys, torch
from moe_grpo.sync.cuda_ipc import CudaIpcTransport
root, version, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
t = CudaIpcTransport(root)
slot, plan = t.wait_complete(version, timeout_s=60)
t.pin("test-reader", {slot: version})
got = t.read_version(version)
assert all(v.is_cuda for v in got.values())
torch.save({k: v.cpu() for k, v in got.items()}, out)
t.unpin("test-reader")
"""


def _read_in_other_process(root, version, out):
    proc = subprocess.run([sys.executable, "-c", READER, str(root), str(version), str(out)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    import torch

    return torch.load(out)


def test_another_process_reads_each_version_by_ipc_handle(tmp_path):
    import torch

    from layout_scenarios import make_sequences, tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.options import MegatronOptions
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.cuda_ipc import CudaIpcTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, lr=1e-2),
                              options=MegatronOptions(params_dtype="bfloat16"))
    transport = CudaIpcTransport(str(tmp_path / "ipc"), slots=2)
    sync = WeightSync(learner, transport, max_bucket_bytes=1 << 16)
    assert len(sync.plan.buckets) > 1 and sync.plan.dtype == "bfloat16"
    for version in (1, 2, 3):  # 3 reuses the slot of 1: same buffers, same handles, new bytes
        if version > 1:
            learner.train_step(make_sequences(tiny_spec(), n=4, seed=version), replay=True)
        report = sync.sync(version, background=version == 3).wait()
        assert report.bytes_written > 0
        want = hf_state_from_megatron(learner.spec, dict(learner.module.state_dict()))
        got = _read_in_other_process(tmp_path / "ipc", version, tmp_path / f"v{version}.pt")
        assert set(got) == set(want)
        for name, t in want.items():
            assert torch.equal(got[name], t.to(torch.bfloat16).cpu()), (version, name)
    transport.close()


def test_a_version_missing_a_rank_is_never_complete(tmp_path):
    import torch

    from layout_scenarios import tiny_spec
    from moe_grpo.sync.cuda_ipc import CudaIpcTransport
    from moe_grpo.sync.plan import plan_buckets
    from moe_grpo.sync.transport import SyncError

    plan = plan_buckets(tiny_spec(), torch.bfloat16, 1 << 16)
    t = CudaIpcTransport(str(tmp_path / "ipc"))
    slot = t.claim(1, plan, rank=0, world=2)
    with t.bucket_views(slot, plan.buckets[0], torch.bfloat16) as views:
        assert all(v.is_cuda for v in views.values())
        for v in views.values():
            v.fill_(1.0)
    t.mark_done(slot, 1, 0, {b.index: sum(e.numel for e in b.entries) for b in plan.buckets})
    with pytest.raises(SyncError, match=r"learner rank\(s\) \[1\] did not finish"):
        t.wait_complete(1, timeout_s=0.2)
    assert t.claim(1, plan, rank=1, world=2, timeout_s=5) == slot  # rank 1 finds rank 0's slot and handles
    with pytest.raises(SyncError, match="rank 0 claimed no buffer"):
        t.claim(2, plan, rank=1, world=2, timeout_s=0.2)
    t.close()


def test_delta_versions_through_cuda_ipc_equal_a_full_sync_bit_for_bit(tmp_path):
    """sync.delta with cuda_ipc: the rank applies each version's changes to rank 0's device buffers (bringing a
    recycled slot forward), and a reader in another process gets exactly the weights a full sync gives."""
    import torch

    from layout_scenarios import make_sequences, tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.cuda_ipc import CudaIpcTransport
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig(micro_batch_size=2, lr=2e-5, lr_decay="constant"))
    transport = CudaIpcTransport(str(tmp_path / "ipc"), slots=2)
    sync = WeightSync(learner, transport, max_bucket_bytes=1 << 16, dtype="bfloat16",
                      delta=DeltaOptions(max_fraction=0.9))
    for version in (1, 2, 3, 4):
        if version > 1:
            learner.train_step(make_sequences(tiny_spec(), n=4, seed=version), replay=True)
        metrics = sync.sync(version).wait().metrics()
        assert metrics["sync/delta"] == float(version > 1)
        want = hf_state_from_megatron(learner.spec, dict(learner.module.state_dict()))
        got = _read_in_other_process(tmp_path / "ipc", version, tmp_path / f"v{version}.pt")
        for name, t in want.items():
            assert torch.equal(got[name].view(torch.int16), t.to(torch.bfloat16).cpu().view(torch.int16)), (version, name)
    transport.close()
