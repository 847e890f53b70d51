"""Functions that run inside spawned learner processes (must be importable by name)."""

from __future__ import annotations

import numpy as np

from moe_grpo.learner.batch import LearnerSequence
from moe_grpo.learner.parallel import gather_by_index
from moe_grpo.routing.trace import RoutingTrace


def tiny_spec(**changes):
    from moe_grpo.config import load_model_spec

    spec = load_model_spec("deepseek_moe")
    # 4 layers so that PP=2 splits into stages of 2 (stage 0: dense + MoE).
    return spec.replace(num_layers=4, **changes)


def tiny_v3_spec(**changes):
    """DeepSeek-V3 routing and MLA at toy size: sigmoid scores, expert bias, 2 groups / top-1 group."""
    return tiny_spec(architecture="DeepseekV3ForCausalLM", q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=16, v_head_dim=16, score_function="sigmoid", expert_bias=True,
                     num_expert_groups=2, group_top_k=1, normalize_top_k=True, routed_scaling_factor=2.5, **changes)


def make_sequences(spec, n: int = 4, seed: int = 0, with_routing: bool = True) -> list[LearnerSequence]:
    rng = np.random.default_rng(seed)
    seqs = []
    for i in range(n):
        length = int(rng.integers(6, 14))
        tokens = rng.integers(0, spec.vocab_size, size=length)
        trace = None
        if with_routing:
            ids = np.stack([np.stack([rng.permutation(spec.num_experts)[: spec.top_k] for _ in range(spec.num_moe_layers)])
                            for _ in range(length - 1)])
            trace = RoutingTrace.from_array(ids, spec.num_experts)
        seqs.append(LearnerSequence(tokens, prompt_len=3, routing=trace, advantage=float(rng.normal())))
    return seqs


