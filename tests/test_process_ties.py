"""What an engine actor's processes do when the actor is SIGKILLed (pure process logic: no Ray, no vLLM, no model).

A stand-in for the engine actor starts a stand-in for vLLM's engine core with multiprocessing (spawn, what vLLM uses
inside a Ray actor, and fork, what it uses elsewhere), which starts a stand-in for a worker; both are SIGSTOPped
(so nothing of their own, such as vLLM's watch of its parent, can act), then the "actor" is SIGKILLed.
Would have caught: vLLM's engine core and workers outliving a killed engine actor (nothing but vLLM's own watch
ended them, which a stopped or wedged process never runs), and a replacement engine starting beside the previous
actor's processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moe_grpo.process_ties import TAG_ENV, LeftoverProcessesError, leftovers, owner_key, wait_until_gone

pytestmark = pytest.mark.slow  # each test starts and kills process trees
from moe_grpo.processes import process_alive, start_ticks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ACTOR = textwrap.dedent("""
    import contextlib, multiprocessing as mp, os, sys, threading, time
    sys.path.insert(0, {root!r})
    from moe_grpo.process_ties import started_processes_die_with_this_thread

    def worker(q=None):
        if q is not None:
            q.put(os.getpid())  # it runs: as vLLM's worker does once it answers its engine core
        time.sleep(120)

    def core(method, q):  # vLLM's engine core: starts its worker from its main thread
        mp.get_context(method).Process(target=worker, args=(q,), daemon=True).start()
        time.sleep(120)

    if __name__ == "__main__":
        method, tie = sys.argv[1], sys.argv[2] == "1"
        ctx = mp.get_context(method)
        q = ctx.Queue()
        # The engine's own loop thread starts the engine core (and lives on): as VllmEngine._astart does.
        started = []
        def start():
            with started_processes_die_with_this_thread() if tie else contextlib.nullcontext():
                p = ctx.Process(target=core, args=(method, q))
                p.start()
            started.append(p.pid)
            time.sleep(120)
        threading.Thread(target=start, daemon=True).start()
        other = ctx.Process(target=worker)  # started by another thread, outside the block: not tied
        other.start()
        worker_pid = q.get(timeout=120)
        print(started[0], worker_pid, other.pid, flush=True)
        time.sleep(120)
