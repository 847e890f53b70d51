"""Weight-sync throughput (gather + rename + transfer) against a plain memcpy of the same bytes, in one run.

Builds a learner of at least --mb megabytes (fp32, one process), then times
`WeightSync.sync(version)`: every shard is written at its place in the full
HF-named tensors inside the transport's shared-memory buckets, which any
process on the host can map from then on. A second process (the receiving
side, as in an engine) waits for each version, maps its buckets and copies
every tensor into its own preallocated weights; that is timed too
(`deliver_seconds`) - it is the copy an engine's weight load makes. In the
same run it times `torch.Tensor.copy_` of the same number of bytes between
two warm buffers.

The first syncs touch fresh shared-memory pages (`first_sync_seconds`);
later ones reuse the transport's two slots, which is the steady state of a
training run, and their median is the figure compared with memcpy.

    .venv/bin/python tools/bench_sync.py [--mb 600] [--rounds 5] [--relay]
    python tools/bench_sync.py --transport cuda_ipc --model qwen3_moe_1b_64e   # on a CUDA GPU

With `--transport cuda_ipc` (CUDA) the learner holds bf16 weights on the GPU and
syncs into `CudaIpcTransport` buffers in its own device memory; the receiving
process opens them by CUDA IPC handle and copies every tensor device to device
into its own weights. The baseline is then a device-to-device `copy_` of the
same number of bytes (`memcpy_*` keys hold it), timed with the GPU synchronised.

With --relay it also times a whole-version gloo relay (tools/whole_relay.py) of the last
versions to a receiver process over loopback TCP (`relay_bytes_per_s`).

With `--transport relay` it times the run's relay across two Ray nodes
(`sync/shard_relay.py`, as `sync.transport=relay` runs it): a learner actor on
the first node publishes each version into its node's shared memory and
relays its shards to the agent on the second node (orchestrator/sync_hosts.py),
which writes them into that node's own shared memory; a version counts once
the second node reports it whole. Without `--ray-address` it starts the two
nodes itself on this machine (tools/ray_nodes.py: two `ray start` processes,
each with its own MOE_GRPO_SYNC_ROOT), so the bytes cross loopback TCP. The
memcpy baseline is a `copy_` of the same bytes in the learner actor, same run.

    .venv/bin/python tools/bench_sync.py --transport relay [--mb 600] [--ray-address HEAD:PORT]

With `--lora` it compares adapter-only versions with full-weight versions of the
same model (default: the run's default model, conf/model/deepseek_moe.yaml), in
one run: a learner without adapters publishes full versions, a learner with
adapters (`--lora-rank`, `--lora-targets`, default rank 16 on attention and
routed experts) publishes its base version once and adapter-only versions after
it (what `lora.rank > 0` runs publish). For each adapter version it also times
the engine's merge arithmetic (`rollout/lora_merge.py`: W0 + (alpha/r) B A of
every adapted weight, from the copy of W0), without vLLM's weight reload. The
same ratio is computed from the bucket plans, without building anything, for
Qwen3-30B-A3B and DeepSeek-V3 in bf16.

    .venv/bin/python tools/bench_sync.py --lora [--model deepseek_moe] [--lora-rank 16]

With `--delta`, delta versions against full versions from real optimizer steps at three learning rates, over
shared memory and the relay, with the projection to Qwen3-30B-A3B and DeepSeek-V3 (tools/bench_sync_delta.py).

    .venv/bin/python tools/bench_sync.py --delta [--delta-steps 5] [--delta-models 128e,large] [--delta-stages]

Last line: one JSON object with `sync_vs_memcpy_ratio` and `projected_deepseek_v3_seconds`
(DeepSeek-V3's bf16 bytes at the measured sync rate on this machine); with `--lora`,
`lora_bytes_ratio` (measured), `lora_bytes_ratio_qwen3_30b_a3b` and
`lora_bytes_ratio_deepseek_v3` (computed) and the seconds per sync of both kinds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time


def receiver(root: str, versions: list[int], queue: "mp.Queue", ipc: bool = False) -> None:
    """The engine's side: map (or open by CUDA IPC handle) each published version and copy it into its own tensors."""
    import torch

    from moe_grpo.sync.transport import SharedMemoryTransport, bucket_path, read_bucket
    from moe_grpo.sync.weight_sync import BoundCopy, copy_all

    if ipc:
        from moe_grpo.sync.cuda_ipc import CudaIpcTransport

        transport: SharedMemoryTransport = CudaIpcTransport(root)
    else:
        transport = SharedMemoryTransport(root)
    weights: dict[str, torch.Tensor] = {}
    bound: dict[tuple[str, int], BoundCopy] = {}
    for version in versions:
        slot, plan = transport.wait_complete(version, timeout_s=600)
        transport.pin("bench-receiver", {slot: version})
        t0 = time.perf_counter()
        for b in plan.buckets:
            reader = transport.read_bucket(slot, b, plan.torch_dtype) if ipc else \
                read_bucket(bucket_path(slot, b.index), b, plan.torch_dtype)
            with reader as views:
                for name, t in views.items():
                    if name not in weights:
                        weights[name] = torch.empty_like(t)
                if not ipc:
                    copy_all([weights[n] for n in views], list(views.values()))
                else:  # the opened device buffers stay the same across versions: resolve the copies once
                    if (slot, b.index) not in bound:
                        bound[(slot, b.index)] = BoundCopy([weights[n] for n in views], list(views.values()))
                    bound[(slot, b.index)]()
        if ipc:
            torch.cuda.synchronize()
        queue.put((version, time.perf_counter() - t0))
        transport.unpin("bench-receiver")