def shard(seqs, dp_rank: int, dp_size: int):
    per = -(-len(seqs) // dp_size)
    idx = list(range(dp_rank * per, min(len(seqs), (dp_rank + 1) * per)))
    return idx, [seqs[i] for i in idx]


def layout_logprobs(tp: int, ep: int, pp: int, ckpt_dir: str | None, save_to: str | None, spec_changes: dict,
                    learner_changes: dict, seq_seed: int = 0):
    """Build a learner at (tp, ep, pp), optionally load/save weights; return logprobs by sequence index."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout

    spec = tiny_spec(**spec_changes)
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, **learner_changes))
    if ckpt_dir:
        learner.load_checkpoint(ckpt_dir)
    if save_to:
        learner.save_checkpoint(save_to)
    seqs = make_sequences(spec, seed=seq_seed)
    idx, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    free = learner.logprobs(mine, replay=False)
    replayed = learner.logprobs(mine, replay=True)
    return {"free": gather_by_index(idx, free), "replay": gather_by_index(idx, replayed)}


def layout_train_step(tp: int, ep: int, pp: int, ckpt_dir: str, spec_changes: dict, learner_changes: dict,
                      algo: dict | None = None, replay: bool | str = True):
    """Load weights, take one policy-gradient step on the global batch (`algo`: AlgoConfig fields of the loss;
    `replay`: r3 / r2 / off), return loss and new logprobs."""
    from moe_grpo.algo.config import AlgoConfig
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout

    spec = tiny_spec(**spec_changes)
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp),
                              LearnerConfig(micro_batch_size=2, lr=1e-2, **learner_changes))
    learner.load_checkpoint(ckpt_dir)
    seqs = make_sequences(spec, n=4)
    idx, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    loss_fn = AlgoConfig(**algo).token_loss(16) if algo else None
    metrics = learner.train_step(mine, replay=replay, loss_fn=loss_fn)
    after = learner.logprobs(mine, replay=True)
    return metrics, gather_by_index(idx, after)


def reshard_and_save(tp: int, ep: int, pp: int, src: str, dst: str, dtype_name: str = "float32") -> None:
    """Load a Megatron checkpoint into a learner at (tp, ep, pp) and save it again from that layout."""
    import torch

    from moe_grpo.models.spec import read_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.models.megatron import MegatronOptions

    learner = MegatronLearner(read_spec(src), ParallelLayout(tp, ep, pp), LearnerConfig(),
                              MegatronOptions(params_dtype=getattr(torch, dtype_name)))
    learner.load_checkpoint(src)
    learner.save_checkpoint(dst)


def train_and_sync(tp: int, ep: int, pp: int, ckpt_dir: str, version: int, root: str):
    """Load the engine's starting weights, take one step, publish the new weights through the weight sync.

    Returns {sequence index: learner log-probs after the step} from rank 0's view.
    """
    from moe_grpo.models.spec import read_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    spec = read_spec(ckpt_dir)
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, lr=1e-2))
    learner.load_checkpoint(ckpt_dir)
    seqs = make_sequences(spec, n=4, with_routing=False)
    idx, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    learner.train_step(mine, replay=False)
    WeightSync(learner, SharedMemoryTransport(root), max_bucket_bytes=1 << 20).sync(version)
    after = learner.logprobs(mine, replay=False)
    return gather_by_index(idx, after)


def sync_and_save(tp: int, ep: int, pp: int, spec_changes: dict, version: int, root: str, save_to: str) -> None:
    """A randomly initialised learner at (tp, ep, pp) publishes its weights and saves them as a checkpoint."""
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    learner = MegatronLearner(tiny_spec(**spec_changes), ParallelLayout(tp, ep, pp), LearnerConfig(seed=tp + 2 * ep))
    WeightSync(learner, SharedMemoryTransport(root), max_bucket_bytes=1 << 16).sync(version)
    learner.save_checkpoint(save_to)


def background_sync_then_step(root: str) -> dict:
    """Publish version 1 in the background and take a training step at once; report what version 1 must hold."""
    import time

    import torch

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    spec = tiny_spec()
    learner = MegatronLearner(spec, config=LearnerConfig(micro_batch_size=2, lr=1e-2))
    before = hf_state_from_megatron(spec, {k: v.clone() if torch.is_tensor(v) else v for k, v in learner.module.state_dict().items()})

    class Slow(SharedMemoryTransport):  # a sync slower than the step's forward/backward, as at scale
        def bucket_views(self, slot, bucket, dtype):
            time.sleep(0.5)
            return super().bucket_views(slot, bucket, dtype)

    sync = WeightSync(learner, Slow(root), max_bucket_bytes=1 << 16)
    handle = sync.sync(1, background=True)
    in_flight = not handle.done()
    learner.train_step(make_sequences(spec, n=4), replay=True)
    after = hf_state_from_megatron(spec, dict(learner.module.state_dict()))
    metrics = handle.wait(60).metrics()
    sync.sync(2)  # the same placements, now reading the updated weights
    return {"before": before, "after": after, "in_flight": in_flight, "metrics": metrics,
            "changed": sorted(k for k in before if not torch.equal(before[k], after[k]))}


def die_while_publishing(root: str, version: int, after_buckets: int) -> None:
    """A learner that is killed (SIGKILL) after writing `after_buckets` buckets of `version`."""
    import os
    import signal

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    class Dying(SharedMemoryTransport):
        written = 0

        def bucket_views(self, slot, bucket, dtype):
            if self.written == after_buckets:
                os.kill(os.getpid(), signal.SIGKILL)
            self.written += 1
            return super().bucket_views(slot, bucket, dtype)

    learner = MegatronLearner(tiny_spec(), config=LearnerConfig())
    WeightSync(learner, Dying(root), max_bucket_bytes=1 << 16).sync(version)


def relay_receive(host: str, port: int, world: int, secret: str, rank: int, root: str,
                  die_after_buckets: int = -1) -> list:
    """A relay receiver on an 'engine host': returns the versions it got until the sender closed.

    With die_after_buckets >= 0 it is killed (SIGKILL) after receiving that many buckets."""
    import os
    import signal
    import sys

    from moe_grpo.sync.relay import RelayGroup
    from moe_grpo.sync.transport import SharedMemoryTransport

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    from whole_relay import RelayReceiver

    class Dying(SharedMemoryTransport):
        got = 0

        def raw_bucket(self, slot, bucket, writable):
            if self.got == die_after_buckets:
                os.kill(os.getpid(), signal.SIGKILL)
            self.got += 1
            return super().raw_bucket(slot, bucket, writable)

    receiver = RelayReceiver(Dying(root), RelayGroup(host, port, world, secret, timeout_s=30), rank)
    versions = []
    while (v := receiver.receive()) is not None:
        versions.append(v)
    return versions


def train_sync_then_route(tp: int, ep: int, pp: int, ckpt_dir: str, version: int, root: str, handoff: str,
                          train_seed: int, eval_tokens: list) -> dict:
    """One step from a checkpoint, publish it, then measure the learner against the engine that applied it.

    Log-probs of `eval_tokens` under the new weights come back at once; the learner then waits for the
    engine's routing of the same tokens (`handoff`/traces.npz, written by the caller after the engine
    applied `version`) and runs a replayed forward/backward on it, whose router disagreement is the
    fraction of (token, MoE layer) decisions where the learner's own routers choose other experts.
    Returns (from rank 0's view) {"logprobs": {i: array}, "router_disagreement", "replay/applied"}.
    """
    import os
    import time

    import torch

    from moe_grpo.models.spec import read_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    spec = read_spec(ckpt_dir)
    learner = MegatronLearner(spec, ParallelLayout(tp, ep, pp), LearnerConfig(micro_batch_size=2, lr=1e-2))
    learner.load_checkpoint(ckpt_dir)
    seqs = make_sequences(spec, n=4, seed=train_seed, with_routing=False)
    _, mine = shard(seqs, learner.rank["dp"], learner.rank["dp_size"])
    learner.train_step(mine, replay=False)
    WeightSync(learner, SharedMemoryTransport(root), max_bucket_bytes=1 << 20).sync(version)
    evals = [LearnerSequence(np.asarray(t), prompt_len=1) for t in eval_tokens]
    idx, mine = shard(evals, learner.rank["dp"], learner.rank["dp_size"])
    lps = gather_by_index(idx, learner.logprobs(mine, replay=False))
    path = os.path.join(handoff, "traces.npz")
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no engine routing at {path} within 300 s")
        time.sleep(0.2)
    time.sleep(0.2)  # written by rename, but give the writer's close a moment on slow filesystems
    traces = np.load(path)
    routed = [LearnerSequence(np.asarray(t), prompt_len=1, advantage=1.0,
                              routing=RoutingTrace.from_array(traces[f"t{i}"], spec.num_experts))
              for i, t in enumerate(eval_tokens)]
    _, mine = shard(routed, learner.rank["dp"], learner.rank["dp_size"])
    metrics = learner.forward_backward(mine, replay=True)
    learner.zero_grad()
    torch.distributed.barrier()
    return {"logprobs": lps, "router_disagreement": metrics["train/router_disagreement"],
            "replay/applied": metrics["replay/applied"]}


def intrude_on_the_learner_store() -> dict:
    """Both ranks join through `init_distributed` (Megatron's groups included); rank 0 then tries the store as a
    process without the secret would, lists this process's listening sockets, and both ranks all-reduce."""
    import datetime
    import os
    import secrets

    import psutil
    import torch
    import torch.distributed as dist

    from moe_grpo.learner.parallel import ParallelLayout, init_distributed
    from moe_grpo.learner.rendezvous import RunStore

    init_distributed(ParallelLayout())
    out: dict = {}
    if dist.get_rank() == 0:
        port = int(os.environ["MASTER_PORT"])
        try:
            out["tcpstore"] = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=3)).list_keys()
        except Exception as e:  # noqa: BLE001
            out["tcpstore"] = type(e).__name__
        try:
            out["runstore"] = RunStore("127.0.0.1", port, secrets.token_hex(32), datetime.timedelta(seconds=3)).num_keys()
        except Exception as e:  # noqa: BLE001
            out["runstore"] = type(e).__name__
        out["listening"] = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                                   if c.status == "LISTEN"})
        out["store_port_listening"] = port in {c.laddr.port for c in psutil.Process().net_connections("tcp")
                                               if c.status == "LISTEN"}
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    out["sum"] = float(t)
    return out


