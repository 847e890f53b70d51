"""The driver on real parts (Ray actors, Megatron learner, vLLM engine): schedules, staleness, the run record."""

import glob
import json
import logging
import math
import os
import re
import sys
import time

import pytest

from moe_grpo.config import from_hydra, load_model_spec

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH", "")])


def small_run(**overrides):
    import dataclasses

    tree = {"model": dataclasses.asdict(load_model_spec("deepseek_moe")), "steps": 6, "warm_start_steps": 2,
            "eval_every": 3, "algo": {"prompts_per_step": 4, "group_size": 4},
            "rollout": {"max_tokens": 8, "max_num_seqs": 32}}
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (tree.setdefault(section, {}) if section else tree)[name] = value
    return from_hydra(tree)


def rows_of(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def check_clean_sync_rows(rows):
    """What a healthy sync run records; a broken sync, replay, version stamp or counter gets one of these wrong."""
    for r in rows:
        assert r["staleness/max"] == 0, "sync: every batch is sampled by the weights it trains"
        # fp32 engine and learner on the same weights, the engine's routing replayed: the two agree. An engine that
        # missed a sync, or a learner routing differently, shows a KL orders of magnitude larger.
        assert r["train/rollout_kl"] < 1e-5 and r["train/router_disagreement"] < 0.01, r
        assert r["offpolicy/stale_fraction"] == 0 and (r["offpolicy/kl"] is None or math.isnan(r["offpolicy/kl"]))
        # The probe (every engine samples fixed prompts at each published version, the learner scores them with
        # that version's weights) finds the same; in a sync run a step's row carries the probe of the weights it
        # trained from (its scoring goes to the ranks ahead of the step: Driver.start_step), also the first row of
        # a resumed run, which once had none yet (CI, 2026-11-27).
        assert r["mismatch/probe_version"] == r["step"] - 1, r
        assert r["mismatch/kl"] < 1e-5 and r["mismatch/kl_replay_on"] == r["mismatch/kl"], r
        assert r["mismatch/kl_replay_off"] < 1e-3 and 0 <= r["mismatch/router_disagreement"] < 0.05, r
        assert r["mismatch/probe_engines"] == 1 and r["mismatch/probe_dropped"] == 0, r
        assert 0 <= r["reward/mean"] <= 1 and r["reward/std"] >= 0
        assert 1 <= r["response_length/mean"] <= 8
        assert r["sync/bytes"] == rows[0]["sync/bytes"] > 0, "every step publishes the whole model"
        # Unclamped (run_record.step_row): the learner's time of a step lies inside the driver's interval of it, so a
        # train time measured over the wrong span shows here as a busy fraction above 1.
        assert r["throughput/rollout_tokens_per_s"] > 0 and 0 < r["util/train_busy"] <= 1, r
        # Group-relative advantages are zero when every reward is equal: such a step must not move the weights.
        assert (r["grad_norm"] == 0) if r["reward/std"] == 0 else (r["grad_norm"] >= 0), r
        assert r["faults/engine_restarts"] == r["faults/requests_lost"] == r["faults/steps_skipped"] == 0


SYNC = dict(mode="sync", steps=5, eval_every=2, **{"checkpoint.every": 2, "checkpoint.keep": 3,
                                                   "model.num_layers": 4})  # 4: two pipeline stages of 2 layers


def _alive_as_recorded(pids: dict[int, float]) -> list[int]:
    """The pids of a process record (pid -> start time) whose process is alive and is the one recorded (not a reuse)."""
    import psutil

    alive = []
    for pid, started in pids.items():
        try:
            if abs(psutil.Process(pid).create_time() - started) <= 1.0:  # psutil's epoch times move with the clock
                alive.append(pid)
        except psutil.Error:
            pass
    return alive


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    """An uninterrupted sync run (the resume tests below continue it from its step-2 checkpoint), with every port its
    processes listened on (`summary["listening"]`) and the pids of its engines' vLLM processes (`engine_pids`, from
    its process record). The ports are sampled every 0.5 s, and at each state where the run's processes are known to
    be up: each time the driver has brought its process record up to date (after every step, engines serving), by
    the driver itself, of this process's tree and of every process the record names."""
    from listeners import Listeners

    from moe_grpo.orchestrator import process_record
    from moe_grpo.orchestrator.training_run import train

    run_dir = tmp_path_factory.mktemp("sync")
    engines: set[int] = set()
    update = process_record.ProcessRecord.update

    def update_then_sample(record, *, full: bool = False) -> None:
        update(record, full=full)
        engines.update(pid for pid in record.engines.values() if pid)
        listening.sample(pids=_alive_as_recorded(record.pids))

    with Listeners() as listening, pytest.MonkeyPatch.context() as patch:
        patch.setattr(process_record.ProcessRecord, "update", update_then_sample)
        summary = train(small_run(**SYNC), run_dir)
    return run_dir, {**summary, "listening": listening, "engine_pids": sorted(engines)}


def test_sync_mode_trains_on_policy_and_records_what_it_did(sync_run):
    run_dir, summary = sync_run
    rows = rows_of(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    check_clean_sync_rows(rows)
    # A row carries the probes finished before it was logged; the summary waits for the final version's.
    assert summary["mismatch"]["probe_version"] == 5 > rows[-1]["mismatch/probe_version"], summary["mismatch"]
    assert summary["mismatch"]["kl"] < 1e-5 and summary["mismatch"]["probe_engines"] == 1, summary["mismatch"]
    assert [s for s, _ in summary["evals"]] == [0, 2, 4, 5]
    assert [r["eval/step"] for r in rows] == [0, 2, 2, 4, 5]
    assert [r["eval/policy_version"] for r in rows] == [0, 2, 2, 4, 5], "held-out scored by the weights of its step"
    assert (run_dir / "metrics.png").stat().st_size > 10_000
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tensorboard").iterdir())
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["latest", "step_000002", "step_000004", "step_000005"], "every 2 steps and at the end, 3 kept"


def test_a_one_host_run_opens_no_port_another_host_can_reach(sync_run):
    """Would have caught: in a run on one host, Ray's GCS, raylet and workers' gRPC ports listened on all interfaces,
    its runtime-env agent on the host's address and its autoscaler's metrics (plain HTTP, no token) on
    0.0.0.0:44217 (README, "Ports and files a run opens")."""
    listening, engines = sync_run[1]["listening"], sync_run[1]["engine_pids"]
    names = {name for _, name in listening.ports}
    assert "gcs_server" in names and "raylet" in names, names
    # The engine's vLLM worker (the process the run's record names) was sampled with its listening sockets (gloo's,
    # on loopback), so the check below covers vLLM's ports too.
    assert engines and all(listening.by_pid.get(pid) for pid in engines), (engines, listening.by_pid)
    assert listening.reachable_from_outside() == []


def resume_from_step_2(sync_run, new_dir):
    """A copy of the run as a SIGKILL right after step 2's checkpoint leaves it (record cut mid-line)."""
    import shutil

    run_dir, _ = sync_run
    (new_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step_000002", new_dir / "checkpoints" / "step_000002")
    shutil.copytree(run_dir / "checkpoints" / "step_000004", new_dir / "checkpoints" / "step_000004.tmp")
    (new_dir / "checkpoints" / "latest").write_text("step_000002")
    text = (run_dir / "metrics.jsonl").read_text()
    (new_dir / "metrics.jsonl").write_text(text[: len(text) * 3 // 5 + 7])


SAMPLED = ("reward/mean", "reward/std", "response_length/mean", "eval/reward/mean")
"""What the engines sampled: identical in a resumed run (every prompt's samples are seeded, the prompt source's
position and the learner's weights are restored)."""
COMPUTED = ("loss", "grad_norm", "nll")
"""What the learner computed from those samples and the engine's log-probs. vLLM batches requests as they arrive, so
the log-probs it reports vary in the last float32 bits with timing (the sampled tokens do not): these agree to 1e-5
absolute / 1e-4 relative, not bit for bit."""


def assert_repeats(want, got, steps, sampled=SAMPLED):
    for step in steps:
        w, g = want[step - 1], got[step - 1]
        assert {k: g[k] for k in sampled} == {k: w[k] for k in sampled}, step
        for key in COMPUTED:
            assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-5), (step, key, g[key], w[key])


@pytest.fixture(scope="module")
def resumed_run(sync_run, tmp_path_factory, session_ray_address, on_session_ray):
    """The sync run, killed after step 2's checkpoint, resumed with two pipeline stages (PP=2) and extended to `steps=7` (the test below),
    on the session's Ray cluster, which this process had joined before `train` (as a notebook or a sweep driver
    has): what the joined cluster looked like after the run is read while this process is still connected
    (`joined`, for test_a_run_on_a_joined_cluster_releases_its_actors_and_leaves_the_callers_ray_connected)."""
    import ray
    import ray_session

    from moe_grpo.orchestrator.pools import join_ray
    from moe_grpo.orchestrator.process_record import left_behind
    from moe_grpo.orchestrator.training_run import train

    run_dir = tmp_path_factory.mktemp("resumed")
    resume_from_step_2(sync_run, run_dir)
    cut = (run_dir / "metrics.jsonl").read_text()
    resumed = {**SYNC, "steps": 7, "resume": True, "parallel.pipeline_parallel": 2, "cluster.learner_cpus": 0.5}
    with pytest.raises(ValueError) as refused:
        train(small_run(**resumed), run_dir)
    refusal = {"message": str(refused.value), "record_kept": (run_dir / "metrics.jsonl").read_text() == cut}
    join_ray(session_ray_address)
    plans: list[str] = []  # what the run logged of its placement plan: the layout it built
    handler = logging.Handler()
    handler.emit = lambda record: plans.append(record.getMessage()) if "training pool" in record.getMessage() else None
    logger, level = logging.getLogger("moe_grpo"), logging.getLogger("moe_grpo").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        total = ray.cluster_resources()["CPU"]
        summary = train(on_session_ray(small_run(**resumed, **{"learner.lr_decay_steps": 5})), run_dir)
        joined_plan = plans[-1] if plans else ""
        joined = {"connected": ray.is_initialized(), "groups": ray.util.placement_group_table(), "cpus": total}
        deadline = time.monotonic() + 30  # Ray hands a removed group's CPUs back a moment later (seen under load)
        while ray.available_resources().get("CPU") != total and time.monotonic() < deadline:
            time.sleep(0.5)
        joined["cpus_free"] = ray.available_resources().get("CPU")
        record = json.loads((run_dir / "processes.json").read_text())
        deadline = time.monotonic() + 30  # Ray reaps a killed actor's process a little after it is marked dead
        while (left := left_behind(record)) != {"processes": [], "shm": []} and time.monotonic() < deadline:
            time.sleep(1)
        joined["left"], joined["record"] = left, record
        logs = os.path.join(os.path.dirname(ray_session.current().log_path), "ray_logs")
        pids = [*record["learners"], *record["engines"].values()]
        joined["crashed"] = [path for pid in pids for path in glob.glob(os.path.join(logs, f"*-{pid}.err"))
                             if "Check failed" in open(path, errors="replace").read()]
        joined["rpc_base"] = ray.get(ray.remote(lambda: os.environ.get("VLLM_RPC_BASE_PATH")).remote(), timeout=60)
        joined["private_dir"] = ray_session.current().private_dir
        joined["plan"] = joined_plan
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        ray.shutdown()
    return run_dir, summary, refusal, joined


def test_a_killed_run_resumes_at_another_layout_repeats_the_uninterrupted_one_and_extending_it_is_a_choice(
        sync_run, resumed_run):
    """Killed after step 2's checkpoint (a half-written later checkpoint and a record cut mid-line left behind),
    saved on one learner rank and resumed at PP=2 (two learner ranks, two layers each, so the learner of a loop runs
    with pipeline stages too): Megatron reshards the weights and the Adam state, and
    steps 3-5 repeat the uninterrupted run. The layouts add the same numbers in another order, which the tolerance
    of `COMPUTED` covers. (One run checks both: a resume at the same layout is the case with nothing resharded.)

    The same resume also extends the run to `steps=7`. Would have caught: `steps=7 resume=true` stretched the cosine
    decay over the new `steps` mid-way, the learning rate jumping (and after a finished run it stopped with
    `ValueError: lr=0.0`). Extending is refused until `learner.lr_decay_steps` says which schedule the added steps
    follow; with it (here: 5, the saved schedule kept) the run continues: each step recorded once, steps 3-5 at the
    uninterrupted run's learning rate (the repeat fails otherwise), steps 6-7 at learner.min_lr=0. The other choice
    (stretching the schedule over the new steps, from a state whose learning rate reached 0) is checked on the
    learner in tests/learner/test_run_state.py and the refusal's warning in tests/orchestrator/test_run_checkpoint.py.
    (Until issue 30 this extension was a run of its own, from the finished run's step-5 checkpoint, stretched.)"""
    run_dir, summary, refusal, joined = resumed_run
    assert "2 learner ranks, Megatron TP=1 PP=2 DP=1" in joined["plan"], joined["plan"]
    assert re.search(r"learner.lr_decay_steps=5 keeps .* learner.lr_decay_steps=7 stretches", refusal["message"]), \
        refusal["message"]
    assert refusal["record_kept"], "refused before anything starts"
    want, got = rows_of(sync_run[0]), rows_of(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6, 7] and summary["steps"] == 7, "each step recorded once"
    assert [r["resume/from_step"] for r in got] == [-1, -1, 2, 2, 2, 2, 2]
    assert summary["resumed_from"] == 2, "the closing line counts this process's steps from there"
    # Step 5 is no longer the last, so it has no evaluation of its own: its row carries step 4's.
    assert_repeats(want, got, (3, 4))
    assert_repeats(want, got, (5,), sampled=SAMPLED[:-1])
    assert [s for s, _ in summary["evals"]] == [0, 2, 4, 6, 7]
    assert [r["eval/step"] for r in got[2:]] == [2, 4, 4, 6, 7]
    assert [r["learner/lr"] for r in got[2:5]] == pytest.approx([r["learner/lr"] for r in want[2:5]], rel=1e-12)
    assert want[4]["learner/lr"] == pytest.approx(0.0, abs=1e-12), "the first run's cosine ended at min_lr=0"
    assert [r["learner/lr"] for r in got[4:]] == pytest.approx([0.0] * 3, abs=1e-12), "the saved schedule, kept"
    check_clean_sync_rows(got[2:])


def test_a_run_on_a_joined_cluster_releases_its_actors_and_leaves_the_callers_ray_connected(resumed_run):
    """The resumed run joined the session's cluster (tests/ray_session.py), to which this process was connected
    before `train` (`cluster.ray_address`). Would have caught: the run's end calling `ray.shutdown()` on a connection
    it did not make (the caller's, here; the cluster itself when the caller started it), and its engine and learner
    actors and their placement group left on the cluster it joined (its CPUs held: the next run there cannot reserve
    them; the engine's and learner's processes alive), which only the end of the caller's job would have ended.
    (Until 2026-11-27 a one-step run of its own, tests/orchestrator/test_joined_cluster.py: issue 30.)"""
    joined = resumed_run[3]
    assert joined["connected"], "train ended the caller's connection to Ray"
    groups = joined["groups"]
    assert groups and {g["state"] for g in groups.values()} == {"REMOVED"}, groups
    assert joined["cpus_free"] == joined["cpus"], joined
    record = joined["record"]
    assert record["learners"] and record["engines"], record
    assert joined["left"] == {"processes": [], "shm": []}, joined["left"]
    # Ended quietly: no learner or engine worker aborted on a failed Ray check as it was killed (a call sent to an
    # actor being killed did that, printing a C++ stack trace at the end of every run on a joined cluster).
    assert not joined["crashed"], joined["crashed"]
    # The cluster serves the caller still, and a job that joined it by address gets the cluster's private directory
    # for vLLM's sockets (not the shared temp dir): what the run's engines got.
    assert joined["rpc_base"] == os.path.join(joined["private_dir"], "vllm"), joined


def test_resume_never_records_a_step_twice(sync_run, tmp_path):
    """Would have caught: `resume=true` where the run left its record but no checkpoint started from step 0 again
    and appended steps 1.. to the record (exit 0). Refused before anything starts."""
    from moe_grpo.orchestrator.training_run import train
    from moe_grpo.orchestrator.run_checkpoint import CheckpointError

    run_dir, _ = sync_run
    recorded = (run_dir / "metrics.jsonl").read_text()
    bare = tmp_path / "no_checkpoint"
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(recorded)
    with pytest.raises(CheckpointError, match=r"records 5 step\(s\) of an earlier run, but no checkpoint"):
        train(small_run(**SYNC, resume=True), bare)
    assert (bare / "metrics.jsonl").read_text() == recorded and not (bare / "checkpoints").exists()
