"""Peak memory and speed of streamed checkpoint conversion on a synthetic multi-GB checkpoint.

Writes a random DeepSeek-V3-architecture HF checkpoint of about --gb gigabytes
(one layer in memory at a time), then converts HF -> Megatron and Megatron ->
HF under /usr/bin/time -v, each in its own process, and reports each
direction's maximum resident set size next to the checkpoint's size.

    .venv/bin/python tools/bench_convert.py [--gb 2.5] [--workdir /tmp/bench_convert] [--keep]

Last line: one JSON object (`peak_rss_over_checkpoint_hf_to_megatron` etc.).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def synthetic_spec(gb: float):
    from moe_grpo.models.spec import MoEModelSpec

    hidden, moe_ffn, experts = 1024, 512, 64
    per_moe_layer = experts * 3 * hidden * moe_ffn * 4
    layers = max(2, int(gb * 1e9 / per_moe_layer) + 1) + 1
    return MoEModelSpec(
        name="synthetic_v3", architecture="DeepseekV3ForCausalLM", vocab_size=32000, hidden_size=hidden,
        num_layers=layers, first_k_dense=1, num_attention_heads=8, ffn_hidden_size=2048, num_experts=experts,
        moe_ffn_hidden_size=moe_ffn, top_k=8, num_shared_experts=1, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, score_function="sigmoid", expert_bias=True,
        num_expert_groups=8, group_top_k=4, normalize_top_k=True, routed_scaling_factor=2.5)


def write_synthetic_hf(spec, directory: Path) -> int:
    """Random weights in HF layout, one decoder layer per file; returns bytes written."""
    import torch

    from moe_grpo.checkpoint.convert import _meta_shapes, meta_model
    from moe_grpo.checkpoint.hf_io import ShardedSafetensorsWriter
    from moe_grpo.models.hf_config import write_hf_config
    from moe_grpo.models.hf_names import param_mappings, to_hf

    shapes = _meta_shapes(meta_model(spec))
    writer = ShardedSafetensorsWriter(directory)
    gen = torch.Generator().manual_seed(0)
    group, layer = {}, "start"
    for m in param_mappings(spec):
        if m.layer != layer and group:
            writer.write_file(group)
            group = {}
        layer = m.layer
        full = torch.randn(shapes[m.megatron], generator=gen) * 0.02
        group.update(zip(m.hf, to_hf(m, full, spec)))
    writer.write_file(group)
    writer.finish()
    write_hf_config(spec, directory)
    return writer.total_size


def timed_run(args: list[str]) -> tuple[float, int]:
    """Run under /usr/bin/time -v; return (seconds, max RSS bytes)."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *args], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return seconds, rss_kb * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.5, help="approximate checkpoint size")
    ap.add_argument("--workdir", default="/tmp/moe_grpo_bench_convert")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    if not os.path.exists("/usr/bin/time"):
        sys.exit("needs /usr/bin/time (Debian package 'time')")
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    spec = synthetic_spec(args.gb)
    t0 = time.perf_counter()
    size = write_synthetic_hf(spec, work / "hf")
    write_s = time.perf_counter() - t0
    py = sys.executable
    tool = str(ROOT / "tools" / "convert_checkpoint.py")
    to_mg_s, to_mg_rss = timed_run([py, tool, "--from", "hf", "--to", "megatron", "--src", str(work / "hf"),
                                    "--dst", str(work / "mg"), "--quiet"])
    to_hf_s, to_hf_rss = timed_run([py, tool, "--from", "megatron", "--to", "hf", "--src", str(work / "mg"),
                                    "--dst", str(work / "hf_back"), "--quiet"])
    baseline_s, baseline_rss = timed_run([py, "-c", "import torch, megatron.core, moe_grpo.checkpoint.convert"])
    result = {
        "bench": "convert",
        "checkpoint_bytes": size,
        "layers": spec.num_layers,
        "experts": spec.num_experts,
        "write_synthetic_seconds": round(write_s, 1),
        "hf_to_megatron_seconds": round(to_mg_s, 1),
        "megatron_to_hf_seconds": round(to_hf_s, 1),
        "peak_rss_bytes_hf_to_megatron": to_mg_rss,
        "peak_rss_bytes_megatron_to_hf": to_hf_rss,
        "peak_rss_bytes_imports_only": baseline_rss,
        "peak_rss_over_checkpoint_hf_to_megatron": round(to_mg_rss / size, 3),
        "peak_rss_over_checkpoint_megatron_to_hf": round(to_hf_rss / size, 3),
    }
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
