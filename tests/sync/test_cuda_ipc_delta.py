"""Delta versions over `cuda_ipc` (issue 33): an fp32 learner on the GPU publishes bf16 versions into learner rank
0's device buffers, each version after the first as its changes only, and another process opening the buffers by
CUDA IPC handle reads exactly what a full version of the same weights gives.

`CudaIpcTransport` refuses to start without CUDA and its buffers are CUDA memory only (`share_handle` takes a CUDA
tensor), so this runs on a GPU alone; the same scenario over shared memory runs on CPU through `publish_versions`
with `SharedMemoryTransport` (the delta path in `weight_sync.py` is the same: `raw_bucket`, `flat_bucket`,
`apply_bucket`), and tests/sync/test_delta_sync.py checks that path at TP=2 and EP=2."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu]

READER = r"""
import hashlib, json, sys, torch
from moe_grpo.sync.cuda_ipc import CudaIpcTransport
from moe_grpo.sync.transport import SharedMemoryTransport
kind, version, roots = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
out = {}
for root in roots:
    t = CudaIpcTransport(root) if kind == "cuda_ipc" else SharedMemoryTransport(root)
    slot, _ = t.wait_complete(version, timeout_s=60)
    t.pin("test-reader", {slot: version})
    got = t.read_version(version)
    t.unpin("test-reader")
    out[root] = {n: [v.device.type, str(v.dtype), hashlib.sha256(v.cpu().reshape(-1).view(torch.uint8).numpy()
                                                                  .tobytes()).hexdigest()] for n, v in got.items()}
print("DIGESTS " + json.dumps(out))
"""


def read_in_other_process(kind: str, version: int, roots: list[str]) -> dict[str, dict[str, list[str]]]:
    """Per root: {HF name: [device type, dtype, sha256 of the bits]} of `version` as another process reads it (a
    fresh process: nothing of the publisher's state, the buffers opened by handle)."""
    proc = subprocess.run([sys.executable, "-c", READER, kind, str(version), *roots], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("DIGESTS ")]
    assert line, (proc.stdout[-2000:], proc.stderr[-2000:])
    return json.loads(line[-1][len("DIGESTS "):])


def sha256_bf16(tensors: dict) -> dict[str, str]:
    """sha256 of each tensor's bits once cast to bfloat16 (`.to`, round to nearest even: what a full version holds)."""
    import hashlib

    import torch

    return {n: hashlib.sha256(t.detach().to(torch.bfloat16).cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            .hexdigest() for n, t in tensors.items()}


STEPS = {1: False, 2: True, 3: True, 4: False, 5: True, 6: True}
"""Versions published, and whether an optimizer step comes before each (version 4: the same weights as 3)."""
FULL_EVERY = 4
"""`sync.full_every`: version 5 (after 4 published) goes whole; version 6 is a delta whose chain crosses it."""


def publish_versions(kind: str, tmp_path, torch_ops: bool = False) -> list[dict]:
    """Publish `STEPS` from a float32 learner in bf16 twice, with delta versions and whole (two roots of `kind`:
    "cuda_ipc" or "shm"); after each version, another process reads both. Returns one row per version.
    `torch_ops`: the delta side takes the device path on CPU too (`DeltaOptions.torch_ops`; a CUDA learner
    always does)."""
    import torch

    from layout_scenarios import make_sequences, tiny_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.sync_metrics import combine_sync_metrics
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    if kind == "cuda_ipc":
        from moe_grpo.sync.cuda_ipc import CudaIpcTransport as Transport
    else:
        Transport = SharedMemoryTransport
    spec = tiny_spec()
    # lr 1e-6, constant: 2.8-5.5% of the bf16 values changed per step when this ran over shm on CPU (2026-11-27).
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-6, lr_decay="constant"))
    assert {p.dtype for p in learner.module.parameters()} == {torch.float32}
    assert next(learner.module.parameters()).is_cuda == (kind == "cuda_ipc")
    roots = [str(tmp_path / "delta"), str(tmp_path / "full")]
    # Two slots: each version goes into the slot of the version two before it, which the delta path must bring
    # forward by two versions' changes (or write whole where the chain crosses a whole version).
    delta_t, full_t = Transport(roots[0], slots=2), Transport(roots[1], slots=2)
    rows = []
    try:
        delta = WeightSync(learner, delta_t, max_bucket_bytes=1 << 16, dtype="bfloat16",
                           delta=DeltaOptions(max_fraction=0.5, full_every=FULL_EVERY, torch_ops=torch_ops))
        assert delta._tracker.torch_ops == (torch_ops or kind == "cuda_ipc")
        full = WeightSync(learner, full_t, max_bucket_bytes=1 << 16, dtype="bfloat16")
        assert len(delta.plan.buckets) > 2 and delta.plan.dtype == "bfloat16"
        for version, step in STEPS.items():
            if step:
                learner.train_step(make_sequences(spec, n=4, seed=version), replay=True)
            d, f = delta.sync(version).wait(), full.sync(version).wait()
            read = read_in_other_process(kind, version, roots)
            rows.append({"version": version, "delta": combine_sync_metrics([d.metrics()]),
                         "full": combine_sync_metrics([f.metrics()]), "delta_read": read[roots[0]],
                         "full_read": read[roots[1]],
                         "weights": sha256_bf16(hf_state_from_megatron(learner.spec, learner.module.state_dict())),
                         "changed_since": (None if version == 1 else delta_t.changed_since(version - 1, version))})
    finally:
        delta_t.close()
        full_t.close()
    return rows