def publish_versions(tp: int, ep: int, versions: list, where, roots: list | None = None, delta: bool = False) -> dict:
    """A seeded learner at (tp, ep) publishes `versions` (its weights scaled by 1.5 before each after the first;
    with `delta`, in bf16 as delta versions, a few elements of every third parameter moved instead) through
    `where` (a root, or a SyncLayout with `roots[rank]` standing for this rank's host root).
    Returns {version: bytes this rank wrote or relayed}."""
    import os

    import torch

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.config import ROOT_ENV
    from moe_grpo.sync.transports import make_publisher
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    rank = int(os.environ["RANK"])
    if roots is not None:
        os.environ[ROOT_ENV] = roots[rank]  # this rank's "host"
    learner = MegatronLearner(tiny_spec(), ParallelLayout(tp, ep, 1), LearnerConfig(seed=3))
    options = DeltaOptions() if delta else None
    sync = WeightSync(learner, make_publisher(where, rank), max_bucket_bytes=1 << 16,
                      dtype="bfloat16" if delta else None, delta=options)
    out = {}
    for i, version in enumerate(versions):
        if i:
            with torch.no_grad():
                for j, p in enumerate(learner.module.parameters()):
                    if not delta:
                        p.mul_(1.5)
                    elif (i + j) % 3 == 0:
                        p.view(-1)[i : i + 50] += 0.1
        out[version] = sync.sync(version).wait().bytes_written
    if hasattr(sync.transport, "close_relay"):
        sync.transport.close_relay()
    torch.distributed.barrier()  # every rank's relay is through before any process leaves
    return out