def relay_receiver(port: int, secret: str, root: str) -> None:
    """Another 'host': receives versions over the relay into its own transport until the sender closes."""
    from moe_grpo.sync.relay import RelayGroup
    from moe_grpo.sync.transport import SharedMemoryTransport
    from whole_relay import RelayReceiver

    receiver = RelayReceiver(SharedMemoryTransport(root), RelayGroup("127.0.0.1", port, 2, secret, timeout_s=600), 1)
    while receiver.receive() is not None:
        pass
    SharedMemoryTransport(root).close()


def measure_relay(transport: object, publish: object, first_version: int, rounds: int = 4) -> float:
    """Median seconds to relay a version to one receiver over loopback TCP (gloo), once both sides' slots are warm."""
    import secrets

    from moe_grpo.learner.spawn import free_port
    from moe_grpo.sync.relay import RelayGroup
    from whole_relay import RelaySender

    port, secret = free_port(), secrets.token_hex(32)
    root = tempfile.mkdtemp(prefix="bench_relay_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    proc = mp.get_context("spawn").Process(target=relay_receiver, args=(port, secret, root))
    proc.start()
    sender = RelaySender(transport, RelayGroup("127.0.0.1", port, 2, secret, timeout_s=600))
    seconds = []
    for v in range(first_version, first_version + rounds):
        publish(v)
        seconds.append(sender.send(v)["relay/seconds"])
    sender.close()
    proc.join(60)
    return statistics.median(seconds[2:])


def bench_spec(args: argparse.Namespace) -> object:
    """conf/model/<--model>.yaml, or a DeepSeek-style model of about --mb megabytes (fp32)."""
    from moe_grpo.config import load_model_spec
    from moe_grpo.models.spec import MoEModelSpec

    if args.model:
        return load_model_spec(args.model)
    per_moe_layer = 32 * 3 * 1024 * 512 * 4
    layers = max(2, int(args.mb * 1e6 / per_moe_layer) + 1) + 1
    return MoEModelSpec(name="bench_sync", architecture="DeepseekForCausalLM", vocab_size=32000, hidden_size=1024,
                        num_layers=layers, first_k_dense=1, num_attention_heads=16, ffn_hidden_size=2048,
                        num_experts=32, moe_ffn_hidden_size=512, top_k=4, num_shared_experts=1)


class RelayLearner:
    """A one-rank learner (a Ray actor on the first node) publishing through the run's relay publisher."""

    def __init__(self, spec: object, layout: object, dtype: str, bucket_bytes: int) -> None:
        import warnings

        warnings.filterwarnings("ignore")
        from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
        from moe_grpo.models.options import MegatronOptions
        from moe_grpo.sync.transports import make_publisher
        from moe_grpo.sync.weight_sync import WeightSync

        self.learner = MegatronLearner(spec, config=LearnerConfig(), options=MegatronOptions(params_dtype=dtype))
        self.sync = WeightSync(self.learner, make_publisher(layout, 0), max_bucket_bytes=bucket_bytes)

    def info(self) -> dict:
        import torch

        return {"bytes": self.sync.plan.total_bytes, "buckets": len(self.sync.plan.buckets),
                "threads": torch.get_num_threads(), "local": self.sync._local}

    def sync_version(self, version: int) -> float:
        return self.sync.sync(version).wait().seconds

    def memcpy_seconds(self, nbytes: int, rounds: int = 3) -> float:
        import torch

        src = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def bench_relay_nodes(args: argparse.Namespace) -> dict:
    """Time versions relayed from a learner on one Ray node to another node's shared memory (see the docstring)."""
    import contextlib
    import sys

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from moe_grpo.orchestrator.sync_hosts import start_sync_hosts, stop_sync_hosts
    from moe_grpo.sync.layout import SyncLayout

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from ray_nodes import local_ray_nodes

    logs = tempfile.mkdtemp(prefix="bench_relay_")
    if args.ray_address:
        cluster = contextlib.nullcontext(args.ray_address)
    else:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")])
        cluster = local_ray_nodes([{"num_cpus": 1, "env": {"PYTHONPATH": path,
                                                          "MOE_GRPO_SYNC_ROOT": f"{shm}/bench_relay_{os.getpid()}_a"}},
                                   {"num_cpus": 1, "env": {"PYTHONPATH": path,
                                                          "MOE_GRPO_SYNC_ROOT": f"{shm}/bench_relay_{os.getpid()}_b"}}],
                                  logs)
    with cluster as address:
        ray.init(address=address, logging_level="ERROR")
        agents: list = []
        try:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            if len(nodes) < 2:
                raise SystemExit(f"--transport relay needs two Ray nodes, {address} has {len(nodes)}")
            learner_node, engine_node = nodes[0], nodes[1]
            layout = SyncLayout("relay", f"run-{os.getpid()}-{int(time.time())}", rank_hosts=(learner_node,),
                                engine_hosts=(engine_node,), timeout_s=600.0)
            layout, agents = start_sync_hosts(layout)
            receiver = agents[layout.hosts.index(engine_node)]
            dtype = args.dtype or "float32"
            actor = ray.remote(RelayLearner).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                learner_node, soft=False)).remote(bench_spec(args), layout, dtype, int(args.bucket_mb * 2**20))
            info = ray.get(actor.info.remote(), timeout=600)
            sync_s, end_to_end = [], []
            for version in range(1, args.rounds + 3):
                t0 = time.perf_counter()
                sync_s.append(ray.get(actor.sync_version.remote(version), timeout=600))
                while version not in ray.get(receiver.received.remote())["versions"].get(0, []):
                    time.sleep(0.005)
                end_to_end.append(time.perf_counter() - t0)
            memcpy = ray.get(actor.memcpy_seconds.remote(info["bytes"]))
        finally:
            stop_sync_hosts(agents)
            ray.shutdown()
    nbytes, t_relay, t_sync = info["bytes"], statistics.median(end_to_end[2:]), statistics.median(sync_s[2:])
    return {"bench": "sync", "transport": "relay", "synced_bytes": nbytes, "buckets": info["buckets"], "dtype": dtype,
            "ray_address": args.ray_address or "two local `ray start` nodes (loopback TCP)",
            "first_relay_seconds": [round(s, 3) for s in end_to_end[:2]],
            "relay_seconds": round(t_relay, 4), "learner_sync_seconds": round(t_sync, 4),
            "memcpy_seconds": round(memcpy, 4), "relay_bytes_per_s": round(nbytes / t_relay),
            "memcpy_bytes_per_s": round(nbytes / memcpy), "relay_vs_memcpy_ratio": round(memcpy / t_relay, 4),
            "threads": info["threads"],
            "note": "relay = from the learner's sync call (its own node's shared memory + packing + gloo broadcast of "
                    "its shards) until the other node's agent reports the version whole in its shared memory; "
                    "memcpy = copy_ of the same bytes in the learner actor"}


