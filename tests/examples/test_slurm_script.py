"""examples/slurm/train.sbatch's node handling, run against a fake SLURM: fake `srun` / `scontrol` (bash scripts that
record their calls and run each node's command here), a fake `ray start --block` per node, a fake `ray` module for
the join check and a stand-in driver. What is real: the batch script, ray_cluster.sh and wait_for_nodes.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
FAKES = Path(__file__).resolve().parent / "fake_slurm"
NODES = ["node01", "node02", "node03"]
pytestmark = pytest.mark.slow  # each test runs the job script and its processes on fake nodes


@pytest.mark.parametrize("script", ["train.sbatch", "ray_cluster.sh"])
def test_the_scripts_parse(script):
    out = subprocess.run(["bash", "-n", str(ROOT / "examples" / "slurm" / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _signals_as_slurm_leaves_them() -> None:
    """SIGINT and SIGQUIT at their defaults in the job's shell, as slurmstepd starts a batch script. A suite started
    in the background from a script (`pytest ... &`: bash ignores both in background commands) would otherwise pass
    them on ignored, and bash can neither trap nor reset a signal ignored on entry: the SIGINT test then timed out
    (twice in whole-suite pairs started that way, never in the foreground)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class Job:
    """One run of train.sbatch on the fake cluster, in its own process group (killed whole at the end)."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.state = tmp_path / "state"
        for sub in ("joined", "pids"):
            (self.state / sub).mkdir(parents=True)
        self.env = {**os.environ, "PATH": f"{FAKES / 'bin'}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONPATH": str(FAKES / "python"), "PYTHON": sys.executable, "RAY": str(FAKES / "bin" / "ray"),
                    "MOE_GRPO_TRAIN": str(FAKES / "bin" / "driver"), "MOE_GRPO_DIR": str(ROOT),
                    "SLURM_JOB_NODELIST": "node[01-03]", "FAKE_NODES": " ".join(NODES), "FAKE_STATE": str(self.state),
                    "NET_IFNAME": "ib0", "RAY_JOIN_TIMEOUT_S": "20", "RAY_STOP_TIMEOUT_S": "5",
                    "RAY_DRIVER_STOP_S": "5", **env}
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_HEAD_IP"):
            if key not in env:
                self.env.pop(key, None)
        self.proc: subprocess.Popen | None = None

    def start(self, *args: str) -> "Job":
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(["bash", str(SBATCH), *args], env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=_signals_as_slurm_leaves_them)
        return self

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        assert self.proc is not None
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:  # what the job had done, for a failure nobody can rerun
            alive = [p for p in (self.state / "pids").iterdir()] if (self.state / "pids").is_dir() else []
            raise AssertionError(f"the job did not end within {timeout} s; driver.log: {self.read('driver.log')!r}; "
                                 f"its stderr so far: {e.stderr!r}; pid files: {[p.name for p in alive]}") from e
        finally:
            self.kill()
        self.seconds = time.monotonic() - self.t0
        return self.proc.returncode, out, err

    def kill(self) -> None:
        """Whatever of this job is left (nothing, when the script cleaned up): its process group, by id."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def read(self, name: str) -> str:
        path = self.state / name
        return path.read_text() if path.exists() else ""

    def wait_for(self, name: str, text: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.read(name):
            assert self.proc.poll() is None, f"the job ended early: {self.proc.communicate()}"
            assert time.monotonic() < deadline, f"{text!r} not in {name} within {timeout} s"
            time.sleep(0.1)

    def ray_alive(self) -> list[str]:
        """Nodes whose fake `ray start` still runs."""
        alive = []
        for pid_file in (self.state / "pids").iterdir():
            try:
                os.kill(int(pid_file.read_text()), 0)
                alive.append(pid_file.name)
            except ProcessLookupError:
                pass
        return alive


def test_a_job_starts_ray_on_every_node_waits_for_them_runs_the_driver_and_takes_ray_down(tmp_path):
    job = Job(tmp_path).start("model=deepseek_moe", "steps=3")
    rc, out, err = job.finish()
    assert rc == 0, err
    srun = sorted(job.read("srun.log").splitlines())  # the workers' sruns start together, in any order
    assert srun == ["node01 --nodes=1 --ntasks=1 --overlap -w node01 bash -c ray_node_start head",
                    "node02 --nodes=1 --ntasks=1 --overlap -w node02 bash -c ray_node_start worker",
                    "node03 --nodes=1 --ntasks=1 --overlap -w node03 bash -c ray_node_start worker"]
    ray = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in job.read("ray.log").splitlines()
           if not line.endswith("stopped")}
    ports = ("--node-manager-port=6380 --object-manager-port=6381 --min-worker-port=10002 --max-worker-port=10999 "
             "--runtime-env-agent-port=6383 --dashboard-agent-grpc-port=6384 --dashboard-agent-listen-port=6385 "
             "--metrics-export-port=6386")
    assert ray["node01"] == (f"start --block --disable-usage-stats {ports} --node-ip-address=10.0.0.1 --head "
                             "--port=6379 --ray-client-server-port=6382 --include-dashboard=false")
    assert ray["node03"] == (f"start --block --disable-usage-stats {ports} --node-ip-address=10.0.0.3 "
                             "--address=10.0.0.1:6379")
    driver = job.read("driver.log")
    assert "args: cluster=slurm cluster.ray_address=10.0.0.1:6379 model=deepseek_moe steps=3" in driver
    assert "env: NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0 RAY_AUTH_MODE=token token_chars=64" in driver
    assert "finished" in driver
    assert "all 3 node(s) joined the Ray cluster at 10.0.0.1:6379" in out
    assert job.ray_alive() == [] and job.read("ray.log").count("stopped") == 3, "Ray is taken down on exit"
    assert "Ray stopped on node01 node02 node03" in err