""")


def _run_actor(tmp_path, method: str, tie: bool) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / f"actor_{method}_{int(tie)}.py"
    script.write_text(ACTOR.format(root=ROOT))
    proc = subprocess.Popen([sys.executable, str(script), method, str(int(tie))], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3, f"the stand-in actor did not start its processes ({proc.poll()})"
    return proc, pids


def _alive_after(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if process_alive(p)]
    return alive


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_an_engines_processes_die_with_its_actor_even_when_stopped(tmp_path, method):
    proc, (core, worker, other) = _run_actor(tmp_path, method, tie=True)
    try:
        for pid in (core, worker):
            os.kill(pid, signal.SIGSTOP)
        proc.kill()
        proc.wait()
        assert _alive_after([core, worker], 5.0) == [], "the engine core or its worker outlived the actor"
        assert process_alive(other), "a process another thread started outside the block was tied too"
    finally:
        _kill([core, worker, other])


def test_without_the_tie_they_would_outlive_it(tmp_path):
    """The check sees orphans where they happen (what vLLM's engine core and worker were, stopped, before)."""
    proc, (core, worker, other) = _run_actor(tmp_path, "spawn", tie=False)
    try:
        for pid in (core, worker):
            os.kill(pid, signal.SIGSTOP)
        proc.kill()
        proc.wait()
        assert _alive_after([core, worker], 2.0) == [core, worker]
    finally:
        _kill([core, worker, other])


HOLDER = textwrap.dedent("""
    import subprocess, sys, time
    sys.path.insert(0, {root!r})
    from moe_grpo.process_ties import tag_processes
    tag_processes(sys.argv[1])
    kids = [subprocess.Popen(["sleep", "120"]) for _ in range(2)]  # untied: they stay when this one dies
    # Popen returns once the child's exec closed its pipe, which is before the kernel set up the new environment
    # block: /proc/<pid>/environ reads empty for that moment (seen once on a slow CI machine). Wait until the mark
    # is readable, so the test checks what a later holder finds, not the exec's timing.
    for k in kids:
        deadline = time.monotonic() + 30
        while {tag!r} not in open(f"/proc/{{k.pid}}/environ", "rb").read() and time.monotonic() < deadline:
            time.sleep(0.01)
    print(*[k.pid for k in kids], flush=True)
    time.sleep(120)
""")


def _holder(owner: str) -> tuple[subprocess.Popen, list[int]]:
    script = HOLDER.format(root=ROOT, tag=TAG_ENV.encode())
    proc = subprocess.Popen([sys.executable, "-c", script, owner], stdout=subprocess.PIPE, text=True)
    return proc, [int(p) for p in proc.stdout.readline().split()]


def test_a_new_holder_finds_the_previous_ones_processes_and_waits_for_them():
    owner = owner_key("/runs/x", f"engine-{os.getpid()}")
    assert leftovers(owner) == []
    assert wait_until_gone(owner, "engine0", timeout_s=1.0) == []  # nothing to wait for: at once
    holder, kids = _holder(owner)
    try:
        # Its actor still alive (being killed): nothing is killed, the wait ends in an error naming every pid.
        found = leftovers(owner)
        assert {p.pid for p in found} == {*kids, holder.pid}, found
        with pytest.raises(LeftoverProcessesError) as e:
            wait_until_gone(owner, "engine0", timeout_s=0.5, kill_after_s=0.0)
        assert "engine0" in str(e.value) and all(str(p) in str(e.value) for p in [*kids, holder.pid])
        assert all(process_alive(p) for p in kids), "processes of a live actor were killed"
        holder.kill()
        holder.wait()
        # Its actor dead, its processes left: named at the timeout...
        assert {p.pid for p in leftovers(owner)} == set(kids)
        with pytest.raises(LeftoverProcessesError, match="engine0: processes of its previous actor still there"):
            wait_until_gone(owner, "engine0", timeout_s=0.3)
        # ...waited for until they go...
        t0 = time.monotonic()
        threading_kill = subprocess.Popen(["sh", "-c", f"sleep 1; kill -9 {kids[0]}"])
        with pytest.raises(LeftoverProcessesError):
            wait_until_gone(owner, "engine0", timeout_s=3.0)  # the other one stays
        threading_kill.wait()
        assert time.monotonic() - t0 >= 3.0
        # ...or SIGKILLed after `kill_after_s`, and then it returns what it found. Both limits count from `since`
        # (an engine actor's start, its imports done beside the leftovers): 30 s of it passed, the kill is at once.
        t0 = time.monotonic()
        assert [p.pid for p in wait_until_gone(owner, "engine0", timeout_s=40.0, kill_after_s=30.0,
                                               since=t0 - 30.0)] == kids[1:]
        assert time.monotonic() - t0 < 5.0, "the kill waited its limit again from the call"
        assert leftovers(owner) == [] and _alive_after(kids, 1.0) == []
    finally:
        holder.kill()
        _kill(kids)


def test_the_next_holder_removes_what_a_killed_one_recorded_in_dev_shm_and_nothing_else(tmp_path, monkeypatch):
    """Would have caught: a SIGKILLed engine actor's ring buffers (`psm_*`, ~400 MiB) left in /dev/shm for good
    (multiprocessing's resource tracker, which would remove them, went with the actor)."""
    from moe_grpo.process_ties import TAG_ENV, forget_shm, record_shm, remove_previous_shm, tag_processes

    owner = owner_key(str(tmp_path), "engine0")
    names = [f"psm_moe_grpo_test_{os.getpid()}_{i}" for i in range(3)]
    for name in names:
        open(f"/dev/shm/{name}", "w").close()
    try:
        monkeypatch.setenv(TAG_ENV, f"{owner}/1/1")  # the killed actor
        record_shm(owner, str(tmp_path), {n: os.stat(f"/dev/shm/{n}").st_ino for n in names[:2]})
        os.unlink(f"/dev/shm/{names[1]}")  # gone and its name taken by another job's entry: not ours to remove
        open(f"/dev/shm/{names[1]}", "w").close()
        assert remove_previous_shm(owner, str(tmp_path)) == [], "a holder does not remove its own"
        tag_processes(owner)  # the replacement
        assert remove_previous_shm(owner, str(tmp_path)) == [names[0]]
        assert not os.path.exists(f"/dev/shm/{names[0]}")
        assert os.path.exists(f"/dev/shm/{names[1]}") and os.path.exists(f"/dev/shm/{names[2]}")
        assert os.listdir(tmp_path) == [], "the record goes with what it named"
        record_shm(owner, str(tmp_path), {})
        forget_shm(owner, str(tmp_path))
        assert os.listdir(tmp_path) == []
    finally:
        for name in names:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_at_the_end_of_a_run_every_holders_record_is_acted_on(tmp_path, monkeypatch):
    """An engine killed, or restarting, when the run ended has no next holder: its record lay in the run's weight
    slots, which the cleanup removed with the record unread, leaving its ring buffers in /dev/shm (a run whose
    engine core died as the run stopped, 2026-11-28). `remove_recorded_shm` reads every record there."""
    from moe_grpo.process_ties import TAG_ENV, record_shm, remove_recorded_shm

    names = [f"psm_moe_grpo_test_{os.getpid()}_end_{i}" for i in range(3)]
    for name in names:
        open(f"/dev/shm/{name}", "w").close()
    try:
        for i, engine in enumerate(("engine0", "engine1")):
            owner = owner_key(str(tmp_path), engine)
            monkeypatch.setenv(TAG_ENV, f"{owner}/1/1")
            record_shm(owner, str(tmp_path), {names[i]: os.stat(f"/dev/shm/{names[i]}").st_ino})
        monkeypatch.delenv(TAG_ENV)  # the driver
        (tmp_path / "bucket_0").write_bytes(b"")  # a weight slot's file: not a record
        assert remove_recorded_shm(str(tmp_path)) == names[:2]
        assert [os.path.exists(f"/dev/shm/{n}") for n in names] == [False, False, True]
        assert os.listdir(tmp_path) == ["bucket_0"]
        assert remove_recorded_shm(str(tmp_path / "gone")) == [], "a directory already removed: nothing to do"
        (tmp_path / "moe_grpo-owner-odd.json").write_text("[1, 2]")  # not a record: skipped, no sweep fails on it
        assert remove_recorded_shm(str(tmp_path)) == []
    finally:
        for name in names:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_a_relay_agent_removes_what_dead_engines_recorded_and_leaves_live_ones(tmp_path, monkeypatch):
    """On a host other than the driver's, the run's weight buffers (where its engines keep their records) are
    removed by the relay agent while that host's engines still run: it removes what engines no longer alive
    recorded (killed as the run ended) and leaves a live engine's entries to that engine's own shutdown. Would
    have caught: every record there removed unread (the driver's cleanup never sees another host's)."""
    from moe_grpo.process_ties import TAG_ENV, record_shm, remove_recorded_shm

    names = [f"psm_moe_grpo_test_{os.getpid()}_agent_{i}" for i in range(2)]
    for name in names:
        open(f"/dev/shm/{name}", "w").close()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holders = {"engine0": f"{owner_key(str(tmp_path), 'engine0')}/1/1",  # killed
                   "engine1": f"{owner_key(str(tmp_path), 'engine1')}/{live.pid}/{start_ticks(live.pid)}"}
        for i, (engine, tag) in enumerate(holders.items()):
            monkeypatch.setenv(TAG_ENV, tag)
            record_shm(owner_key(str(tmp_path), engine), str(tmp_path), {names[i]: os.stat(f"/dev/shm/{names[i]}").st_ino})
        monkeypatch.delenv(TAG_ENV)  # the agent
        assert remove_recorded_shm(str(tmp_path), dead_holders_only=True) == names[:1]
        assert [os.path.exists(f"/dev/shm/{n}") for n in names] == [False, True]
        live.kill()
        live.wait()
        assert remove_recorded_shm(str(tmp_path), dead_holders_only=True) == names[1:], "once that engine is gone"
    finally:
        live.kill()
        for name in names:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
