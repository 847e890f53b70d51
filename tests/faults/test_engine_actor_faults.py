"""An engine's Ray actor process is SIGKILLed mid-run (not its vLLM engine core): the engine core and its worker die
with it, and the replacement actor starts its vLLM only once nothing of the old actor is left on the host.

One run of `python -m moe_grpo.train` (async, one engine). After step 2 the test SIGSTOPs the engine's vLLM
processes (so vLLM's own watch of its parent, threads in those processes, cannot act: only the kernel's tie to the
actor can end them), starts a stand-in for a process of the old actor that nothing ties to it (a `sleep` carrying
the actor's mark), and SIGKILLs the actor.
Would have caught: vLLM's processes outliving their actor (they relied on vLLM's watch, which a stopped or wedged
process never runs), and a replacement started in the same bundle while the old processes (their GPU memory,
their /dev/shm ring buffers) were still there.
"""

import os
import signal
import subprocess
import time

import psutil
import pytest

from runs import Run

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 6
TAG_ENV = "MOE_GRPO_OWNER"  # moe_grpo.process_ties.TAG_ENV: read from the engine core's environment, as a user would


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _shm_mapped(pids: list[int]) -> set[tuple[str, int]]:
    inodes = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            inodes |= {int(line.split()[4]) for line in f if "/dev/shm/psm_" in line}
    out = set()
    for name in os.listdir("/dev/shm"):
        if name.startswith("psm_"):
            try:
                if os.stat(f"/dev/shm/{name}").st_ino in inodes:
                    out.add((name, os.stat(f"/dev/shm/{name}").st_ino))
            except FileNotFoundError:
                pass
    return out


def _gone(pid: int, started: float) -> bool:
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - started) > 1e-3 or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _shm_there(entries: set[tuple[str, int]]) -> bool:
    for name, ino in entries:
        try:
            if os.stat(f"/dev/shm/{name}").st_ino == ino:
                return True
        except FileNotFoundError:
            pass
    return False


@pytest.fixture(scope="module")
def actor_killed(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("engine_actor_killed") / "run", f"steps={STEPS}", "mode=async",
              "checkpoint.every=0")
    straggler, old = None, {}
    try:
        run.wait_step(2)
        worker = psutil.Process(run.processes()["engines"]["engine0"])
        core = worker.parent()
        actor = core.parent()
        old = {p.pid: p.create_time() for p in [core, worker] + core.children(recursive=True)}
        shm = _shm_mapped(list(old))
        mark = _environ(core.pid).get(TAG_ENV)
        assert mark, f"vLLM's engine core carries no {TAG_ENV} mark of its actor"
        straggler = subprocess.Popen(["sleep", "300"], env={**os.environ, TAG_ENV: mark})
        for pid in old:
            os.kill(pid, signal.SIGSTOP)
        killed_at = time.time()
        os.kill(actor.pid, signal.SIGKILL)
        seen: dict[str, float] = {}
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            now = time.time()
            if "processes" not in seen and all(_gone(p, t) for p, t in old.items()):
                seen["processes"] = now
            if "shm" not in seen and not _shm_there(shm):
                seen["shm"] = now
            if "straggler" not in seen and straggler.poll() is not None:
                seen["straggler"] = now
            new = run.processes().get("engines", {}).get("engine0")
            if new not in (None, 0, worker.pid):
                break
            assert run.proc.poll() is None, run.output[-4000:]
            time.sleep(0.05)
        else:
            raise AssertionError(f"no replacement engine0 within 400 s:\n{run.output[-4000:]}")
        new_core = psutil.Process(new).parent()
        replacement = {"core_started": new_core.create_time(), "pid": new}
        code = run.finish(900)
    except BaseException:
        run.kill()
        raise
    finally:
        for pid, t in old.items():
            if not _gone(pid, t):
                os.kill(pid, signal.SIGKILL)
        if straggler is not None and straggler.poll() is None:
            straggler.kill()
    return run, code, killed_at, seen, replacement, straggler, shm


def test_the_run_finishes_with_the_engine_replaced(actor_killed):
    run, code, *_ = actor_killed
    assert code == 0, run.output[-4000:]
    rows = run.rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["faults/engine_restarts"] == 1, [r["faults/engine_restarts"] for r in rows]
    assert "new actor" in run.output, run.output[-4000:]


def test_the_engine_core_and_worker_died_with_their_actor(actor_killed):
    """Stopped, so vLLM's own watch never ran: within 5 s (before the replacement's own SIGKILL of what is left,
    LEFTOVER_KILL_AFTER_S after its process starts) only the kernel's tie can have ended them."""
    _, _, killed_at, seen, _, _, shm = actor_killed
    assert "processes" in seen and seen["processes"] - killed_at < 5.0, seen


def test_the_replacement_started_only_after_the_old_actors_processes_were_gone(actor_killed):
    run, _, _, seen, replacement, straggler, shm = actor_killed
    assert shm and "shm" in seen, "the old engine's ring buffers were still in /dev/shm when the replacement started"
    assert straggler.returncode == -signal.SIGKILL, "the replacement did not end the process its tie missed"
    assert replacement["core_started"] > max(seen["processes"], seen["shm"], seen["straggler"]), (seen, replacement)
    assert f"{straggler.pid}" in run.output and "of its previous actor" in run.output, run.output[-4000:]
