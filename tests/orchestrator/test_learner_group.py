"""The learner ranks as the driver and the probe reach them (`LearnerGroup`): the data-parallel split, and the one
rule for waiting on a call, on real Ray actors standing in for the ranks (no Megatron, no model).

What a user would notice: a batch is split among the data-parallel ranks; a rank that dies, raises or hangs during
any call stops the run with an error naming the rank and the call (and the checkpoint to resume from), never a
run that waits forever or an error that does not say which rank."""

import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from moe_grpo.orchestrator.learner_group import LearnerFailedError, LearnerGroup, RankInfo, failure_line


def infos(*coords):
    return [RankInfo(rank=r, dp=dp, dp_size=dp_size) for r, (dp, dp_size) in enumerate(coords)]


def test_each_data_parallel_rank_gets_every_dp_size_th_item_and_model_parallel_peers_the_same_share():
    """The split the driver wrote twice as `seqs[i["dp"]::i["dp_size"]]` (a training step, the warm start): 4 ranks
    as TP=2 x DP=2 (ranks 0 and 1 form data-parallel rank 0)."""
    group = LearnerGroup([None] * 4, infos((0, 2), (0, 2), (1, 2), (1, 2)), timeout_s=60.0)
    assert group.split(list("abcde")) == [["a", "c", "e"], ["a", "c", "e"], ["b", "d"], ["b", "d"]]
    assert group.split([]) == [[], [], [], []]


def test_rank_info_is_typed_from_what_a_rank_reports_and_refused_without_its_data_parallel_coordinates():
    info = RankInfo.of(1, {"tp": 1, "tp_size": 2, "dp": 0, "dp_size": 1, "parameters": 10, "pid": 42, "host": "h",
                           "something_new": 3})
    assert (info.rank, info.tp, info.dp_size, info.pid, info.host) == (1, 1, 1, 42, "h")
    with pytest.raises(ValueError, match=r"learner rank 2 reported \['tp'\]: expected .*\['dp', 'dp_size'\]"):
        RankInfo.of(2, {"tp": 0})


ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray(session_ray_address):
    """This process joins the test session's Ray cluster (tests/ray_session.py); the module's actors end with it."""
    from moe_grpo.orchestrator.pools import join_ray

    join_ray(session_ray_address)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class FakeRank:
    """A learner rank's actor: `publish` returns, raises or sleeps as `behaviour` says ("init_raise": building it
    raises, as a learner refusing its settings does)."""

    def __init__(self, dp, dp_size, behaviour="ok"):
        if behaviour == "init_raise":
            raise ValueError("TP=2 x EP=2 on gloo needs the allgather dispatcher; set megatron.token_dispatcher=allgather")
        self.dp, self.dp_size, self.behaviour = dp, dp_size, behaviour

    def info(self):
        return {"dp": self.dp, "dp_size": self.dp_size, "pid": os.getpid(), "host": socket.gethostname()}

    def publish(self, version, background, snapshot):
        if self.behaviour == "raise":
            raise ValueError(f"version {version}: no shards to write")
        if self.behaviour == "hang":
            time.sleep(3600)

    def train(self, seqs, step, replay):
        return {"seqs": list(seqs), "step": step}


def start(*behaviours, timeout_s=60.0):
    actors = [FakeRank.remote(r, len(behaviours), b) for r, b in enumerate(behaviours)]
    group = LearnerGroup.start(actors, timeout_s=timeout_s, start_timeout_s=120.0, where="test")
    group.hint = lambda: "last checkpoint: step_000002"
    return group


