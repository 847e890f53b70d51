"""`python -m moe_grpo.evaluate`: score a policy on a held-out set with the vLLM engine (config, pass@k, the run)."""