def lora_bytes_ratio(model: str, lora: object, dtype: str = "bfloat16") -> dict:
    """Bytes of an adapter-only version over a full-weight version of conf/model/<model>.yaml, from the bucket
    plans alone (sync/plan.py: the same plans a run publishes; nothing is built)."""
    from moe_grpo.config import load_model_spec
    from moe_grpo.sync.plan import plan_buckets

    spec = load_model_spec(model)
    full = plan_buckets(spec, dtype).total_bytes
    adapters = plan_buckets(spec, dtype, lora=lora, base=False).total_bytes
    return {"full_bytes": full, "adapter_bytes": adapters, "ratio": round(adapters / full, 5)}


def timed_syncs(sync: object, transport: object, versions: list[int], merge: object = None) -> tuple[list, list]:
    """Seconds of each `sync.sync(v)`, and (with `merge`, a function of a version's tensors) of the merge of each."""
    sync_s, merge_s = [], []
    for v in versions:
        sync_s.append(sync.sync(v).wait().seconds)
        if merge is not None:
            tensors = transport.read_version(v, timeout_s=600)
            t0 = time.perf_counter()
            merge(tensors)
            merge_s.append(time.perf_counter() - t0)
    return sync_s, merge_s


def bench_lora(args: argparse.Namespace) -> dict:
    """Adapter-only versions against full-weight versions of the same model, in one run (see the docstring)."""
    import torch

    from moe_grpo.config import load_model_spec
    from moe_grpo.models.peft_names import adapter_sites
    from moe_grpo.learner.lora_config import LoraConfig
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.options import MegatronOptions
    from moe_grpo.rollout.lora_merge import MergedWeights, is_adapter_name
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    model = args.model or "deepseek_moe"
    spec = load_model_spec(model)
    lora = LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=tuple(args.lora_targets.split(",")))
    dtype, bucket = args.dtype or "float32", int(args.bucket_mb * 2**20)
    options = MegatronOptions(params_dtype=dtype)
    versions = list(range(1, args.rounds + 3))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None

    full_transport = SharedMemoryTransport(tempfile.mkdtemp(prefix="bench_sync_full_", dir=shm), slots=2)
    full = WeightSync(MegatronLearner(spec, config=LearnerConfig(), options=options), full_transport,
                      max_bucket_bytes=bucket)
    try:
        full_s, _ = timed_syncs(full, full_transport, versions)
    finally:
        full_transport.close()

    learner = MegatronLearner(spec, config=LearnerConfig(), options=options, lora=lora)
    transport = SharedMemoryTransport(tempfile.mkdtemp(prefix="bench_sync_lora_", dir=shm), slots=2)
    sync = WeightSync(learner, transport, max_bucket_bytes=bucket)
    merged = MergedWeights([hf for m in adapter_sites(spec, lora).values() for hf in m.hf])  # as VllmEngine does

    def merge(tensors: dict) -> None:
        if not merged.base:  # the base version: keep W0, as the engine's workers do
            merged.keep({k: v for k, v in tensors.items() if not is_adapter_name(k)})
        for _ in merged.merged({k: v for k, v in tensors.items() if is_adapter_name(k)}, lora.scale):
            pass

    try:
        lora_s, merge_s = timed_syncs(sync, transport, [0] + versions, merge)
    finally:
        transport.close()
    assert sync.adapter_plan is not None
    full_bytes, adapter_bytes = full.plan.total_bytes, sync.adapter_plan.total_bytes
    computed = {m: lora_bytes_ratio(m, LoraConfig(rank=16, alpha=32.0, targets=("attention", "experts")))
                for m in ("qwen3_moe_30b_a3b", "deepseek_v3")}
    t_full, t_lora = statistics.median(full_s[2:]), statistics.median(lora_s[3:])
    return {
        "bench": "sync", "mode": "lora", "model": spec.name, "dtype": dtype, "threads": torch.get_num_threads(),
        "lora_rank": lora.rank, "lora_alpha": lora.alpha, "lora_targets": list(lora.targets),
        "full_version_bytes": full_bytes, "base_version_bytes": sync.plan.total_bytes,
        "adapter_version_bytes": adapter_bytes, "lora_bytes_ratio": round(adapter_bytes / full_bytes, 5),
        "full_sync_seconds": round(t_full, 5), "adapter_sync_seconds": round(t_lora, 5),
        "base_sync_seconds": round(lora_s[0], 4), "adapter_vs_full_sync_seconds_ratio": round(t_lora / t_full, 4),
        "engine_merge_seconds": round(statistics.median(merge_s[3:]), 5),
        "engine_w0_copy_bytes": merged.nbytes,
        "lora_bytes_ratio_qwen3_30b_a3b": computed["qwen3_moe_30b_a3b"]["ratio"],
        "lora_bytes_ratio_deepseek_v3": computed["deepseek_v3"]["ratio"],
        "computed": {m: {**c, "dtype": "bfloat16", "lora_rank": 16, "lora_targets": ["attention", "experts"]}
                     for m, c in computed.items()},
        "note": "full = versions of a learner without adapters; adapter = versions after the base version of a "
                "learner with adapters (the base version, sent once, carries the base weights and the adapters); "
                "sync seconds are medians after warm-up, one learner process, CPU, shared-memory transport; "
                "engine_merge = W0 + (alpha/r) B A of every adapted weight in one process (the arithmetic of "
                "sync.lora_apply=merge), without vLLM's reload; computed ratios come from the bucket plans "
                "(rank 16 on attention and routed experts, bf16)",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=600.0, help="model size to sync, in MB (fp32)")
    ap.add_argument("--rounds", type=int, default=5, help="timed syncs after the two warm-up syncs")
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="bucket bound, MB")
    ap.add_argument("--relay", action="store_true", help="also time the gloo relay to another process (loopback TCP)")
    ap.add_argument("--transport", choices=("shm", "cuda_ipc", "relay"), default="shm",
                    help="shared memory on the host (default), CUDA IPC buffers on the learner's GPU, or the relay "
                         "between two Ray nodes")
    ap.add_argument("--ray-address", default=None,
                    help="--transport relay: a Ray cluster of at least two nodes (default: start two here)")
    ap.add_argument("--model", default=None, help="conf/model/<name>.yaml instead of the --mb-sized model")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="weights' dtype (default: bfloat16 with cuda_ipc, float32 otherwise)")
    ap.add_argument("--lora", action="store_true",
                    help="adapter-only versions against full-weight versions of the same model (see the docstring)")
    ap.add_argument("--lora-rank", type=int, default=16, help="--lora: adapter rank (alpha = 2 * rank)")
    ap.add_argument("--lora-targets", default="attention,experts",
                    help="--lora: comma-separated lora.targets (attention, dense_mlp, experts, shared_experts)")
    ap.add_argument("--delta", action="store_true",
                    help="delta versions against full versions from real optimizer steps (tools/bench_sync_delta.py)")
    ap.add_argument("--delta-steps", type=int, default=5, help="--delta: optimizer steps per model and rate")
    ap.add_argument("--delta-skip-large", action="store_true",
                    help="--delta: leave out the 315 MB 'large' config (large_* keys)")
    ap.add_argument("--delta-models", default="tiny,128e,large",
                    help="--delta: comma-separated configs to run (tiny, 128e, large; a quicker subset)")
    ap.add_argument("--delta-profile", default=None, metavar="DIR",
                    help="--delta: cProfile each publish, relay receiver and engine-side load into DIR/*.prof")
    ap.add_argument("--delta-stages", action="store_true",
                    help="--delta: wall-clock seconds of each stage of a publish and a relay receiver, per version")
    args = ap.parse_args()
    if args.delta:
        import bench_sync_delta  # tools/ is sys.path[0] when this file runs as a script

        if args.delta_stages:  # the learner ranks read it too
            os.environ[bench_sync_delta.STAGES_ENV] = "1"
            bench_sync_delta.install_stage_timers()

        if args.delta_profile:  # read by the learner ranks too (spawned processes inherit the environment)
            os.makedirs(args.delta_profile, exist_ok=True)
            os.environ[bench_sync_delta.PROFILE_ENV] = os.path.abspath(args.delta_profile)

        print(json.dumps(bench_sync_delta.run(args)))
        return
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.options import MegatronOptions
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    if args.lora:
        if args.transport != "shm":
            raise SystemExit(f"--lora with --transport {args.transport}: adapter-only versions are built for the "
                             "shared-memory transport only (sync.transport=shm)")
        print(json.dumps(bench_lora(args)))
        return
    if args.transport == "relay":
        print(json.dumps(bench_relay_nodes(args)))
        return

    ipc = args.transport == "cuda_ipc"
    if ipc and not torch.cuda.is_available():
        raise SystemExit("--transport cuda_ipc needs a CUDA GPU (torch.cuda.is_available() is False)")
    dtype = args.dtype or ("bfloat16" if ipc else "float32")
    spec = bench_spec(args)
    learner = MegatronLearner(spec, config=LearnerConfig(), options=MegatronOptions(params_dtype=dtype))
    root = tempfile.mkdtemp(prefix="bench_sync_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    if ipc:
        from moe_grpo.sync.cuda_ipc import CudaIpcTransport

        transport: SharedMemoryTransport = CudaIpcTransport(root, slots=2)
    else:
        transport = SharedMemoryTransport(root, slots=2)
    sync = WeightSync(learner, transport, max_bucket_bytes=int(args.bucket_mb * 2**20))
    versions = list(range(1, args.rounds + 3))
    queue: mp.Queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=receiver, args=(root, versions, queue, ipc))
    proc.start()
    sync_s, deliver_s = [], []
    try:
        for v in versions:
            sync_s.append(sync.sync(v).wait().seconds)
            got_v, seconds = queue.get(timeout=600)
            assert got_v == v
            deliver_s.append(seconds)
    finally:
        proc.join(60)
    try:
        t_relay = measure_relay(transport, lambda v: sync.sync(v).wait(), versions[-1] + 1) if args.relay else None
    finally:
        transport.close()
    nbytes = sync.plan.total_bytes

    device = "cuda" if ipc else "cpu"
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    copies = []
    for _ in range(5 if ipc else 3):
        if ipc:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        dst.copy_(src)
        if ipc:
            torch.cuda.synchronize()
        copies.append(time.perf_counter() - t1)
    t_copy = statistics.median(copies)
    t_sync, t_deliver = statistics.median(sync_s[2:]), statistics.median(deliver_s[2:])
    t_copies = None
    if ipc:  # the learner's device copies alone (every bucket's fused copies), without the transport's bookkeeping
        last_slot = sync._pending.wait().slot if sync._pending else None
        bound = [b for (slot, _), (_, b) in sync._bound.items() if slot == last_slot]  # one version's buckets
        runs = []
        for _ in range(5):
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            for copy in bound:
                copy()
            torch.cuda.synchronize()
            runs.append(time.perf_counter() - t1)
        t_copies = statistics.median(runs)
    rate, memcpy = nbytes / t_sync, nbytes / t_copy
    v3_bytes = 671.0e9 * 2  # DeepSeek-V3 parameters (published 671B, our meta-device count 671.03B) in bf16
    print(json.dumps({
        "bench": "sync", "transport": args.transport, "model": spec.name, "dtype": dtype, "synced_bytes": nbytes, "layers": spec.num_layers, "buckets": len(sync.plan.buckets),
        "threads": torch.get_num_threads(),
        "first_sync_seconds": [round(s, 3) for s in sync_s[:2]], "sync_seconds": round(t_sync, 4),
        **({"sync_copies_only_seconds": round(t_copies, 4),
            "copies_only_vs_memcpy_ratio": round(t_copy / t_copies, 4)} if t_copies else {}),
        "deliver_seconds": round(t_deliver, 4), "memcpy_seconds": round(t_copy, 4),
        "sync_bytes_per_s": round(rate), "memcpy_bytes_per_s": round(memcpy),
        "sync_vs_memcpy_ratio": round(rate / memcpy, 4),
        "sync_and_deliver_vs_memcpy_ratio": round(nbytes / (t_sync + t_deliver) / memcpy, 4),
        "projected_deepseek_v3_seconds": round(v3_bytes / rate, 1),
        **({"relay_seconds": round(t_relay, 3), "relay_bytes_per_s": round(nbytes / t_relay)} if t_relay else {}),
        "device": torch.cuda.get_device_name() if ipc else "cpu",
        "note": ("one learner process on the GPU, CUDA-IPC transport (buffers in the learner's device memory); "
                 "deliver = a second process opening them by IPC handle and copying every tensor device to device; "
                 "memcpy = a device-to-device copy_ of the same bytes" if ipc else
                 "one learner process, CPU, shared-memory transport; deliver = a second process copying every "
                 "tensor out of the mapped buckets"),
    }))


if __name__ == "__main__":
    main()
