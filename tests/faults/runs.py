"""Running `python -m moe_grpo.train` as a user does, in its own process, and doing to it what clusters do."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

import ray_session  # tests/ray_session.py
from moe_grpo.orchestrator.process_record import left_behind

ROOT = Path(__file__).resolve().parents[2]

SMALL = ["model=deepseek_moe", "warm_start_steps=2", "eval_every=0", "algo.prompts_per_step=4", "algo.group_size=4",
         "rollout.max_tokens=8", "rollout.max_num_seqs=32"]
"""A run small enough for the suite: the embedded model, 4 prompts x 4 samples a step."""


class Run:
    """One `python -m moe_grpo.train` process writing into `run_dir`.

    It joins the test session's Ray cluster (tests/ray_session.py, `cluster.ray_address`): a run starting Ray of its
    own spends ~5 s more. `own_ray=True` starts a cluster of the run's own instead, as a user's run without
    `cluster.ray_address` does: for a test of that start, of its stop, or of the run's own Ray processes, listeners
    or private directory (with MOE_GRPO_TEST_SESSION_RAY=0 every Run does). `kill()` ends the driver's process
    group: on the session cluster the run's actors are not in it, and Ray ends them once it sees their driver gone
    (`leftovers` sees them until then). `extra_env`: variables added to the run's environment (its reward workers
    inherit them)."""

    def __init__(self, run_dir: Path, *overrides: str, own_ray: bool | None = None,
                 extra_env: dict[str, str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.log_path = self.run_dir.parent / f"{self.run_dir.name}.{int(time.time() * 1000)}.log"
        self._log = open(self.log_path, "w")
        self.started = time.time()
        own_ray = not ray_session.enabled() if own_ray is None else own_ray
        self.session = None if own_ray else ray_session.address()
        joined = [] if own_ray else [f"cluster.ray_address={self.session}"]
        cmd = [sys.executable, "-m", "moe_grpo.train", *SMALL, *joined, *overrides, f"hydra.run.dir={self.run_dir}"]
        env = {**os.environ, **({} if own_ray else ray_session.join_env()), **(extra_env or {}),
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "faults"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.seen_pids: set[int] = set()

    @property
    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def processes(self) -> dict:
        try:
            return json.loads((self.run_dir / "processes.json").read_text())
        except (OSError, ValueError):
            return {}

    def note_descendants(self) -> None:
        """Remember every process the run has started so far (to check none is left after it ends)."""
        try:
            self.seen_pids.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, what: str, predicate, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.note_descendants()
            if predicate():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited ({self.proc.returncode}) before {what}:\n{self.output[-4000:]}")
            time.sleep(0.5)
        raise AssertionError(f"no {what} within {timeout_s:.0f} s:\n{self.output[-4000:]}")

    def wait_step(self, step: int, timeout_s: float = 600) -> None:
        self.wait_for(f"step {step}", lambda: any(r["step"] >= step for r in self.rows()), timeout_s)

    def finish(self, timeout_s: float = 900) -> int:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the run did not end within {timeout_s:.0f} s:\n{self.output[-4000:]}") from None
        self._log.close()
        return self.proc.returncode

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        """SIGKILL the whole process group (what a node failure or `scancel --signal=KILL` does)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=60)

    def leftovers(self, timeout_s: float = 30) -> list[str]:
        """Processes of this run still alive `timeout_s` after it ended (waiting: Ray reaps its workers late): those
        the run recorded in processes.json (every process it had, through the end of its cleanup), those this test
        saw below the driver while it waited (a run killed before it wrote the record) and, on the session's
        cluster, every process there started since the run began but Ray's idle workers (an actor's process is
        below the cluster's raylet, not the driver, and the record names only the learner ranks' and vLLM's)."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = {line.split()[0]: line for line in left_behind(self.processes())["processes"]}
            alive.update({line.split()[0]: line for line in self._on_the_session_cluster()})
            for pid in sorted(self.seen_pids):
                try:
                    p = psutil.Process(pid)
                    if p.status() != psutil.STATUS_ZOMBIE:
                        alive.setdefault(str(pid), f"{pid} {' '.join(p.cmdline())[:120]}")
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return sorted(alive.values())
            time.sleep(1)

    def _on_the_session_cluster(self) -> list[str]:
        cluster = ray_session.current()
        if self.session is None or cluster is None or cluster.address != self.session:
            return []
        out = []
        for line in cluster.processes():
            pid = int(line.split()[0])
            try:
                started = psutil.Process(pid).create_time()
            except psutil.Error:
                continue
            if pid not in cluster.pids and started >= self.started - 1 and "ray::IDLE" not in line:
                out.append(line)
        return out

    def shm_left(self) -> list[str]:
        """The /dev/shm entries and weight slots the run recorded as its own that are still there, held by a live
        process or not (`shm_left_behind` cannot see those a leaked live process holds)."""
        return left_behind(self.processes())["shm"]


def shm_in_use() -> set[str]:
    """Names under /dev/shm that a live process has mapped or open (another job's engine on a shared machine,
    say): what a finished run left behind is what nobody holds any more."""
    held = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                held |= {line.split("/dev/shm/", 1)[1].split(" (deleted)")[0].strip() for line in f if "/dev/shm/" in line}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return held


def shm_left_behind(before: set[str]) -> set[str]:
    """Entries added to /dev/shm since `before` that no live process holds (another job's are held). Blind to an entry
    a leaked live process of the run holds: `Run.shm_left` checks those, against the run's own record."""
    return shm_entries() - before - shm_in_use()


def shm_entries() -> set[str]:
    """What is in /dev/shm (the run's weight slots live under moe_grpo_sync_<uid>/run-<pid>-...)."""
    out = set(os.listdir("/dev/shm"))
    root = Path("/dev/shm") / f"moe_grpo_sync_{os.getuid()}"
    if root.is_dir():
        out |= {f"{root.name}/{p}" for p in os.listdir(root)}
    return out
