"""The jump warning on router disagreement and mismatch KL."""

from moe_grpo.orchestrator.watch import JumpWatch


def rows(kl, disagreement):
    return [{"step": i + 1, "train/rollout_kl": k, "train/router_disagreement": d}
            for i, (k, d) in enumerate(zip(kl, disagreement))]


def test_a_jump_well_above_the_running_level_is_named_with_its_step_and_key():
    watch = JumpWatch(factor=5.0, window=20)
    # Async-like history: fresh steps ~0, stale steps ~2e-3 (the 90th percentile takes the stale level).
    kl = [1e-7, 2e-3] * 5 + [3e-3, 2.5e-2]
    dis = [0.0, 0.1] * 5 + [0.12, 0.11]
    out = [watch.update(r) for r in rows(kl, dis)]
    assert out[:-1] == [[]] * 11, "the usual fresh/stale alternation must not warn"
    assert len(out[-1]) == 1 and "step 12: train/rollout_kl = 0.025" in out[-1][0] and watch.jumps == 1


def test_tiny_values_stay_quiet_and_factor_zero_turns_it_off():
    watch = JumpWatch(factor=5.0)
    assert not any(watch.update(r) for r in rows([1e-9] * 6 + [5e-4], [0.0] * 6 + [0.04]))  # below the floors
    off = JumpWatch(factor=0.0)
    assert not any(off.update(r) for r in rows([1e-4] * 6 + [1.0], [0.01] * 6 + [0.9]))
    assert not JumpWatch().update({"step": 1, "train/rollout_kl": float("nan")})
