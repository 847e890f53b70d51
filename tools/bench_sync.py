"""Weight-sync throughput (gather + rename + transfer) against a plain memcpy of the same bytes.

Builds a learner of at least --mb megabytes (fp32), then times one sync
without the engine's own reload: every rank stages its shards (Megatron
distributed checkpoint on /dev/shm), full tensors are read back a decoder
layer at a time, renamed to HF names, and written as the transport's bucket
files on /dev/shm - everything the engine would read. In the same run it
times `torch.Tensor.copy_` of the same number of bytes.

    .venv/bin/python tools/bench_sync.py [--mb 600]

Last line: one JSON object with `sync_vs_memcpy_ratio` and `projected_deepseek_v3_seconds`
(DeepSeek-V3's bf16 bytes at the measured sync rate on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=600.0, help="model size to sync, in MB (fp32)")
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from safetensors.torch import save_file

    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.models.spec import MoEModelSpec
    from moe_grpo.sync.reshard import iter_hf_buckets, release, stage, staging_root

    per_moe_layer = 32 * 3 * 1024 * 512 * 4
    layers = max(2, int(args.mb * 1e6 / per_moe_layer) + 1) + 1
    spec = MoEModelSpec(name="bench_sync", architecture="DeepseekForCausalLM", vocab_size=32000, hidden_size=1024,
                        num_layers=layers, first_k_dense=1, num_attention_heads=16, ffn_hidden_size=2048,
                        num_experts=32, moe_ffn_hidden_size=512, top_k=4, num_shared_experts=1)
    learner = MegatronLearner(spec, config=LearnerConfig())
    model_bytes = sum(p.numel() * p.element_size() for p in learner.module.parameters())

    t0 = time.perf_counter()
    stage_dir = stage(learner, version=1)
    t_stage = time.perf_counter() - t0
    out_dir = tempfile.mkdtemp(prefix="bench_sync_", dir=staging_root())
    synced = 0
    for i, bucket in enumerate(iter_hf_buckets(stage_dir, max_bucket_bytes=64 << 20)):
        path = os.path.join(out_dir, f"bucket{i}.safetensors")
        save_file(bucket, path)
        synced += sum(t.numel() * t.element_size() for t in bucket.values())
        os.unlink(path)
    t_sync = time.perf_counter() - t0
    release(stage_dir)
    os.rmdir(out_dir)

    src = torch.empty(synced // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages once
    t1 = time.perf_counter()
    dst.copy_(src)
    t_copy = time.perf_counter() - t1

    v3_bytes = 671.0e9 * 2  # DeepSeek-V3 parameters (published 671B, our meta-device count 671.03B) in bf16
    rate = synced / t_sync
    print(json.dumps({
        "bench": "sync", "model_bytes": model_bytes, "synced_bytes": synced, "layers": spec.num_layers,
        "stage_seconds": round(t_stage, 3), "sync_seconds": round(t_sync, 3),
        "sync_bytes_per_s": round(rate), "memcpy_bytes_per_s": round(synced / t_copy),
        "sync_vs_memcpy_ratio": round(rate / (synced / t_copy), 4),
        "projected_deepseek_v3_seconds": round(v3_bytes / rate, 1),
        "note": "one process, CPU; staging is Megatron's checkpoint writer on /dev/shm",
    }))


if __name__ == "__main__":
    main()
