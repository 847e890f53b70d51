"""LoRA learner functions that run inside spawned processes (must be importable by name)."""

from __future__ import annotations

import torch

from layout_scenarios import make_sequences, shard, tiny_spec
from moe_grpo.checkpoint.peft import load_learner_adapter
from moe_grpo.learner.parallel import gather_by_index

RANK, ALPHA = 4, 8.0


def lora_config(**changes):
    from moe_grpo.learner.lora_config import LoraConfig

    return LoraConfig(**{"rank": RANK, "alpha": ALPHA, **changes})


def random_adapter_state(spec, config, seed: int = 7, b_std: float = 0.05) -> dict:
    """Every adapter tensor of `spec` in PEFT naming, A and B both non-zero (B = 0 would hide A's gradient)."""
    from moe_grpo.models.peft_names import peft_shapes

    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen) * (b_std if k.endswith("lora_B.weight") else 0.3)
            for k, shape in peft_shapes(spec, config).items()}


def lora_layout_step(tp: int, ep: int, pp: int, ckpt_dir: str, adapter_dir: str, spec_changes: dict,
                     dispatcher: str | None = None):
    """At (tp, ep, pp): the base checkpoint plus a PEFT adapter, log-probs before, one LoRA step, log-probs and the
    whole adapter after (gathered from every rank), and the base weights' checksum."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.models.megatron import MegatronOptions

    spec = tiny_spec(**spec_changes)
    options = MegatronOptions(token_dispatcher=dispatcher) if dispatcher else MegatronOptions()
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, lr=1e-2),
                              options, lora=lora_config())
    learner.load_checkpoint(ckpt_dir)
    load_learner_adapter(learner, adapter_dir)
    base_before = [p.detach().clone() for n, p in learner.module.named_parameters() if ".lora." not in n]
    seqs = make_sequences(spec, n=4)
    idx, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    before = gather_by_index(idx, learner.logprobs(mine, replay=True))
    metrics = learner.train_step(mine, replay=True)
    after = gather_by_index(idx, learner.logprobs(mine, replay=True))
    base_after = [p for n, p in learner.module.named_parameters() if ".lora." not in n]
    base_unchanged = all(torch.equal(a, b) for a, b in zip(base_before, base_after))
    adapter = learner.adapter_state()
    return {"metrics": metrics, "before": before, "after": after, "adapter": adapter,
            "base_unchanged": base_unchanged}


def lora_sync(tp: int, ep: int, pp: int, spec_changes: dict, lora_changes: dict, adapter_dir: str, root: str):
    """At (tp, ep, pp): a LoRA learner with the PEFT adapter of `adapter_dir` publishes version 0 (base version)
    and version 1 (adapters only) through shared memory at `root`. Returns rank 0's sync reports' metrics."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(**spec_changes), ParallelLayout(tp, ep, pp), LearnerConfig(seed=5),
                              lora=lora_config(**lora_changes))
    load_learner_adapter(learner, adapter_dir)
    sync = WeightSync(learner, SharedMemoryTransport(root), max_bucket_bytes=1 << 14)
    first = sync.sync(0).wait().metrics()
    second = sync.sync(1).wait().metrics()
    return {"base": first, "adapter": second}


def lora_publish_versions(tp: int, ep: int, spec_changes: dict, adapter_dir: str, versions: list, where,
                          roots: list | None = None) -> dict:
    """At (tp, ep): a LoRA learner with the PEFT adapter of `adapter_dir` publishes `versions` through `where` (a
    root, or a SyncLayout with `roots[rank]` standing for this rank's host root): the first whole (base and
    adapters), each after it adapters only, every adapter moved before it. Returns {version: bytes this rank wrote
    or relayed}."""
    import os

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.config import ROOT_ENV
    from moe_grpo.sync.transports import make_publisher
    from moe_grpo.sync.weight_sync import WeightSync

    rank = int(os.environ["RANK"])
    if roots is not None:
        os.environ[ROOT_ENV] = roots[rank]  # this rank's "host"
    learner = MegatronLearner(tiny_spec(**spec_changes), ParallelLayout(tp, ep, 1), LearnerConfig(seed=5),
                              lora=lora_config())
    load_learner_adapter(learner, adapter_dir)
    sync = WeightSync(learner, make_publisher(where, rank), max_bucket_bytes=1 << 14)
    out = {}
    for i, version in enumerate(versions):
        if i:
            with torch.no_grad():
                for adapter in learner.adapters.values():
                    for piece in adapter.pieces:
                        adapter.A[piece].add_(0.01 * i)
                        adapter.B[piece].mul_(1.5)
        out[version] = sync.sync(version).wait().bytes_written
    if hasattr(sync.transport, "close_relay"):
        sync.transport.close_relay()
    torch.distributed.barrier()  # every rank's relay is through before any process leaves
    return out


def lora_start(spec, lora, root):
    """A one-rank LoRA learner with a random non-zero adapter, its WeightSync through shared memory at `root/shm`
    with the base version (0) published, and that version's engine start directory. Returns (learner, sync,
    transport, sequences, the base model's log-probs of them, start directory)."""
    from pathlib import Path

    from moe_grpo.checkpoint.peft import write_peft_adapter
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_lora_version
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    root = Path(root)
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=4, lr=1e-2, seed=11), lora=lora)
    seqs = make_sequences(spec, n=4, with_routing=False)
    base_lp = learner.logprobs(seqs)  # B = 0: the base model
    write_peft_adapter(root / "adapter", random_adapter_state(spec, lora), spec, lora)
    load_learner_adapter(learner, str(root / "adapter"))
    transport = SharedMemoryTransport(str(root / "shm"))
    sync = WeightSync(learner, transport, max_bucket_bytes=1 << 20)
    sync.sync(0)
    start, _ = export_lora_version(spec, lora, transport.read_version(0), root / "model_v0")
    return learner, sync, transport, seqs, base_lp, start


def logprob_gap(a, b) -> float:
    """Largest |a - b| over lists of per-token log-prob arrays."""
    import numpy as np

    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b))
