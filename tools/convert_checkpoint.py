"""Convert checkpoints between Hugging Face safetensors and Megatron distributed checkpoints.

    python tools/convert_checkpoint.py --from hf --to megatron --src /ckpt/hf --dst /ckpt/mg [--verify --tp 2 --ep 2]
    python tools/convert_checkpoint.py --from megatron --to hf --src /ckpt/mg --dst /ckpt/hf_out
    python tools/convert_checkpoint.py --from megatron --to megatron --src /ckpt/mg --dst /ckpt/mg_bf16 --dtype bfloat16
    python tools/convert_checkpoint.py --from hf --to hf --src /ckpt/hf --dst /ckpt/hf_merged --merge-adapter /run/adapter

Megatron checkpoints (torch_dist) are layout-free: Megatron reshards them to
any TP/EP/PP when a learner loads them, so one conversion serves every
layout. --tp/--ep/--pp choose the layout --verify loads the result at; --verify
compares per-token log-probs of the HF model (transformers) and the Megatron
model on a few random sequences. Conversion streams: one decoder layer (HF
side) or one tensor chunk (Megatron side) in memory at a time. A failure
leaves nothing at --dst.

--merge-adapter DIR folds a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, as the learner's
`export_learner_adapter` writes) into the HF base at --src: every adapted weight becomes W + (lora_alpha / r) * B @ A,
one safetensors file in memory at a time; everything else is copied. The adapter may hold routed experts per expert
(`experts.3.gate_proj`) or fused (PEFT's `target_parameters` on `experts.gate_up_proj` / `down_proj`, as the export
writes where the installed transformers fuses experts, and as PEFT saves); the base must hold them per expert, as
transformers 5.19 saves them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src_format", choices=["hf", "megatron"], required=True)
    ap.add_argument("--to", dest="dst_format", choices=["hf", "megatron"], required=True)
    ap.add_argument("--src", required=True, help="source directory")
    ap.add_argument("--dst", required=True, help="destination directory (must not exist)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size --verify loads at")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size --verify loads at")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size --verify loads at")
    ap.add_argument("--token-dispatcher", choices=["auto", "alltoall", "allgather"], default="auto",
                    help="Megatron MoE token dispatcher --verify loads with; auto = alltoall, or allgather for "
                         "TP>1 x EP>1 without CUDA (gloo refuses alltoall's uneven all_gather there)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="megatron->megatron: cast weights")
    ap.add_argument("--verify", action="store_true", help="compare log-probs of the HF and Megatron sides")
    ap.add_argument("--merge-adapter", metavar="DIR", help="hf -> hf: fold this PEFT LoRA adapter into --src")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    # Checked before torch and megatron-core are imported (seconds): a mistyped path fails at once, without a traceback.
    src = Path(args.src)
    if not src.is_dir():
        ap.error(f"--src {args.src}: no such directory")
    if args.src_format == "hf" and not (src / "config.json").is_file():
        ap.error(f"--src {args.src}: no config.json (expected a Hugging Face checkpoint directory)")
    if Path(args.dst).exists():
        ap.error(f"--dst {args.dst} exists; remove it or choose another")

    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed.*")
    import torch

    from moe_grpo.checkpoint import convert

    t0 = time.perf_counter()
    progress = not args.quiet
    pair = (args.src_format, args.dst_format)
    if args.merge_adapter and pair != ("hf", "hf"):
        ap.error("--merge-adapter merges into an HF checkpoint: use it with --from hf --to hf")
    if pair == ("hf", "hf") and args.merge_adapter:
        from moe_grpo.checkpoint.peft import merge_adapter_checkpoint

        merged = merge_adapter_checkpoint(args.src, args.merge_adapter, args.dst)
        print(json.dumps({"from": "hf", "to": "hf", "merged_adapter": args.merge_adapter, **merged,
                          "seconds": round(time.perf_counter() - t0, 2)}))
        return 0
    if pair == ("hf", "megatron"):
        spec = convert.hf_to_megatron(args.src, args.dst, progress=progress)
        hf_dir, mg_dir = args.src, args.dst
    elif pair == ("megatron", "hf"):
        spec = convert.megatron_to_hf(args.src, args.dst, progress=progress)
        hf_dir, mg_dir = args.dst, args.src
    elif pair == ("megatron", "megatron"):
        dtype = getattr(torch, args.dtype) if args.dtype else None
        spec = convert.megatron_to_megatron(args.src, args.dst, dtype=dtype, progress=progress)
        hf_dir, mg_dir = None, args.dst
    else:
        ap.error("hf -> hf is a copy; nothing to convert")
    report = {"from": args.src_format, "to": args.dst_format, "model": spec.name, "seconds": round(time.perf_counter() - t0, 2)}
    if args.verify:
        if hf_dir is None:
            ap.error("--verify compares against an HF checkpoint; use it with hf<->megatron")
        from moe_grpo.checkpoint.verify import verify

        dispatcher = None if args.token_dispatcher == "auto" else args.token_dispatcher
        report["verify"] = verify(hf_dir, mg_dir, tp=args.tp, ep=args.ep, pp=args.pp, token_dispatcher=dispatcher)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
