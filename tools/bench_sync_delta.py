"""`tools/bench_sync.py --delta`: delta versions against full versions, from real optimizer steps, in one run.

For each model (the tiny default, conf/model/deepseek_moe.yaml, and the 128-expert top-8 config,
conf/model/deepseek_moe_128e.yaml at its own 4 layers: small enough for 2 CPU cores) and each learning rate
(1e-6, 1e-5, 1e-4), and for a "large" config (the 128-expert model widened to a 315 MB bf16 version, `LARGE`,
at 1e-6 only: a second one ran the 24 GiB machine out of memory; `--delta-skip-large` leaves it out), a 2-rank learner (EP=2: MegatronLearner, fp32 master weights, Adam, lr_decay constant, seed 5)
takes `--delta-steps` real `train_step`s on synthetic sequences (tests/learner/layout_scenarios.py's
`make_sequences`, built the same way here). Version 1 is its initial weights; after each step it publishes the
version in bf16 four times:

- shared memory (one host): through a delta WeightSync and a full WeightSync (separate roots);
- the relay (sync/shard_relay.py) between two simulated hosts, as tests/sync/test_shard_relay.py does: two
  shared-memory roots (B: rank 0's, A: rank 1's and the engine's), ShardReceiver threads in this process, a
  RunStoreServer; each rank writes its own host's buffers and relays its shards (or, for a delta version, its
  encoded changes) to the other host over loopback TCP. Again once with delta versions and once whole.

Seconds per version: from a barrier before the publish until every rank's `wait()` returned and (relay) host A's
buffers hold the version whole (`latest_complete()`), i.e. the receiving side's write of a full version, or its
apply of the changes, is inside the relay figure. On the shared-memory host rank 0 also times the engine side:
loading the full version into its own tensors (every tensor copied) against reloading from the delta version only
the tensors `changed_since` names (`delta_load_seconds_ratio_*`); the loaded tensors are compared bit for bit too.

Exactness: sha256 of every tensor's bits in the delta transport's version against the full shared-memory version
(rank 0 checks shared memory, rank 1 checks host A of the relay); `delta_tensor_mismatches` counts the tensors that
differ over every model, rate, version and transport.

Projection: for Qwen3-30B-A3B and DeepSeek-V3 (conf/model/*.yaml, bf16 bucket plans from sync/plan.py, nothing
built), the bytes of a delta version at each measured changed fraction, in the smallest of the encodings the
sync uses per bucket (indices: 4 + 2 bytes per change; bitmap: 1 bit per element + 2 bytes per change; varint
gaps + 1-byte varint steps), and its
seconds over a 25 GB/s link per engine host (bytes / 25e9: the link is the bottleneck, encode/apply not counted),
beside a full version's; verl's published figures go beside them.

`--delta-profile DIR` also writes a cProfile of every publish after the first (per model, rate, way and rank),
of every relay receiver and of the engine-side loads into DIR/*.prof (the breakdown in docs/results.md).
`--delta-stages` instead times each stage of a publish and of a relay receiver by the wall clock, per version, with
no profiler (`STAGES`; medians on stderr and under `stages_ms` on the last line). `--delta-models` runs a subset
(tiny, 128e, large).

Progress goes to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import cProfile
import contextlib
import gc
import hashlib
import json
import math
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

LEARNING_RATES = (1e-6, 1e-5, 1e-4)
LARGE = {"hidden_size": 512, "head_dim": 128, "moe_ffn_hidden_size": 256}
"""The "large" config: the 128-expert model widened so one bf16 version is 315 MB (151 M parameters, nearly all
routed experts): large enough that copying and sending the bytes, not per-version overheads, dominates a full
version on this machine."""
MODELS = (("tiny", "deepseek_moe", {}, LEARNING_RATES), ("128e", "deepseek_moe_128e", {}, LEARNING_RATES),
          ("large", "deepseek_moe_128e", LARGE, (1e-6,)))
"""(key, conf/model name, ModelSpec overrides, learning rates). Key prefixes on the last line: none for 128e
(the issue's required keys), `tiny_`, `large_`."""
PREFIX = {"128e": "", "tiny": "tiny_", "large": "large_"}
LINK_BYTES_PER_S = 25e9
"""The assumed link per engine host for the projection."""
VERL = {"qwen3_30b_a3b_full_s": 32.2, "qwen3_30b_a3b_delta_s": 7.1, "qwen3_235b_full_s": [246, 266],
        "qwen3_235b_delta_s": [11.4, 14.9], "changed_fraction_per_step": [0.0002, 0.0005]}
"""verl's published delta-sync figures (issue 33)."""


STEP_BYTES = 1
"""Bytes per varint step assumed in projections: an optimizer step at these learning rates moves a changed bf16
value by fewer than 64 units in its last place (the measured delta bytes above carry the real steps)."""


PROFILE_ENV = "BENCH_SYNC_DELTA_PROFILE"
"""A directory: profile (cProfile) every publish after the first version, per rank, model, rate and way, every
relay receiver and the engine-side loads, into <dir>/<what>.prof (`--delta-profile`)."""


@contextlib.contextmanager
def profiled(what: str):
    """cProfile of the block into $BENCH_SYNC_DELTA_PROFILE/<what>.prof (added up over calls); nothing without it."""
    root = os.environ.get(PROFILE_ENV)
    if not root:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        path = os.path.join(root, f"{what}.prof")
        import pstats

        stats = pstats.Stats(prof)
        if os.path.exists(path):
            stats.add(path)
        stats.dump_stats(path)


STAGES_ENV = "BENCH_SYNC_DELTA_STAGES"
"""Set (`--delta-stages`): time each stage of a publish and of a relay receiver, wall clock, per version (the
functions below wrapped in place; no profiler, so the figures are the unprofiled ones)."""

STAGES = (("moe_grpo.sync.weight_sync", "WeightSync", "_run", "learner: whole publish"),
          ("moe_grpo.sync.delta", "DeltaTracker", "_cast", "learner: cast to bf16"),
          ("moe_grpo.sync.delta", "DeltaTracker", "_changed", "learner: compare + extract indices"),
          ("moe_grpo.sync.delta", None, "_changes", "learner: new values + steps"),
          ("moe_grpo.sync.weight_sync", None, "encoded_bytes", "learner: sizes of the encodings"),
          ("moe_grpo.sync.weight_sync", None, "encode", "learner: encode"),
          ("moe_grpo.sync.shard_relay", "ShardSender", "begin", "learner: send header (+ changes)"),
          ("moe_grpo.sync.shard_relay", "ShardSender", "send_bucket", "learner: pack + send a bucket"),
          ("moe_grpo.sync.weight_sync", "WeightSync", "_write", "learner: write own slot (+ send buckets)"),
          ("moe_grpo.sync.delta", "DeltaTracker", "commit", "learner: commit"),
          ("moe_grpo.sync.shard_relay", "ShardReceiver", "receive", "receiver: whole receive (with the wait)"),
          ("moe_grpo.sync.shard_relay", "ShardReceiver", "_receive_changes", "receiver: receive + decode changes"),
          ("moe_grpo.sync.shard_relay", None, "decode", "receiver: decode"),
          ("moe_grpo.sync.shard_relay", "ShardReceiver", "_apply_changes", "receiver: apply changes to slot"),
          ("moe_grpo.sync.shard_relay", "ShardReceiver", "_copy_own", "receiver: copy own shards (no chain)"),
          ("moe_grpo.sync.shard_relay", "ShardReceiver", "_receive_whole", "receiver: receive + write whole"))

_stage_at = threading.local()
"""This thread's (tag, version index) that stage times go to."""
STAGE_TIMES: dict[tuple[str, int, str], float] = {}
"""(tag, version index, stage) -> seconds (summed over calls)."""


def stage_tag(tag: str, version: int) -> None:
    _stage_at.key = (tag, version)


def install_stage_timers() -> None:
    """Wrap `STAGES`' functions so each call's wall-clock seconds add to this thread's (tag, version)."""
    import functools
    import importlib

    for module, cls, attr, label in STAGES:
        owner = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
        fn = getattr(owner, attr)
        if getattr(fn, "_stage_timed", False):
            continue

        def timed(*a: Any, _fn: Any = fn, _label: str = label, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                key = getattr(_stage_at, "key", None)
                if key is not None:
                    k = (key[0], key[1], _label)
                    STAGE_TIMES[k] = STAGE_TIMES.get(k, 0.0) + time.perf_counter() - t0

        functools.update_wrapper(timed, fn)
        timed._stage_timed = True  # type: ignore[attr-defined]
        setattr(owner, attr, timed)


def stage_medians(times: dict[tuple[str, int, str], float]) -> dict[str, dict[str, float]]:
    """Per tag and stage: the median over versions after the first (index >= 2) of the per-version seconds, in ms
    (a version where a stage did not run counts as 0)."""
    by: dict[str, dict[int, dict[str, float]]] = {}
    for (tag, version, stage), s in times.items():
        by.setdefault(tag, {}).setdefault(version, {})[stage] = s
    out = {}
    for tag, versions in sorted(by.items()):
        later = [v for k, v in versions.items() if k >= 2]
        if not tag or not later:
            continue
        stages = {st for v in later for st in v}
        out[tag] = {st: round(statistics.median(v.get(st, 0.0) for v in later) * 1e3, 2)
                    for st in sorted(stages, key=lambda x: [s[3] for s in STAGES].index(x))}
    return out


def log(msg: str) -> None:
    print(f"[bench_sync --delta {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _varint_len(value: int) -> int:
    """Bytes of `value` as a LEB128 varint (what delta.py's varint encoding spends on a gap or a step)."""
    return max(1, math.ceil(max(int(value), 1).bit_length() / 7))


def delta_bytes(elements: int, changed_fraction: float, item: int = 2, position: int = 4,
                step_bytes: int | None = None) -> int:
    """Bytes of a delta version of `elements` values at `changed_fraction`, in the smallest encoding
    (delta.encoded_bucket_bytes: indices `position + item` bytes per change; a bitmap of 1 bit per element +
    `item` bytes per change; with `step_bytes`, varint gaps (the mean gap's length) + varint steps of
    `step_bytes` each), taken over the whole version as one bucket (headers aside)."""
    changes = changed_fraction * elements
    sizes = [changes * (position + item), math.ceil(elements / 8) + changes * item]
    if step_bytes is not None and changes:
        sizes.append(changes * (_varint_len(round(1 / changed_fraction)) + step_bytes))
    return int(min(sizes))


def project(model: str, changed_fraction: float, link_bytes_per_s: float = LINK_BYTES_PER_S) -> dict[str, float]:
    """Bytes and seconds per version of conf/model/<model>.yaml in bf16, full and as a delta at `changed_fraction`,
    over one link of `link_bytes_per_s` per engine host."""
    from moe_grpo.config import load_model_spec
    from moe_grpo.sync.plan import plan_buckets

    full = plan_buckets(load_model_spec(model), "bfloat16").total_bytes
    delta = delta_bytes(full // 2, changed_fraction, step_bytes=STEP_BYTES)
    return {"full_bytes": full, "delta_bytes": delta, "full_seconds": full / link_bytes_per_s,
            "delta_seconds": delta / link_bytes_per_s}


def _digests(tensors: dict) -> dict[str, str]:
    import torch

    return {n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def _sequences(spec: Any, n: int, seed: int) -> list:
    """tests/learner/layout_scenarios.py's make_sequences (tests/ is not a package)."""
    import numpy as np

    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.routing.trace import RoutingTrace

    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n):
        length = int(rng.integers(6, 14))
        tokens = rng.integers(0, spec.vocab_size, size=length)
        ids = np.stack([np.stack([rng.permutation(spec.num_experts)[: spec.top_k] for _ in range(spec.num_moe_layers)])
                        for _ in range(length - 1)])
        seqs.append(LearnerSequence(tokens, prompt_len=3, routing=RoutingTrace.from_array(ids, spec.num_experts),
                                    advantage=float(rng.normal())))
    return seqs


def load_into(transport: Any, version: int, held: dict, names: set[str] | None) -> float:
    """The engine side's load of `version` into its own tensors `held` (filled on first use): every tensor, or
    only `names` (what `changed_since` says a delta version changed, as engines reload it). Returns seconds."""
    from moe_grpo.sync.transport import bucket_path, read_bucket

    t0 = time.perf_counter()
    slot, plan = transport.wait_complete(version, 30)
    for b in plan.buckets:
        with read_bucket(bucket_path(slot, b.index), b, plan.torch_dtype) as views:
            for name, view in views.items():
                if name not in held:
                    held[name] = view.clone()
                elif names is None or name in names:
                    held[name].copy_(view)
    return time.perf_counter() - t0


def rank_work(configs: list[dict], shm_root: str, host_roots: list[str], steps: int) -> list[dict]:
    """Inside each learner rank: for every config, train and publish each version four ways; returns per config
    and version this rank's reports, seconds and mismatching tensor names."""
    import torch

    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.learner.parallel import ParallelLayout
    from moe_grpo.sync.config import ROOT_ENV
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.transports import make_publisher
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    rank = int(os.environ["RANK"])
    os.environ[ROOT_ENV] = host_roots[rank]  # this rank's "host"
    if os.environ.get(STAGES_ENV):
        install_stage_timers()
    out = []
    for c in configs:
        spec = load_model_spec(c["model"])
        if c["overrides"]:
            spec = spec.replace(**c["overrides"])
        learner = MegatronLearner(spec, ParallelLayout(1, 2, 1),
                                  LearnerConfig(seed=5, lr=c["lr"], lr_decay="constant"))
        tag = f"{c['key']}_{c['lr']:g}"
        shm_full = SharedMemoryTransport(f"{shm_root}/{tag}/full")
        shm_delta = SharedMemoryTransport(f"{shm_root}/{tag}/delta")
        relay_full, relay_delta = make_publisher(c["layout_full"], rank), make_publisher(c["layout_delta"], rank)
        # max_fraction 0.9: a version is sent as changes unless nearly all of it changed (the measurement)
        opts = DeltaOptions(max_fraction=0.9)
        syncs = {"shm_full": WeightSync(learner, shm_full, dtype="bfloat16"),
                 "shm_delta": WeightSync(learner, shm_delta, dtype="bfloat16", delta=opts),
                 "relay_full": WeightSync(learner, relay_full, dtype="bfloat16"),
                 "relay_delta": WeightSync(learner, relay_delta, dtype="bfloat16", delta=opts)}
        per_version = []
        held_full: dict = {}
        held_delta: dict = {}
        for version in range(1, steps + 2):
            if version > 1:
                learner.train_step(_sequences(spec, 4, version), replay=True)
            row: dict[str, Any] = {"version": version}
            for name, sync in syncs.items():
                torch.distributed.barrier()
                stage_tag(f"{tag}_{name}_r{rank}", version)
                t0 = time.perf_counter()
                with profiled(f"{tag}_{name}_r{rank}") if version > 1 else contextlib.nullcontext():
                    report = sync.sync(version).wait()
                if name.startswith("relay") and rank == 1:  # host A: whole once both ranks' parts landed
                    local = sync.transport.local
                    deadline = time.monotonic() + 120
                    while (local.latest_complete() or 0) < version:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{tag} {name}: host A never held version {version} whole")
                        time.sleep(0.0005)
                torch.distributed.barrier()
                row[name] = {"seconds": time.perf_counter() - t0, "metrics": report.metrics()}
            want = _digests(shm_full.read_version(version, 30))
            got = _digests(shm_delta.read_version(version, 30) if rank == 0
                           else syncs["relay_delta"].transport.local.read_version(version, 30))
            row["mismatched"] = sorted(n for n in want if got.get(n) != want[n])
            if rank == 0:  # the engine side on the shared-memory host: full load vs reload of what changed
                changed = shm_delta.changed_since(version - 1, version) if version > 1 else None
                with profiled(f"{tag}_load_full") if version > 1 else contextlib.nullcontext():
                    row["load_full_seconds"] = load_into(shm_full, version, held_full, None)
                with profiled(f"{tag}_load_delta") if version > 1 else contextlib.nullcontext():
                    row["load_delta_seconds"] = load_into(shm_delta, version, held_delta, changed)
                row["load_delta_tensors"] = len(changed) if changed is not None else len(want)
                if version > 1:
                    row["mismatched"] += sorted(n for n in held_full
                                                if not torch.equal(held_full[n].view(torch.int16),
                                                                   held_delta[n].view(torch.int16)))
            row["tensors"] = len(want)
            torch.distributed.barrier()
            per_version.append(row)
        for p in (relay_full, relay_delta):
            if hasattr(p, "close_relay"):
                p.close_relay()
        torch.distributed.barrier()
        del syncs, learner, held_full, held_delta
        if rank == 0:  # this config's shared-memory versions (the large one's take GBs); the relay's stay
            shutil.rmtree(f"{shm_root}/{tag}", ignore_errors=True)
        gc.collect()
        stage_tag("", -1)
        out.append({"key": c["key"], "lr": c["lr"], "versions": per_version,
                    "stages": {"|".join(map(str, k)): v for k, v in STAGE_TIMES.items() if k[0].startswith(tag + "_")}})
        log(f"rank {rank}: {tag} done")
    return out


def _receive(transport: Any, layout: Any, rank: int, host: str, stop: threading.Event) -> None:
    from moe_grpo.sync.transports import make_shard_receiver

    receiver = make_shard_receiver(transport, layout, rank, host)
    if receiver.connect(stop):
        with profiled(f"receiver_{layout.run_name}_r{rank}_{host}"):
            version = 1
            while True:
                stage_tag(f"receiver_{layout.run_name}_r{rank}_{host}", version)
                if receiver.receive() is None:
                    break
                version += 1


def summarize(results: list[list[dict]]) -> dict[str, Any]:
    """Per model and rate: medians over versions after the first of the combined (both ranks') figures."""
    from moe_grpo.sync.sync_metrics import combine_sync_metrics

    rows, mismatches = {}, 0
    for c, config in enumerate(results[0]):
        ranks = [r[c]["versions"] for r in results]
        table = []
        for v, versions in enumerate(zip(*ranks)):
            mismatches += sum(len(x["mismatched"]) for x in versions)
            if v == 0:
                continue
            comb = {k: combine_sync_metrics([x[k]["metrics"] for x in versions])
                    for k in ("shm_full", "shm_delta", "relay_full", "relay_delta")}
            secs = {k: max(x[k]["seconds"] for x in versions) for k in comb}
            full = comb["shm_full"]["sync/bytes"]
            table.append({"changed_fraction": comb["shm_delta"]["sync/changed_fraction"],
                          "delta_bytes_ratio": comb["shm_delta"]["sync/bytes"] / full,
                          "relay_bytes_ratio": comb["relay_delta"]["sync/bytes"] / comb["relay_full"]["sync/bytes"],
                          "delta_seconds_ratio_shm": secs["shm_delta"] / secs["shm_full"],
                          "delta_seconds_ratio_relay": secs["relay_delta"] / secs["relay_full"],
                          "is_delta": comb["shm_delta"]["sync/delta"],
                          "experts_unchanged": comb["shm_delta"]["sync/experts_unchanged"],
                          "load_seconds_ratio": versions[0]["load_delta_seconds"] / versions[0]["load_full_seconds"],
                          "load_delta_tensors_fraction": versions[0]["load_delta_tensors"] / versions[0]["tensors"],
                          "full_bytes": full, "delta_bytes": comb["shm_delta"]["sync/bytes"],
                          **{f"seconds_{k}": s for k, s in secs.items()}})
        med = {k: statistics.median(t[k] for t in table) for k in table[0]}
        rows[f"{config['key']}_lr{config['lr']:.0e}".replace("e-0", "e-")] = med
    return {"rows": rows, "mismatches": mismatches}


def run(args: Any) -> dict[str, Any]:
    """The whole benchmark; returns the last line's JSON object."""
    from moe_grpo.learner.rendezvous import RunStoreServer
    from moe_grpo.learner.spawn import run_distributed
    from moe_grpo.sync.layout import SyncLayout
    from moe_grpo.sync.transport import SharedMemoryTransport

    steps = getattr(args, "delta_steps", 5)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_delta_") as tmp:
        roots = {"B": f"{tmp}/hostB", "A": f"{tmp}/hostA"}
        configs, servers, threads = [], [], []
        stop = threading.Event()
        wanted = set(getattr(args, "delta_models", "tiny,128e,large").split(","))
        if getattr(args, "delta_skip_large", False):
            wanted.discard("large")
        models = [m for m in MODELS if m[0] in wanted]
        for key, model, overrides, rates in models:
            for lr in rates:
                config = {"key": key, "model": model, "overrides": overrides, "lr": lr}
                for kind in ("full", "delta"):
                    secret = secrets.token_hex(32)
                    server = RunStoreServer("127.0.0.1", 0, secret)
                    servers.append(server)
                    layout = SyncLayout("relay", f"run-{key}-{lr:g}-{kind}", rank_hosts=("B", "A"),
                                        engine_hosts=("A",), store=("127.0.0.1", server.port), secret=secret,
                                        timeout_s=120)
                    hosts = {h: SharedMemoryTransport(f"{roots[h]}/{layout.run_name}") for h in roots}
                    hosts["A"].pin("engine-a", {})  # an engine on host A that pins nothing yet
                    threads += [threading.Thread(target=_receive, args=(hosts[h], layout, r, h, stop), daemon=True)
                                for h in roots for r in layout.streams_into(h)]
                    config[f"layout_{kind}"] = layout
                configs.append(config)
        for t in threads:
            t.start()
        log(f"{len(configs)} configs x {steps + 1} versions, 2 learner ranks (EP=2), relay hosts B and A")
        try:
            results = run_distributed(rank_work, 2, configs, f"{tmp}/shm", [roots["B"], roots["A"]], steps,
                                      timeout_s=900)
        finally:
            stop.set()
            for t in threads:
                t.join(10)
            for s in servers:
                s.close()
    summary = summarize(results)
    if getattr(args, "delta_stages", False):
        times = dict(STAGE_TIMES)
        for r in results:
            for c in r:
                for k, v in c.get("stages", {}).items():
                    tag, version, stage = k.split("|")
                    times[(tag, int(version), stage)] = v
        summary["stages"] = stage_medians(times)
        for tag, stages in summary["stages"].items():
            log(f"stages {tag}: " + ", ".join(f"{k} {v}" for k, v in stages.items()))
    for name, row in summary["rows"].items():
        log(f"{name}: changed {row['changed_fraction']:.3e}, bytes ratio {row['delta_bytes_ratio']:.4f} "
            f"(relay {row['relay_bytes_ratio']:.4f}), seconds ratio shm {row['delta_seconds_ratio_shm']:.3f} "
            f"relay {row['delta_seconds_ratio_relay']:.3f}, engine load {row['load_seconds_ratio']:.3f} "
            f"({row['load_delta_tensors_fraction']:.2f} of tensors); full {row['seconds_shm_full']*1e3:.1f} ms / "
            f"relay full {row['seconds_relay_full']*1e3:.1f} ms")
    out: dict[str, Any] = {}
    for name, row in summary["rows"].items():
        key, lr = name.split("_lr")
        prefix = PREFIX[key]
        out[f"{prefix}delta_bytes_ratio_lr{lr}"] = round(row["delta_bytes_ratio"], 6)
        out[f"{prefix}delta_seconds_ratio_relay_lr{lr}"] = round(row["delta_seconds_ratio_relay"], 4)
        out[f"{prefix}delta_seconds_ratio_shm_lr{lr}"] = round(row["delta_seconds_ratio_shm"], 4)
        # issue 33's goals: wire bytes <= changed fraction x full + 1% of full; relay seconds ratio within 1.5x of
        # the bytes ratio
        out[f"{prefix}goal_bytes_met_lr{lr}"] = row["delta_bytes_ratio"] <= row["changed_fraction"] + 0.01
        out[f"{prefix}goal_relay_seconds_met_lr{lr}"] = \
            row["delta_seconds_ratio_relay"] <= 1.5 * row["relay_bytes_ratio"]
        out[f"{prefix}delta_load_seconds_ratio_lr{lr}"] = round(row["load_seconds_ratio"], 4)
        out[f"{prefix}changed_fraction_lr{lr}"] = round(row["changed_fraction"], 8)
        out[f"{prefix}full_bytes"] = int(row["full_bytes"])
        for way in ("shm", "relay"):
            out[f"{prefix}full_seconds_{way}_lr{lr}"] = round(row[f"seconds_{way}_full"], 5)
            out[f"{prefix}delta_seconds_{way}_lr{lr}"] = round(row[f"seconds_{way}_delta"], 5)
    out["delta_tensor_mismatches"] = summary["mismatches"]
    for model, short in (("qwen3_moe_30b_a3b", "qwen3_30b_a3b"), ("deepseek_v3", "deepseek_v3")):
        for name, row in summary["rows"].items():
            if name.startswith("128e"):
                p = project(model, row["changed_fraction"])
                lr = name.split("_lr")[1]
                out[f"projected_{short}_full_bytes"] = p["full_bytes"]
                out[f"projected_{short}_full_seconds"] = round(p["full_seconds"], 3)
                out[f"projected_{short}_delta_bytes_lr{lr}"] = p["delta_bytes"]
                out[f"projected_{short}_delta_seconds_lr{lr}"] = round(p["delta_seconds"], 4)
        for fraction in VERL["changed_fraction_per_step"]:  # at verl's measured fraction of a real 235B MoE
            p = project(model, fraction)
            out[f"projected_{short}_delta_seconds_at_{fraction:g}"] = round(p["delta_seconds"], 4)
    out["projection_link_bytes_per_s"] = LINK_BYTES_PER_S
    out["verl"] = VERL
    out["models"] = {"tiny": "conf/model/deepseek_moe.yaml", "128e": "conf/model/deepseek_moe_128e.yaml (4 layers)",
                     "large": f"conf/model/deepseek_moe_128e.yaml with {LARGE}"}
    out["relay"] = "simulated two hosts (two shm roots, ShardReceiver threads, loopback TCP)"
    if "stages" in summary:
        out["stages_ms"] = summary["stages"]
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out