def test_a_node_whose_srun_dies_fails_the_running_job_at_once_naming_it(tmp_path):
    job = Job(tmp_path, FAKE_DEAD_NODE="node02", FAKE_DIE_AFTER="3", FAKE_DRIVER_S="120").start()
    rc, out, err = job.finish()
    ended = time.time()
    assert rc == 1, err
    assert "node node02: its srun (ray worker) ended with status 7; failing the job" in err
    died_at = float(job.read("died_at"))
    assert ended - died_at < 5 + 2, f"the job took {ended - died_at:.1f} s to fail after node02's srun died"
    assert "started" in job.read("driver.log") and "TERM" in job.read("driver.log"), "the driver is stopped"
    assert job.ray_alive() == [], "the other nodes' Ray is taken down"


def test_a_node_that_dies_before_joining_fails_the_job_before_the_driver_starts(tmp_path):
    job = Job(tmp_path, FAKE_DEAD_NODE="node03", FAKE_DIE_AFTER="1", FAKE_NO_JOIN="node03").start()
    rc, out, err = job.finish()
    assert rc == 1, err
    assert "node node03: its srun (ray worker) ended with status 7" in err
    assert "the Ray cluster did not come up" in err
    assert job.seconds < 15, f"{job.seconds:.1f} s"
    assert job.read("driver.log") == "" and job.ray_alive() == []


def test_a_node_that_never_joins_fails_the_job_after_the_join_timeout_naming_it(tmp_path):
    job = Job(tmp_path, FAKE_NO_JOIN="node03", RAY_JOIN_TIMEOUT_S="2").start()
    rc, out, err = job.finish()
    assert rc == 1, err
    assert "2 of 3 node(s) joined the Ray cluster at 10.0.0.1:6379 within 2 s; not joined: node03" in err
    assert job.read("driver.log") == "" and job.ray_alive() == []