def check_versions(rows: list[dict], device_type: str) -> list[str]:
    """The checks on `publish_versions`' rows; returns one line of figures per version."""
    from moe_grpo.sync.sync_metrics import expert_bitmaps

    lines = []
    previous = None
    for row in rows:
        v, delta, full = row["version"], row["delta"], row["full"]
        got, want = row["delta_read"], row["full_read"]
        # Exact: the delta version equals, tensor by tensor, the full version of the same weights, which equals the
        # learner's weights cast to bf16; the reader got device tensors in bf16.
        assert set(got) == set(want) == set(row["weights"]), v
        assert {tuple(x[:2]) for x in [*got.values(), *want.values()]} == {(device_type, "torch.bfloat16")}, v
        mismatched = sorted(n for n in want if got[n][2] != want[n][2])
        assert mismatched == [], (v, mismatched)
        assert [n for n in want if want[n][2] != row["weights"][n]] == [], v
        # Reported: what a full version would have been is what the full sync sent (2 bytes an element).
        assert delta["sync/full_bytes"] == full["sync/bytes"] == full["sync/full_bytes"] > 0, v
        changed = delta["sync/changed_fraction"] * full["sync/bytes"] / 2
        if v == 1 or (v - 1) % FULL_EVERY == 0:  # the first version; the periodic full one (v - 1 published)
            assert delta["sync/delta"] == 0.0 and delta["sync/bytes"] == full["sync/bytes"], (v, delta)
        else:
            assert delta["sync/delta"] == 1.0, (v, delta)
            # Bitmap encoding bound (the sync sends the smallest of three): 1/16 of the bf16 bytes + 2 bytes a
            # change, + 1 byte of bitmap padding per bucket.
            assert delta["sync/bytes"] <= full["sync/bytes"] / 16 + 2 * changed + 100, (v, delta)
            assert delta["sync/bytes"] < full["sync/bytes"] / 2, (v, delta)
        if v == 1:
            assert delta["sync/changed_fraction"] == 1.0
        elif not STEPS[v]:  # no step: nothing changed, nothing sent, every expert unchanged
            assert delta["sync/changed_fraction"] == 0.0 and delta["sync/bytes"] == 0.0, (v, delta)
        else:
            assert 0.0 < delta["sync/changed_fraction"] < 0.25, (v, delta)
        if previous is not None:
            # Which tensors changed, as the full versions' hashes say: the experts unchanged, and (for a delta
            # version) the change log an engine reloads from.
            moved = {n for n in want if want[n][2] != previous[n][2]}
            held = expert_bitmaps(want)
            touched = expert_bitmaps(moved)
            experts = sum(bin(b & ~touched.get(layer, 0)).count("1") for layer, b in held.items())
            assert delta["sync/experts_unchanged"] == experts, (v, delta["sync/experts_unchanged"], experts)
            if delta["sync/delta"] == 1.0:
                assert row["changed_since"] == moved, (v, sorted(moved ^ (row["changed_since"] or set()))[:10])
            else:
                assert row["changed_since"] is None, v  # a whole version: engines reload everything
        previous = want
        lines.append(f"version {v}: delta {delta['sync/delta']:.0f}, changed {delta['sync/changed_fraction']:.4f}, "
                     f"bytes {delta['sync/bytes']:.0f} of {delta['sync/full_bytes']:.0f} "
                     f"({delta['sync/bytes'] / delta['sync/full_bytes']:.4f}), experts unchanged "
                     f"{delta['sync/experts_unchanged']:.0f}, {len(want)} tensors equal by sha256")
    return lines


def test_delta_versions_over_cuda_ipc_read_by_another_process_equal_full_versions_by_sha256(
        tmp_path, monkeypatch):
    """An fp32 CUDA learner, lr 1e-6, publishes 6 bf16 versions through `CudaIpcTransport` with `sync.delta`
    (max_fraction 0.5, full_every 4, 2 slots) and, beside it, whole; a fresh process opens both by IPC handle after
    each version. Every tensor it reads of the delta version has the sha256 of the full version's (and of the
    learner's weights cast to bf16); versions 2-4 and 6 are deltas that send less than half the bytes (within the
    bitmap bound), version 4 (no step) sends nothing, 5 goes whole (full_every); `sync/experts_unchanged` and the
    engines' change log (`changed_since`) name exactly the tensors whose hashes moved.

    Would have caught: changes applied to rank 0's device buffers at the wrong place or onto the wrong version (a
    recycled slot brought forward by a wrong or partial chain, fresh buffers taken for a base: `forget_base`), a
    diff on the device that misses changes or puts them at the wrong indices (across compare chunks), fp32 words
    in bf16 buffers, a version without changes that writes or reports anything, a change log naming other
    tensors than those that changed, or `sync/bytes` reporting the whole version; and likely (the reader opens
    the buffers right after `wait()`) changes left on the side stream unsynchronised at `mark_done`. Dropping
    the oldest link of each chain made it fail at version 3 (the same scenario over shm on CPU)."""
    from moe_grpo.sync import delta

    # Compared 4099 elements at a time (64M by default on a GPU): each 64 KB bucket's diff crosses chunk
    # boundaries, at odd offsets, as a large model's buckets do.
    monkeypatch.setattr(delta, "COMPARE_CHUNK", 4099)
    monkeypatch.setattr(delta, "COMPARE_CHUNK_DEVICE", 4099)
    for line in check_versions(publish_versions("cuda_ipc", tmp_path), "cuda"):
        print(line)
