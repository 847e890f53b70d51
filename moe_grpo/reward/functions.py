"""Calling reward functions: loaded by dotted path, weighted, plain or async, each call under a timeout.

A function that raises, times out, returns the wrong number of values or a
value that is not a finite number marks those samples failed: their reward is
NaN, the caller counts them (`reward/failed`) and leaves them out of training.
A function that cannot be imported is a configuration error and fails the run
at start, naming it.

Each function runs in worker processes of its own (a fresh interpreter, so it
inherits none of the driver's Ray or torch state), started once and serving
calls over a socket pair: `workers` of them per function, so that many batches
are scored at once (`Rewards.submit` runs them off the caller's thread). A call
not back within `reward.timeout_s` has its worker killed (with anything the
worker started), so a hung function holds nothing: the next call gets a fresh
worker, and the run ends without waiting on it. A worker that dies during a call (a segfault, `os._exit`) fails that call's
samples, naming its exit code, and is replaced the same way.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import json
import logging
import math
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from queue import LifoQueue
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from moe_grpo.awake_clock import awake_now  # it imports only the standard library

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("moe_grpo")
# numpy is imported where it is used: the workers import this module and need only the standard library.

START_TIMEOUT_S = 60.0
"""How long a worker may take to start (a fresh interpreter importing the function), on top of reward.timeout_s
for the call itself."""


def load_function(path: str) -> Callable[..., Any]:
    """`package.module:function` (the function may be an attribute path: `module:Class.method`)."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is a config error naming the path
        raise ImportError(f"reward.fn={path!r}: cannot import {module_name!r} ({type(e).__name__}: {e})") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"reward.fn={path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward.fn={path!r} is a {type(obj).__name__}, expected a function")
    return obj


@dataclass
class RewardFunction:
    name: str
    fn: Callable[..., Any]
    weight: float
    accepts: frozenset[str] | None = None
    """Keyword arguments the function names (None: it takes **kwargs, so every row field)."""

    @classmethod
    def load(cls, path: str, weight: float = 1.0) -> "RewardFunction":
        fn = load_function(path)
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = None
        accepts = None
        if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            accepts = frozenset(p.name for p in params)
        return cls(path, fn, float(weight), accepts)


@dataclass
class Scores:
    """Weighted rewards of a batch of samples; NaN where a function failed."""

    rewards: np.ndarray
    errors: list[str] = field(default_factory=list)

    @property
    def failed(self) -> np.ndarray:
        return ~np.isfinite(self.rewards)