def test_sigterm_before_the_time_limit_reaches_the_driver(tmp_path):
    """SLURM's `--signal=B:TERM@120` signals the batch shell only; the script forwards it to the driver, whose exit
    status (143 after its checkpoint) is the job's."""
    job = Job(tmp_path, FAKE_DRIVER_S="120").start()
    job.wait_for("driver.log", "started")
    job.proc.send_signal(signal.SIGUSR1)  # checkpoint and go on
    job.wait_for("driver.log", "USR1")
    job.proc.send_signal(signal.SIGTERM)
    rc, out, err = job.finish()
    assert rc == 143, err
    assert "SIGUSR1: forwarded to the driver" in err and "SIGTERM: forwarded to the driver" in err
    assert job.read("driver.log").splitlines()[-2:] == ["USR1", "TERM"]
    assert job.ray_alive() == []


def test_sigint_reaches_the_driver_started_in_the_background(tmp_path):
    """Would have caught: the driver, started with `&` from the batch script, inherited SIGINT ignored (bash's rule
    for background commands without job control; Python keeps an ignored SIGINT), so a forwarded SIGINT did
    nothing and the job ran on."""
    job = Job(tmp_path, FAKE_DRIVER_S="120").start()
    job.wait_for("driver.log", "started")
    job.proc.send_signal(signal.SIGINT)
    rc, out, err = job.finish(timeout=30)
    assert "SIGINT: forwarded to the driver" in err
    assert job.read("driver.log").splitlines()[-1] == "INT", job.read("driver.log")
    assert rc == 130, err
    assert job.ray_alive() == []


def test_a_loopback_head_address_is_refused_on_several_nodes_saying_to_set_net_ifname(tmp_path):
    """Would have caught: without NET_IFNAME the head's address came from `hostname --ip-address`, 127.0.1.1 on a
    stock Debian/Ubuntu /etc/hosts; the workers were told to join 127.0.1.1:6379 and never did (the job waited
    RAY_JOIN_TIMEOUT_S and failed naming the nodes, not the cause)."""
    job = Job(tmp_path, NET_IFNAME="", RAY_JOIN_TIMEOUT_S="5").start()
    rc, out, err = job.finish()
    assert rc == 1, err
    assert ("the head (node01)'s address is 127.0.1.1, a loopback address (`hostname --ip-address` on a stock "
            "Debian/Ubuntu /etc/hosts): the other nodes cannot reach Ray there and would never join. Set NET_IFNAME "
            "to the interface the nodes share") in err
    assert job.read("srun.log") == "" and job.read("driver.log") == "", "nothing started"
    assert job.seconds < 5


def test_a_worker_with_a_loopback_address_fails_naming_it_and_a_one_node_job_may_use_loopback(tmp_path):
    """RAY_HEAD_IP given by hand, NET_IFNAME not: each node's own Ray address (`--node-ip-address`) still comes
    from `hostname --ip-address`; the node refuses it and its srun's end fails the job at once, naming it. A one-node
    job has nobody to reach it: loopback is fine there."""
    job = Job(tmp_path, NET_IFNAME="", RAY_HEAD_IP="10.0.0.1").start()
    rc, out, err = job.finish()
    assert rc == 1, err
    assert "[ray_cluster] node01's address is 127.0.1.1, a loopback address" in err
    assert "node node01: its srun (ray head) ended with status 2" in err
    assert job.read("driver.log") == "" and job.seconds < 10
    alone = Job(tmp_path / "one", NET_IFNAME="", SLURM_JOB_NODELIST="node01", FAKE_NODES="node01").start()
    rc, out, err = alone.finish()
    assert rc == 0, err
    assert "cluster.ray_address=127.0.1.1:6379" in alone.read("driver.log")


def test_the_driver_is_told_the_warning_time_of_the_signal(tmp_path):
    """The placement plan compares a checkpoint's write time with it (MOE_GRPO_SIGNAL_S): this script's
    `#SBATCH --signal=B:TERM@120`, or SBATCH_SIGNAL when sbatch was given another."""
    job = Job(tmp_path).start()
    assert job.finish()[0] == 0
    assert "signal_s: 120" in job.read("driver.log")
    other = Job(tmp_path / "other", SBATCH_SIGNAL="B:TERM@600").start()
    assert other.finish()[0] == 0
    assert "signal_s: 600" in other.read("driver.log")
