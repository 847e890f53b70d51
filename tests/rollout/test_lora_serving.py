"""LoRA versions served through vLLM's LoRA serving in a real engine (sync.lora_apply=serve; rollout/lora_serving.py).

One engine per model family (the default tiny DeepSeek-MoE, and DeepSeek-V3's MLA attention at toy size) starts
from a base version's start directory (frozen base + the version's PEFT adapter, non-zero A and B) and takes
adapter-only versions from a one-rank LoRA learner's WeightSync through shared memory. Adapters on attention, the
dense MLP and the shared experts: vLLM 0.32 on CPU cannot serve routed-expert adapters (refused, tested below)."""

import time

import pytest

import layout_scenarios as S
import lora_scenarios as L

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-4
"""Largest |engine - learner| log-prob of a token, fp32 both sides."""

SERVED_TARGETS = ("attention", "dense_mlp", "shared_experts")


def test_routed_expert_adapters_are_refused_on_cpu_before_vllm_starts(tmp_path):
    from moe_grpo.rollout.vllm_engine import VllmEngine

    # tmp_path holds no model: had vLLM started, the error would be its failure to load one.
    with pytest.raises(ValueError, match="routed-expert adapters cannot be served.*sync.lora_apply=merge"):
        VllmEngine(tmp_path, S.tiny_spec(), lora=L.lora_config(), lora_apply="serve")


@pytest.fixture(scope="module", params=["deepseek_moe", "deepseek_v3_mla"])
def served(request, tmp_path_factory):
    """(engine, learner, WeightSync, transport, sequences, base log-probs) on one random non-zero adapter."""
    from moe_grpo.rollout.vllm_engine import VllmEngine

    root = tmp_path_factory.mktemp(f"lora_serve_{request.param}")
    spec = S.tiny_spec() if request.param == "deepseek_moe" else S.tiny_v3_spec()
    lora = L.lora_config(targets=SERVED_TARGETS)
    learner, sync, transport, seqs, base_lp, start = L.lora_start(spec, lora, root)
    engine = VllmEngine(start, spec, max_model_len=512, max_num_seqs=16, lora=lora, lora_apply="serve",
                        on_update="keep")
    yield engine, learner, sync, transport, seqs, base_lp
    engine.shutdown()
    transport.close()


_gap = L.logprob_gap


def _scores(engine, seqs):
    return engine.score([s.tokens for s in seqs])


def test_engine_serves_the_learners_lora_model_through_adapter_only_versions(served):
    from moe_grpo.sync.deliver import apply_version

    engine, learner, sync, transport, seqs, base_lp = served
    assert engine.lora_base_bytes == 0, "serving keeps no copy of W0"
    start = _scores(engine, seqs)
    assert _gap(start, learner.logprobs(seqs)) < TOLERANCE, "the start directory's adapter is served"
    assert _gap(start, base_lp) > 1e-2, "the adapter changes the model (else this test could not fail)"
    for version in (1, 2):
        learner.train_step(seqs, replay=False)
        report = sync.sync(version).wait()
        seconds = apply_version(engine, transport, version)
        got, want = _scores(engine, seqs), learner.logprobs(seqs)
        print(f"version {version}: {report.version_bytes} B sent (base version {sync.plan.total_bytes} B), "
              f"engine apply {seconds:.2f} s, gap {_gap(got, want):.2e}")
        assert _gap(got, want) < TOLERANCE
        assert report.version_bytes == sync.adapter_plan.total_bytes < sync.plan.total_bytes / 10
    assert engine.policy_version == 2
    assert len(list(engine._served.root.iterdir())) == 1, "adapters no request uses are removed"


def _new_version_during_a_long_request(served, prompt: int, seed: int):
    """Train a step, publish it, start a 500-token request and apply the version while it runs. Returns (the
    request's future, the version served before)."""
    from moe_grpo.rollout.types import SamplingSettings
    from moe_grpo.sync.deliver import apply_version

    engine, learner, sync, transport, seqs, _ = served
    old = engine.policy_version
    learner.train_step(seqs, replay=False)
    sync.sync(old + 1).wait()
    sampling = SamplingSettings(n=1, temperature=1.0, max_tokens=500, stop_token_ids=(), seed=seed)
    long = engine.submit(list(seqs[prompt].tokens[:3]), sampling)
    time.sleep(0.5)
    assert not long.done(), "the request must still be running when the version arrives"
    apply_version(engine, transport, old + 1)
    return long, old


def test_requests_in_flight_finish_on_the_adapter_they_started_on(served):
    """on_update=keep with served adapters: nothing pauses; a request started before a version finishes on its own
    adapter (every token stamped with its version), the next one runs on the new adapter."""
    from moe_grpo.rollout.types import SamplingSettings

    engine, learner, _, _, seqs, _ = served
    long, old = _new_version_during_a_long_request(served, prompt=0, seed=3)
    assert not long.done(), "a served-adapter version does not wait for requests in flight"
    first = long.result(120)[0]
    after = engine.generate([list(seqs[0].tokens[:3])], SamplingSettings(n=1, max_tokens=8, seed=3))[0][0]
    assert len(first.token_ids) == 500 and set(first.versions.tolist()) == {old}
    assert set(after.versions.tolist()) == {old + 1}
    assert _gap(_scores(engine, seqs), learner.logprobs(seqs)) < TOLERANCE


def test_with_abort_a_request_in_flight_goes_on_under_the_new_adapter(served, monkeypatch):
    """on_update=abort: the request in flight is aborted at the switch and resubmitted on the new adapter; its tokens
    are stamped with the version each part was sampled under."""
    engine = served[0]
    monkeypatch.setattr(engine, "on_update", "abort")
    resubmitted = engine.stats["resubmitted"]
    long, old = _new_version_during_a_long_request(served, prompt=1, seed=5)
    done = long.result(120)[0]
    versions = done.versions.tolist()
    assert len(versions) == 500 and engine.stats["resubmitted"] == resubmitted + 1
    assert versions[0] == old and versions[-1] == old + 1 and versions == sorted(versions)


def test_a_version_vllm_cannot_load_or_with_base_weights_leaves_the_engine_on_its_version(served, monkeypatch):
    from moe_grpo.sync.deliver import apply_version
    from moe_grpo.sync.transport import SyncError

    engine, learner, sync, transport, seqs, _ = served
    version, before = engine.policy_version, _scores(engine, seqs)
    learner.train_step(seqs, replay=False)
    sync.sync(version + 1).wait()

    async def refuse(request):
        raise RuntimeError("injected: vLLM could not load the adapter")

    monkeypatch.setattr(engine.llm, "add_lora", refuse)
    with pytest.raises(SyncError, match=f"injected.*still serving version {version}"):
        apply_version(engine, transport, version + 1)
    monkeypatch.undo()
    assert engine.policy_version == version and engine.broken is None
    assert _gap(_scores(engine, seqs), before) == 0.0
    with pytest.raises(Exception, match="takes its base weights from its start directory only"):
        engine.load_published("x", sync.plan, version + 2, sources=[{"entries": [["model.norm.weight", [4], 0]]}])
    assert engine.policy_version == version
