"""Writing a whole weight version through a transport as one learner rank would (tests of engines and syncs), and
having an engine serve given weights the way a run's engine gets them (`serve_published`)."""

import atexit
import os
import tempfile

import torch


def publish_version(transport, version, spec, fill=0.0, tensors=None, dtype=torch.float32):
    """Publish `version` of `spec` in `dtype`: every tensor `fill`, or the HF-named `tensors` (cast to `dtype`).
    Returns (slot, plan)."""
    from moe_grpo.sync.plan import plan_buckets

    plan = plan_buckets(spec, dtype, 1 << 16)
    slot = transport.claim(version, plan, 0, 1)
    counts = {}
    for b in plan.buckets:
        with transport.bucket_views(slot, b, plan.torch_dtype) as views:
            for name, t in views.items():
                t.copy_(tensors[name]) if tensors is not None else t.fill_(fill)
        counts[b.index] = sum(e.numel for e in b.entries)
    transport.mark_done(slot, version, 0, counts)
    return slot, plan


_TRANSPORTS: dict = {}
"""engine id -> the shared-memory transport `serve_published` publishes that engine's versions through."""


def serve_published(engine, tensors, version):
    """Make `engine` serve the HF-named `tensors` as `version` the way a run's engine gets a version: published
    through a shared-memory transport in the dtype the engine takes (one transport per engine, kept until the test
    process ends, so the slot the engine serves stays its rollback source), then `deliver.apply_version`: the
    plan checked against the engine, the slot pinned, `load_published` all or nothing."""
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.dtypes import version_dtype
    from moe_grpo.sync.transports import shared_memory

    transport = _TRANSPORTS.get(engine.engine_id)
    if transport is None:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        root = tempfile.mkdtemp(prefix="moe_grpo_test_published_", dir=shm)
        transport = _TRANSPORTS[engine.engine_id] = shared_memory(root)
        atexit.register(transport.close)
    publish_version(transport, version, engine.spec, tensors=tensors, dtype=version_dtype(engine.dtype))
    apply_version(engine, transport, version)
