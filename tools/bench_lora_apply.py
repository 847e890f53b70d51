"""Engine tokens/s with LoRA adapters served by vLLM (`sync.lora_apply=serve`) vs merged into the weights (`merge`).

Two engines start from the same LoRA start directory (frozen base + a non-zero adapter) and take the same
adapter-only version from one learner; then they generate the same prompts in turns, alternating which goes
first, so machine drift hits both arms. Greedy sampling without a stop token keeps the work identical; routing
capture is on in both, as in training. Adapters on attention, the dense MLP and the shared experts: vLLM 0.32 on
CPU cannot serve routed-expert adapters, so the comparison leaves them out of both arms.

    .venv/bin/python tools/bench_lora_apply.py [--rank 16] [--prompts 16] [--prompt-len 64] [--max-tokens 64]

Last line: one JSON object; `serve_time_per_token_ratio` (merged tokens/s over served tokens/s: above 1, serving
is slower) is the headline; the field reports 1.33-1.39 for vLLM's LoRA serving on GPUs.
"""

from __future__ import annotations

import json
import tempfile
import time

from interleave import engine_bench_parser, interleaved_medians  # tools/ is sys.path[0] when a bench runs

TARGETS = ("attention", "dense_mlp", "shared_experts")


def main() -> None:
    ap = engine_bench_parser(__doc__)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    import numpy as np
    import torch

    from moe_grpo.checkpoint.peft import load_learner_adapter, write_peft_adapter
    from moe_grpo.config import load_model_spec
    from moe_grpo.learner.batch import LearnerSequence
    from moe_grpo.models.peft_names import peft_shapes
    from moe_grpo.learner.lora_config import LoraConfig
    from moe_grpo.learner.megatron_learner import LearnerConfig, MegatronLearner
    from moe_grpo.rollout.export import export_lora_version
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SharedMemoryTransport
    from moe_grpo.sync.weight_sync import WeightSync

    root = tempfile.mkdtemp(prefix="bench_lora_apply_")
    spec = load_model_spec(args.model)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=TARGETS)
    learner = MegatronLearner(spec, config=LearnerConfig(), lora=lora)

    def random_adapter(seed: int) -> str:
        gen = torch.Generator().manual_seed(seed)
        state = {k: torch.randn(shape, generator=gen) * (0.02 if k.endswith("lora_B.weight") else 0.3)
                 for k, shape in peft_shapes(spec, lora).items()}
        return str(write_peft_adapter(f"{root}/adapter_{seed}", state, spec, lora))

    load_learner_adapter(learner, random_adapter(1))
    transport = SharedMemoryTransport(f"{root}/shm")
    sync = WeightSync(learner, transport)
    sync.sync(0)
    start, _ = export_lora_version(spec, lora, transport.read_version(0), f"{root}/model_v0")
    kwargs = dict(max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.prompts, lora=lora)
    engines = {way: VllmEngine(start, spec, lora_apply=way, **kwargs) for way in ("merge", "serve")}

    load_learner_adapter(learner, random_adapter(2))  # an adapter-only version, as after a step
    report = sync.sync(1).wait()
    apply_s = {way: apply_version(e, transport, 1) for way, e in engines.items()}
    rng = np.random.default_rng(0)
    seqs = [LearnerSequence(rng.integers(3, spec.vocab_size, size=24), prompt_len=4) for _ in range(4)]
    want = learner.logprobs(seqs)
    gaps = {way: max(float(np.abs(g - w).max()) for g, w in zip(e.score([s.tokens for s in seqs]), want))
            for way, e in engines.items()}

    prompts = [list(map(int, rng.integers(3, spec.vocab_size, size=args.prompt_len))) for _ in range(args.prompts)]
    sampling = SamplingSettings(n=1, temperature=0.0, max_tokens=args.max_tokens, stop_token_ids=())

    def run(engine: VllmEngine) -> float:
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling)
        return sum(len(c.token_ids) for g in out for c in g) / (time.perf_counter() - t0)

    merged, served = interleaved_medians(lambda: run(engines["merge"]), lambda: run(engines["serve"]), args.rounds)
    for e in engines.values():
        e.shutdown()
    transport.close()
    print(json.dumps({
        "bench": "lora_apply", "model": spec.name, "rank": args.rank, "targets": list(TARGETS),
        "prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "adapter_version_bytes": report.version_bytes, "base_version_bytes": sync.plan.total_bytes,
        "apply_seconds_merge": round(apply_s["merge"], 4), "apply_seconds_serve": round(apply_s["serve"], 4),
        "max_logprob_gap_merge": gaps["merge"], "max_logprob_gap_serve": gaps["serve"],
        "merge_w0_copy_bytes": engines["merge"].lora_base_bytes,
        "tokens_per_s_merge": round(merged, 1), "tokens_per_s_serve": round(served, 1),
        "serve_time_per_token_ratio": round(merged / served, 4),
    }))


if __name__ == "__main__":
    main()
