"""An engine of two pipeline stages serves what the one-worker engine serves (issue 32, the PP bullet).

For the DeepSeek-V3 (MLA, a leading dense layer) and Qwen3-MoE tiny checkpoints of test_families (4 decoder
layers, fp32), the session's TP=1 engine (family_engines.py) and a `VllmEngine(..., pipeline_parallel=2)` on the
same weights: vLLM's multiprocessing executor, two workers on this host, layers 0-1 on the first stage and 2-3 on
the second. Prompt log-probs, greedy completions and routing traces (prompt and generated positions, row for row)
are compared on the start weights and on a published version both stages load through shared memory. Each stage
captures the routing of its own layers and the engine joins them in layer order. Then the engine is handed a
version one stage does not report loaded: it keeps serving the version it had.

Before vllm_patches.cpu_pipeline_intermediate_tensors, the PP=2 engine died at the second stage's first forward
(`assert self.intermediate_tensors is not None`, tools/results/probe_vllm_cpu_parallel.txt); before this engine
option, `VllmEngine` had no `pipeline_parallel` (TypeError). With routing taken from one worker only (as at TP=2),
every trace would miss the second stage's layers.
"""

from __future__ import annotations

import re

import pytest

from publishing import publish_version
from test_engine_tensor_parallel import LOGPROB_TOL, _gap, _measure, _perturbed, _rows_equal
from test_families import _eval_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ["deepseek_v3", "qwen3_moe"]


def _layers(digests: dict[str, str], stage: int) -> set[int]:
    """Decoder-layer indices whose weights the worker of `stage` holds ('pp<stage>tp0/model.layers.<i>.…')."""
    return {int(m.group(1)) for name in digests if name.startswith(f"pp{stage}tp0/")
            for m in [re.search(r"\.layers\.(\d+)\.", name)] if m}


def _exercise(engine, transport, seqs, base: int) -> dict:
    """Measure `engine` on the start weights and on version base + 1; for an engine of several workers also hand
    it version base + 2 with one worker's answer missing."""
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    out = {"v0": _measure(engine, seqs)}
    apply_version(engine, transport, base + 1)
    out["v1"] = _measure(engine, seqs)
    out["buffers_left"] = engine.num_routing_buffers()
    out["digests_v1"] = engine.weight_digests()
    if getattr(engine, "num_workers", 1) > 1:
        out["workers"] = len(engine._model_pids)
        real, silenced = engine._collective_rpc, []

        async def one_worker_silent(method, args=()):  # once: the rollback that follows goes through
            answers = await real(method, args)
            if method == "moe_grpo_reload_bucket" and not silenced:
                silenced.append(method)
                return answers[:1]
            return answers

        engine._collective_rpc = one_worker_silent
        try:
            with pytest.raises(SyncError, match=r"expected the same count from each of 2"):
                apply_version(engine, transport, base + 2)
        finally:
            engine._collective_rpc = real
        out["after_refused"] = {"version": engine.policy_version, "prompt_lps": engine.score(seqs),
                                "digests": engine.weight_digests()}
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """The TP=1 side is the session's one-worker engine on the family's checkpoint; the PP=2 engine is this
    module's own, started after the TP=1 side is measured (2 cores: one engine at a time)."""
    import family_engines
    from moe_grpo.rollout.vllm_engine import VllmEngine
    from moe_grpo.sync.transport import SharedMemoryTransport

    shared = family_engines.acquire(request.param, tmp_path_factory)
    root = tmp_path_factory.mktemp(f"pp_{request.param}")
    hf, spec, base = shared.hf, shared.spec, shared.engine.policy_version
    transport = SharedMemoryTransport(str(root / "shm"))
    try:
        publish_version(transport, base + 1, spec, tensors=_perturbed(hf, spec, 1))
        publish_version(transport, base + 2, spec, tensors=_perturbed(hf, spec, 2))
        seqs = _eval_tokens()
        tp1 = _exercise(shared.engine, transport, seqs, base)
        engine = VllmEngine(hf, spec, max_model_len=256, max_num_seqs=8, pipeline_parallel=2, name="pp2")
        try:
            pp2 = _exercise(engine, transport, seqs, base)
        finally:
            engine.shutdown()
        yield {"name": request.param, "base": base, "tp1": tp1, "pp2": pp2, "num_layers": spec.num_layers}
    finally:
        try:
            family_engines.release(request.param, request)
        finally:
            transport.close()


@pytest.mark.parametrize("version", ["v0", "v1"])
def test_pp2_engine_matches_tp1_engine(served, version, record_property):
    """Log-probs within 1e-5, the same greedy tokens, and one routing trace per request equal row for row to the
    TP=1 engine's (every MoE layer, in layer order, joined from the two stages), on the start weights and on a
    version loaded into both stages."""
    one, two = served["tp1"][version], served["pp2"][version]
    assert served["pp2"]["workers"] == 3, "expected 2 workers and the engine core holding them"
    prompt_gap, gen_gap = _gap(one["prompt_lps"], two["prompt_lps"]), _gap(one["lps"], two["lps"])
    prompt_rows = _rows_equal(one["prompt_routes"], two["prompt_routes"])
    gen_rows = _rows_equal(one["routes"], two["routes"])
    figures = {"family": served["name"], "version": version, "prompt_logprob_max_gap": prompt_gap,
               "greedy_logprob_max_gap": gen_gap, "prompt_rows_equal": prompt_rows, "greedy_rows_equal": gen_rows}
    record_property("pp2_vs_tp1", figures)
    print(f"PP=2 vs TP=1: {figures}")
    assert prompt_gap <= LOGPROB_TOL and gen_gap <= LOGPROB_TOL, figures
    assert all((a == b).all() for a, b in zip(one["tokens"], two["tokens"])), "greedy tokens differ"
    assert prompt_rows[0] == prompt_rows[1] and gen_rows[0] == gen_rows[1], figures
    expected = 0 if version == "v0" else served["base"] + 1
    assert all((v == expected).all() for v in two["versions"]), f"tokens not stamped with version {expected}"
    if version == "v1":  # the published version changed what is served (else the load went nowhere)
        assert _gap(served["pp2"]["v0"]["prompt_lps"], two["prompt_lps"]) > 1e-3


def test_pp2_engine_stages_hold_their_own_layers_and_serve_a_version_only_when_both_loaded_it(served):
    """Each stage holds only its run of decoder layers (together: every layer once); a reload one stage does not
    report done is not served: both stages hold the version they had, bit for bit."""
    two = served["pp2"]
    digests = two["digests_v1"]
    first, second = _layers(digests, 0), _layers(digests, 1)
    assert first and second and not first & second, (sorted(first), sorted(second))
    assert first | second == set(range(served["num_layers"])) and max(first) < min(second)
    assert two["after_refused"]["version"] == served["base"] + 1
    assert _gap(two["after_refused"]["prompt_lps"], two["v1"]["prompt_lps"]) == 0.0
    assert two["after_refused"]["digests"] == digests


def test_pp2_engine_keeps_no_routing_buffers(served):
    """Both stages' capturing workers free each request's buffers once its routing is fetched."""
    assert served["pp2"]["buffers_left"] == 0 and served["tp1"]["buffers_left"] == 0