class Rewards:
    """The run's reward functions (`reward.fn` / `reward.weights`), called with one timeout each.

    The functions are imported here too (a bad path fails at construction, naming it), but each is called in worker
    processes of its own, `workers` per function: a call takes one worker of each function (a "lane"), sends them
    the batch at once, and each answers within `timeout_s` of its request or is killed. `score` calls and waits;
    `submit` calls on a thread of the pool and returns a Future, so the caller's loop never waits on a reward.
    `close()` kills the workers without waiting on any call."""

    def __init__(self, paths: Sequence[str], weights: Sequence[float], timeout_s: float = 30.0,
                 workers: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers={workers}, expected >= 1")
        self.functions = [RewardFunction.load(p, w) for p, w in zip(paths, weights)]
        self.timeout_s = timeout_s
        self.failures_reported = 0
        """Calls whose failure was logged (reward/scoring.py logs the first few of a run)."""
        self._lanes = [[_Worker(rf.name) for rf in self.functions] for _ in range(workers)]
        # Lanes free to take a call (a worker serves one call at a time), the most recently used first: a steady
        # stream of calls keeps to the fewest warm workers, and a function that hangs every n-th call of a worker
        # does not hang on every lane at once.
        self._idle: LifoQueue[int] = LifoQueue()
        for lane in range(workers):
            self._idle.put(lane)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")
        self._closed = False
        # Workers of a Rewards dropped without close() (or alive at interpreter exit) are killed all the same.
        self._finalizer = weakref.finalize(self, _close, [w for lane in self._lanes for w in lane], self._pool)
        for w in (w for lane in self._lanes for w in lane):  # they start while the run sets up
            try:
                w.start()
            except OSError as e:  # out of processes or memory, say: the first call tries again and fails by name
                log.warning("reward.fn=%r: could not start its worker process yet (%s)", w.path, e)

    @property
    def workers(self) -> int:
        """Worker processes per function (calls scored at once)."""
        return len(self._lanes)

    def close(self) -> None:
        """Kills the workers (never waits on a call; safe to call twice, or from another thread mid-call)."""
        self._closed = True
        self._finalizer()

    def submit(self, prompts: Sequence[str], completions: Sequence[str],
               fields: Mapping[str, Sequence[Any]] | None = None) -> "Future[Scores]":
        """`score` on a thread of the pool; the Future holds its Scores (never an exception: failures are NaN)."""
        return self._pool.submit(self.score, list(prompts), list(completions),
                                 {k: list(v) for k, v in (fields or {}).items()})

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              fields: Mapping[str, Sequence[Any]] | None = None) -> Scores:
        """The weighted reward per sample; a sample is NaN (failed) when any function failed on it."""
        n = len(completions)
        total = np.zeros(n, np.float64)
        cols = {k: list(v) for k, v in (fields or {}).items()}
        prompts, completions = list(prompts), list(completions)
        errors: list[str | None] = [None] * len(self.functions)
        values: list[list[float] | None] = [None] * len(self.functions)
        lane = self._idle.get()
        workers = self._lanes[lane]
        try:
            deadlines: dict[int, float] = {}
            for i, (rf, w) in enumerate(zip(self.functions, workers)):
                kwargs = cols if rf.accepts is None else {k: v for k, v in cols.items() if k in rf.accepts}
                try:
                    if self._closed:
                        raise RuntimeError("the reward functions were closed")
                    w.send((prompts, completions, kwargs, n))
                    deadlines[i] = awake_now() + self.timeout_s
                except Exception as e:  # noqa: BLE001 - a reward failure costs its samples, not the run
                    errors[i] = _describe(rf, e)
            for i, deadline in deadlines.items():
                try:
                    values[i] = workers[i].receive(deadline, self.timeout_s)
                except Exception as e:  # noqa: BLE001
                    errors[i] = _describe(self.functions[i], e)
        finally:
            self._idle.put(lane)
        for i, rf in enumerate(self.functions):
            if errors[i] is not None:
                total[:] = np.nan
                continue
            v = np.asarray(values[i], np.float64)
            bad = ~np.isfinite(v)
            if bad.any():
                errors[i] = f"{rf.name}: {int(bad.sum())} of {n} values not finite (NaN/inf/None)"
            total += rf.weight * v
        return Scores(total, [e for e in errors if e is not None])


class _CallFailed(Exception):
    """A call's failure as the worker (or its death) describes it: 'ExceptionType: message'."""


def _describe(rf: RewardFunction, e: Exception) -> str:
    """'path: ExceptionType: message' (kept as text: an exception kept would keep the frames that raised it)."""
    return f"{rf.name}: {e}" if isinstance(e, _CallFailed) else f"{rf.name}: {type(e).__name__}: {e}"


