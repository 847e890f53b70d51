"""Delta versions against full versions through `cuda_ipc`, on one CUDA GPU, from real optimizer steps (issue 33).

For each learning rate (`--lrs`, default 1e-6, 1e-5, 1e-4) a float32 learner on the GPU (world size 1, Adam,
lr_decay constant, seed 5; default model: the 128-expert top-8 config widened as `tools/bench_sync_delta.py`'s
"large", 151 M parameters, a 315 MB bf16 version) takes `--steps` real `train_step`s on synthetic sequences.
Version 1 is its initial weights; each version is published in bf16 twice, into two `CudaIpcTransport` roots (two
slots each, buffers in this process's GPU memory): with `sync.delta` (max_fraction 0.9, as the CPU benchmark) and
whole. Seconds per version: `sync(version).wait()` with the GPU synchronised before it (the step's kernels are not
counted); the order of the two alternates from version to version. A delta version's seconds include finding the
changes (cast, bitwise compare and `nonzero`, gather, steps, the encodings' sizes: torch ops on the GPU, two small
host reads) and applying them to the slot's device buffers (`index_copy_`); a full version's are the device copies.

`--cpu` (no GPU needed): the same on CPU, the learner on CPU and `SharedMemoryTransport` roots standing in for
`cuda_ipc`, the delta side on the device path's torch ops run on CPU tensors (`DeltaOptions.torch_ops`), beside a
third way, `delta_numpy`, the CPU transports' numpy path: a check that the device path is exact and its time sane
(on a CPU, not a measure of a GPU).

Exactness: after each version, both versions read back from the device buffers (this process owns them), sha256
per tensor; `delta_tensor_mismatches` counts tensors whose hash differs (over every rate and version).

    python3 tools/bench_sync_ipc_delta.py [--model deepseek_moe_128e] [--no-large] [--lrs 1e-6,1e-5] [--steps 3] [--cpu]
                                          [--profile]

Progress on stderr; one JSON line per rate on stdout as it finishes, then a last line with every rate's medians
(versions after the first): `changed_fraction_lr1e-6`, `delta_bytes_ratio_lr1e-6`,
`delta_seconds_ratio_ipc_lr1e-6` (delta / full seconds), `full_ms_lr1e-6`, `delta_ms_lr1e-6`, the same for the other
rates, and `delta_tensor_mismatches`.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import sys
import tempfile
import time
from typing import Any

from bench_sync_delta import LARGE, _sequences  # tools/ is sys.path[0] when this file runs as a script


def log(msg: str) -> None:
    print(f"[bench_sync_ipc_delta {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _digests(tensors: dict) -> dict[str, str]:
    import torch

    return {n: hashlib.sha256(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for n, t in tensors.items()}


def _profiled(way: str, version: int, call: Any) -> Any:
    """`call()` under torch.profiler; its busiest ops (self CPU time, with the device's time beside) on stderr."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        out = call()
    log(f"profile of the {way} version {version}:\n"
        + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48))
    return out