@pytest.mark.slow
def test_a_step_goes_out_in_data_parallel_shares_and_a_killed_rank_is_named_with_its_call(local_ray):
    """Before LearnerGroup, the start-up's calls (warm start, publish, export) and `finish_step` were raw `ray.get`:
    a rank that died there gave Ray's ActorDiedError, which names an actor id, not the rank, the call or the
    checkpoint to resume from."""
    group = start("ok", "hang")
    assert [i.dp for i in group.infos] == [0, 1] and all(i.pid for i in group.infos)
    step = group.submit("train", 4, "r3", shares=group.split([10, 11, 12]), what="step 5")
    assert step.wait() == [{"seqs": [10, 12], "step": 4}, {"seqs": [11], "step": 4}]
    call = group.submit("publish", 3, False, False, what="publishing 3")
    assert not call.poll(timeout=1.0), "rank 1 is still writing"
    group.oom_since = None  # no OOM note whatever the machine's OOM killer does meanwhile
    ray.kill(group.actors[1], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(LearnerFailedError, match=rf"learner rank 1 \(pid {group.infos[1].pid}\) died during "
                                                 r"publishing 3; last checkpoint: step_000002"):
        call.wait()
    assert time.monotonic() - t0 < 30, "named when Ray saw it die, not at the call's timeout"


@pytest.mark.slow
def test_a_rank_that_raises_or_hangs_is_named_and_a_gone_process_at_once_whatever_ray_says(local_ray):
    """A rank that raised is named with its error's last line; ranks that do not answer within the limit are named
    (before: the start-up's raw `ray.get` waited forever); a rank whose process on this host is gone is named at
    the next poll even while Ray still counts its actor alive (a child it forked can hold Ray's connection open)."""
    group = start("raise", "ok")
    with pytest.raises(LearnerFailedError, match=r"learner rank 0 failed during publishing 7: .*ValueError: version 7: "
                                                 r"no shards to write; last checkpoint: step_000002"):
        group.publish(7, background=False, snapshot=False)

    group = start("ok", "hang", timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(LearnerFailedError, match=r"learner rank\(s\) \[1\] did not finish publishing 8 within "
                                                 r"cluster.learner_timeout_s=2 s"):
        group.publish(8, background=False, snapshot=False)
    assert time.monotonic() - t0 < 10

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    hung = LearnerGroup(group.actors, [group.infos[0], RankInfo(1, 1, 2, pid=int(gone.stdout), host=socket.gethostname())],
                        timeout_s=600.0)
    with pytest.raises(LearnerFailedError, match=rf"learner rank 1 \(pid {int(gone.stdout)}\) died during publishing 9"):
        hung.publish(9, background=False, snapshot=False)


@pytest.mark.slow
def test_a_rank_whose_learner_cannot_be_built_is_named_with_the_reason(local_ray):
    """A rank's actor raising while it builds its learner (Megatron refusing a setting) stopped the run with "learner
    rank 0 (pid ?) died during starting": the reason was only in Ray's worker logs (a trial at TP=2 x EP=2, 2026-11-28)."""
    with pytest.raises(LearnerFailedError, match=r"learner rank 0 failed during starting \(test\): .*ValueError: TP=2 x "
                                                 r"EP=2 on gloo needs the allgather dispatcher; set "
                                                 r"megatron.token_dispatcher=allgather; no run checkpoint"):
        start("init_raise", "ok")


@pytest.mark.slow
def test_the_start_up_publish_of_a_hung_rank_stops_the_run_naming_it(local_ray):
    """`InitialWeights` (warm start or load, then the initial publish and export, before the engines start) waited
    on raw `ray.get` with no limit: a rank hung in the initial publish held the run's start-up forever. Now it is
    named after `cluster.learner_timeout_s`."""
    from moe_grpo.checkpoint.hf_init import InitConfig
    from moe_grpo.orchestrator.initial_weights import InitialWeights
    from moe_grpo.orchestrator.state import RunState

    group = start("ok", "hang", timeout_s=2.0)
    run = SimpleNamespace(warm_start=0, routing=SimpleNamespace(probe_prompts=0, probe_every=1),
                          algo=SimpleNamespace(sync_every=1, kl_coef=0.0), init=InitConfig())
    with pytest.raises(LearnerFailedError, match=r"learner rank\(s\) \[1\] did not finish publishing 0 within "
                                                 r"cluster.learner_timeout_s=2 s"):
        InitialWeights(run, "/nonexistent", None, None, RunState())(group)


def test_a_ranks_error_line_carries_the_operating_systems_cause():
    """A full disk under a checkpoint: the run's message gave torch's last line ("unexpected pos 704 vs 598") and
    "No space left on device" appeared only in the cleanup's warnings (a user's trial, 2026-11-28)."""
    text = ("ray::LearnerWorker.checkpoint() (pid=1, ip=1)\n  File \"x.py\", line 3, in write\n"
            "OSError: [Errno 28] No space left on device: '/run/checkpoints/step_15.tmp/learner/0_0.distcp'\n\n"
            "During handling of the above exception, another exception occurred:\n"
            "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598\n")
    assert failure_line(text) == ("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 "
                                  "(cause: OSError: [Errno 28] No space left on device: "
                                  "'/run/checkpoints/step_15.tmp/learner/0_0.distcp')")
    assert failure_line("ValueError: bad value\n") == "ValueError: bad value"