class _Worker:
    """One reward function's worker process: a fresh interpreter (`_serve`) that imports the function and answers
    calls over a socket pair; killed with its process group when a call times out or the run ends, and started
    again by the next call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.poller: Any = None  # kept: a Connection.poll per call would build a selector each time
        self.ready = False  # its 'ready' message was read
        self.busy = False  # a call was sent and its answer not read (its caller was interrupted)
        self.closed = False  # by Rewards.close(): no new worker starts
        self._swap = threading.Lock()  # start() and kill() may race when close() comes from another thread

    def start(self) -> None:
        ours, theirs = Pipe(duplex=True)  # a socket pair; the child gets its end by descriptor
        # The worker dies with this process: it watches its parent pid, and where this is the main thread (the
        # kernel's parent-death signal follows the thread that started the child), by PR_SET_PDEATHSIG too.
        deathsig = threading.current_thread() is threading.main_thread()
        path = json.dumps([os.fspath(p) for p in sys.path if isinstance(p, (str, os.PathLike))])
        try:
            with self._swap:
                if self.closed:
                    ours.close()
                    raise RuntimeError("the reward functions were closed")
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_MAIN, path, str(theirs.fileno()), self.path, str(os.getpid()),
                     "1" if deathsig else "0"],
                    stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), start_new_session=True)
                self.conn, self.ready, self.busy = ours, False, False
                self.poller = select.poll()
                self.poller.register(ours.fileno(), select.POLLIN)
        finally:
            theirs.close()

    def kill(self, close: bool = False) -> None:
        """SIGKILL to the worker's process group (the worker and whatever it started), reaped; never blocks long."""
        with self._swap:
            self.closed = self.closed or close
            proc, conn = self.proc, self.conn
            self.proc, self.conn, self.poller, self.ready, self.busy = None, None, None, False, False
        if conn is not None:
            conn.close()
        if proc is None:
            return
        if proc.returncode is None:  # not reaped yet, so its pid (= its process group) is still its own
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:  # stuck in the kernel; the kill lands when it can
            pass

    def _live(self) -> tuple[Connection, Any, subprocess.Popen]:
        conn, poller, proc = self.conn, self.poller, self.proc
        if conn is None or poller is None or proc is None:
            raise RuntimeError("the reward functions were closed")
        return conn, poller, proc

    def send(self, request: tuple) -> None:
        payload = pickle.dumps(request, pickle.HIGHEST_PROTOCOL)  # an unpicklable row field fails here, not later
        if self.busy:  # an earlier call's answer was never read: it would be taken for this one's
            self.kill()
        for attempt in (0, 1):
            if self.conn is None:
                self.start()
            conn, poller, proc = self._live()
            if not self.ready:
                self._wait_ready(conn, poller, proc)
            try:
                conn.send_bytes(payload)
            except OSError:
                if attempt == 0 and not self.closed:  # it died between calls: this call never started; a fresh one
                    self.kill()
                    continue
                self._died(proc, "while taking the call")
            self.busy = True
            return

    def receive(self, deadline: float, timeout_s: float) -> list[float]:
        conn, poller, proc = self._live()
        try:
            if not _readable_by(poller, deadline):
                self.kill()
                raise _CallFailed(f"TimeoutError: did not return within reward.timeout_s={timeout_s:g} s "
                                  f"(its worker process was killed; the next call starts a fresh one)")
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._died(proc, "during the call")
        self.busy = False
        if status == "err":
            raise _CallFailed(value)
        return value

    def _wait_ready(self, conn: Connection, poller: Any, proc: subprocess.Popen) -> None:
        try:
            if not _readable(poller, START_TIMEOUT_S):
                self.kill()
                raise _CallFailed(f"RewardWorkerError: its worker process did not start within {START_TIMEOUT_S:g} s")
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._died(proc, "while starting")
        if status != "ready":
            self.kill()
            raise _CallFailed(f"RewardWorkerError: its worker process could not load it: {value}")
        self.ready = True

    def _died(self, proc: subprocess.Popen, when: str) -> None:
        if self.closed:
            raise RuntimeError("the reward functions were closed")
        try:
            code = proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
        if code is None:
            how = "closed its connection"
        elif code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-code).name} (exit code {code})"
            except ValueError:
                how = f"exited with code {code}"
        else:
            how = f"exited with code {code}"
        raise _CallFailed(f"RewardWorkerDied: its worker process {how} {when} (the next call starts a fresh one)")


def _readable(poller: Any, timeout_s: float) -> bool:
    """Whether the worker has answered (or closed its end) within timeout_s."""
    return bool(poller.poll(max(0, math.ceil(timeout_s * 1000))))