def one_rate(spec: Any, lr: float, steps: int, root: str, cpu: bool = False, profile: bool = False) -> dict[str, Any]:
    """Train and publish `steps` + 1 versions at `lr` both ways (`cpu`: three, see the module's docstring);
    returns the per-version figures. `profile`: the last version of each way under torch.profiler (stderr; its
    seconds then include the profiler's cost)."""
    import torch

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.sync.sync_metrics import combine_sync_metrics
    from moe_grpo.sync.weight_sync import DeltaOptions, WeightSync

    if cpu:
        from moe_grpo.sync.transport import SharedMemoryTransport as Transport
    else:
        from moe_grpo.sync.cuda_ipc import CudaIpcTransport as Transport  # type: ignore[assignment]
    t0 = time.perf_counter()
    learner = MegatronLearner(spec, config=LearnerConfig(seed=5, lr=lr, lr_decay="constant"))
    assert next(learner.module.parameters()).is_cuda != cpu, f"the learner is on {next(learner.module.parameters()).device}"
    log(f"lr {lr:g}: learner built in {time.perf_counter() - t0:.1f} s")
    ways = ("delta", "full", "delta_numpy") if cpu else ("delta", "full")
    transports = {way: Transport(f"{root}/{way}", slots=2) for way in ways}
    syncs = {"delta": WeightSync(learner, transports["delta"], dtype="bfloat16",
                                 delta=DeltaOptions(max_fraction=0.9, torch_ops=True)),
             "full": WeightSync(learner, transports["full"], dtype="bfloat16")}
    if cpu:
        syncs["delta_numpy"] = WeightSync(learner, transports["delta_numpy"], dtype="bfloat16",
                                          delta=DeltaOptions(max_fraction=0.9))
    assert syncs["delta"]._tracker is not None and syncs["delta"]._tracker.torch_ops
    versions, mismatches = [], 0
    try:
        for version in range(1, steps + 2):
            if version > 1:
                learner.train_step(_sequences(spec, 4, version), replay=True)
            row: dict[str, Any] = {"version": version}
            for way in (ways if version % 2 else ways[::-1]):
                if not cpu:
                    torch.cuda.synchronize()
                t1 = time.perf_counter()
                if profile and version == steps + 1:
                    report = _profiled(way, version, lambda: syncs[way].sync(version).wait())
                else:
                    report = syncs[way].sync(version).wait()
                row[f"{way}_seconds"] = time.perf_counter() - t1
                row[way] = combine_sync_metrics([report.metrics()])
            want = _digests(transports["full"].read_version(version, 30))
            got = _digests(transports["delta"].read_version(version, 30))
            row["mismatched"] = sorted(n for n in want if got.get(n) != want[n])
            if cpu:
                got = _digests(transports["delta_numpy"].read_version(version, 30))
                row["mismatched"] += sorted(f"{n} (numpy path)" for n in want if got.get(n) != want[n])
                row["mismatched"] += [f"{k} reported (numpy path {row['delta_numpy'][k]}, device path {row['delta'][k]})"
                                      for k in ("sync/bytes", "sync/changed_fraction", "sync/experts_unchanged",
                                                "sync/delta") if row["delta"][k] != row["delta_numpy"][k]]
            mismatches += len(row["mismatched"])
            numpy_ms = f" (numpy path {row['delta_numpy_seconds'] * 1e3:.2f} ms)" if cpu else ""
            log(f"lr {lr:g} v{version}: changed {row['delta']['sync/changed_fraction']:.3e}, delta "
                f"{row['delta']['sync/delta']:.0f}, bytes {row['delta']['sync/bytes']:.0f} of "
                f"{row['full']['sync/bytes']:.0f}, {row['delta_seconds'] * 1e3:.2f} vs "
                f"{row['full_seconds'] * 1e3:.2f} ms{numpy_ms}, "
                f"{len(row['mismatched'])} of {len(want)} tensors differ")
            versions.append(row)
    finally:
        for t in transports.values():
            t.close()
    later = versions[1:-1] if profile and len(versions) > 2 else versions[1:]  # not the profiled version
    med = lambda f: statistics.median(f(r) for r in later)  # noqa: E731
    out = {"lr": lr, "versions": len(versions), "tensors": len(want), "full_bytes": versions[0]["full"]["sync/bytes"],
           "changed_fraction": med(lambda r: r["delta"]["sync/changed_fraction"]),
           "delta_bytes_ratio": med(lambda r: r["delta"]["sync/bytes"] / r["full"]["sync/bytes"]),
           "delta_versions": sum(r["delta"]["sync/delta"] for r in later),
           "delta_ms": med(lambda r: r["delta_seconds"] * 1e3), "full_ms": med(lambda r: r["full_seconds"] * 1e3),
           "first_full_ms": versions[0]["full_seconds"] * 1e3, "mismatches": mismatches}
    if cpu:
        out["delta_numpy_ms"] = med(lambda r: r["delta_numpy_seconds"] * 1e3)
    out["delta_seconds_ratio_ipc"] = out["delta_ms"] / out["full_ms"]
    del syncs, learner
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek_moe_128e", help="conf/model/<name>.yaml")
    ap.add_argument("--no-large", action="store_true", help="the model as its yaml has it, not widened (LARGE)")
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4", help="comma-separated learning rates")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (versions after the first) per rate")
    ap.add_argument("--cpu", action="store_true", help="on CPU: shared memory for cuda_ipc, the device path's torch "
                                                       "ops on CPU tensors beside the numpy path")
    ap.add_argument("--profile", action="store_true", help="the last version of each way under torch.profiler: "
                                                           "its busiest ops on stderr (left out of the medians)")
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from moe_grpo.config import load_model_spec

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("bench_sync_ipc_delta needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.steps < 1:
        raise SystemExit(f"--steps {args.steps}: at least 1 (a delta version needs a version before it)")
    spec = load_model_spec(args.model)
    if not args.no_large:
        spec = spec.replace(**LARGE)
    summary: dict[str, Any] = {"bench": "sync_ipc_delta", "model": spec.name, "widened": not args.no_large,
                               "device": "cpu" if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__, "steps": args.steps}
    mismatches = 0
    for lr in [float(x) for x in args.lrs.split(",")]:
        with tempfile.TemporaryDirectory(prefix="bench_ipc_delta_", dir="/dev/shm") as root:
            row = one_rate(spec, lr, args.steps, root, args.cpu, args.profile)
        print(json.dumps({"bench": "sync_ipc_delta_rate", **row}), flush=True)
        tag = f"lr{lr:.0e}".replace("e-0", "e-")
        for k in ("changed_fraction", "delta_bytes_ratio", "delta_seconds_ratio_ipc", "delta_ms", "full_ms",
                  "delta_versions", "delta_numpy_ms"):
            if k not in row:
                continue
            summary[f"{k}_{tag}"] = round(row[k], 6)
        summary["full_bytes"] = row["full_bytes"]
        mismatches += row["mismatches"]
    summary["delta_tensor_mismatches"] = mismatches
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
