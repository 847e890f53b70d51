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

from test_engine_tensor_parallel import _gap, check_matches_tp1, serve_beside_tp1

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ["deepseek_v3", "qwen3_moe"]


def _layers(digests: dict[str, str], stage: int) -> set[int]:
    """Decoder-layer indices whose weights the worker of `stage` holds ('pp<stage>tp0/model.layers.<i>.…')."""
    return {int(m.group(1)) for name in digests if name.startswith(f"pp{stage}tp0/")
            for m in [re.search(r"\.layers\.(\d+)\.", name)] if m}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    yield from serve_beside_tp1(request, tmp_path_factory, "pp2", pipeline_parallel=2)


@pytest.mark.parametrize("version", ["v0", "v1"])
def test_pp2_engine_matches_tp1_engine(served, version, record_property):
    """Log-probs within 1e-5, the same greedy tokens, and one routing trace per request equal row for row to the
    TP=1 engine's (every MoE layer, in layer order, joined from the two stages), on the start weights and on a
    version loaded into both stages."""
    check_matches_tp1(served, "pp2", version, record_property)


def test_pp2_engine_stages_hold_their_own_layers_and_serve_a_version_only_when_both_loaded_it(served):
    """Each stage holds only its run of decoder layers (together: every layer once); a reload one stage does not
    report done is not served: both stages hold the version they had, bit for bit."""
    two = served["pp2"]
    digests = two["digests_v1"]
    first, second = _layers(digests, 0), _layers(digests, 1)
    assert first and second and not first & second, (sorted(first), sorted(second))
    assert first | second == set(range(served["num_layers"])) and max(first) < min(second)
    assert two["after_refused"]["version"] == served["base"] + 1
    assert two["after_refused"]["digests"] == digests  # the weights, bit for bit
    # What it serves from them: within float noise. The two scorings are separate calls, which vLLM's CPU backend
    # may batch differently (a gap of 4.8e-7 seen once in 2026-11-28's suite, 0.0 in every run before).
    assert _gap(two["after_refused"]["prompt_lps"], two["v1"]["prompt_lps"]) < 1e-5


def test_pp2_engine_keeps_no_routing_buffers(served):
    """Both stages' capturing workers free each request's buffers once its routing is fetched."""
    assert served["pp2"]["buffers_left"] == 0 and served["tp1"]["buffers_left"] == 0