def _readable_by(poller: Any, deadline: float) -> bool:
    """Whether the worker answers before `deadline` on the awake clock: polled in slices, so a freeze of the whole
    job across the wait (the worker stopped with everything else) does not count as the call's time. An answer
    already there counts even past the deadline (its call's deadline ran out while another call was waited on)."""
    while True:
        left = deadline - awake_now()
        if _readable(poller, min(max(left, 0.0), 0.5)):
            return True
        if left <= 0:
            return False


def _close(workers: list[_Worker], pool: ThreadPoolExecutor) -> None:
    """Kill every worker (a call in flight then fails at once) and let the pool's threads go; waits on nothing."""
    for w in workers:
        w.kill(close=True)
    pool.shutdown(wait=False, cancel_futures=True)


_WORKER_MAIN = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
                "from moe_grpo.reward.functions import _serve; _serve(*sys.argv[2:])")
"""What a worker runs: the driver's sys.path (so it imports what the driver imports), then `_serve`."""


def _first_for_the_oom_killer() -> None:
    """Ray starts its workers (the engines', the learner ranks') with oom_score_adj 1000, so under memory pressure the
    kernel killed them before a reward worker leaking memory (a user's trial, 2026-11-28: a reward keeping 200 MB a
    call took the engine and the learner down, and the run blamed the learner). A reward worker asks for the same
    (raising it needs no privilege): the kernel then picks the largest, and a reward worker's death costs only its
    calls' samples (counted, the next call starts a fresh one)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:  # not Linux, or /proc read-only: the kernel's default order stands
        pass


def _serve(fd: str, path: str, parent: str, deathsig: str) -> None:
    """A worker's life: load the function, then answer (prompts, completions, kwargs, n) with ('ok', floats) or
    ('err', 'Type: message') until the driver closes its end (or dies)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it kills the workers
    parent_pid = int(parent)
    if deathsig == "1":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
        except Exception:  # noqa: BLE001 - not Linux: the watcher thread below still notices
            pass
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch_parent() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch_parent, name="watch-parent", daemon=True).start()
    _first_for_the_oom_killer()
    conn = Connection(int(fd))
    try:
        fn = load_function(path)
    except BaseException as e:  # noqa: BLE001 - told to the driver, which names the function
        conn.send_bytes(pickle.dumps(("err", f"{type(e).__name__}: {e}")))
        os._exit(1)
    conn.send_bytes(pickle.dumps(("ready", None)))
    loop = None
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)
        try:
            prompts, completions, kwargs, n = pickle.loads(request)
            out = fn(prompts, completions, **kwargs)
            if inspect.isawaitable(out):  # an async function (or a plain one that returned a coroutine)
                if loop is None:
                    loop = asyncio.new_event_loop()  # the worker's own, kept across calls
                    asyncio.set_event_loop(loop)
                out = loop.run_until_complete(out)
            reply = ("ok", _as_floats(out, n))
        except BaseException as e:  # noqa: BLE001 - SystemExit too: a reward failure costs its samples
            reply = ("err", f"{type(e).__name__}: {e}")
        try:
            conn.send_bytes(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))
        except OSError:  # the driver is gone
            os._exit(0)


def _as_floats(out: Any, n: int) -> list[float]:
    """The n values as floats; None is NaN (that sample failed). A value that is no number (a string, even "0.5",
    an object) fails the whole call, naming it: the function is wrong, not that sample."""
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise TypeError(f"returned {type(out).__name__}, expected a list of {n} floats")
    if len(out) != n:
        raise ValueError(f"returned {len(out)} values for {n} completions")
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(math.nan)
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            values.append(float(v))
        except (TypeError, ValueError):
            raise TypeError(f"returned {repr(v)[:40]} ({type(v).__name__}) at position {i}, expected numbers "
                            "(None marks one sample failed)") from None
    return values
