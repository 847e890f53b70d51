"""Writing a whole weight version through a transport as one learner rank would (tests of engines and syncs)."""

import torch


def publish_version(transport, version, spec, fill=0.0, tensors=None):
    """Publish `version` of `spec`: every tensor `fill`, or the HF-named `tensors`. Returns (slot, plan)."""
    from moe_grpo.sync.plan import plan_buckets

    plan = plan_buckets(spec, torch.float32, 1 << 16)
    slot = transport.claim(version, plan, 0, 1)
    counts = {}
    for b in plan.buckets:
        with transport.bucket_views(slot, b, torch.float32) as views:
            for name, t in views.items():
                t.copy_(tensors[name]) if tensors is not None else t.fill_(fill)
        counts[b.index] = sum(e.numel for e in b.entries)
    transport.mark_done(slot, version, 0, counts)
    return slot, plan
