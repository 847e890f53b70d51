"""The training pool as the driver sees it: the learner rank actors, each rank's coordinates, the data-parallel
split of a batch, and the one rule for waiting on a call to the ranks.

Every call the driver and the mismatch probe make to a learner rank goes through a `LearnerGroup`: `call` (send
and wait) or `submit` (send now; the returned `LearnerCall` is polled and collected later: a training step, a
probe). Waiting on a call follows one rule, whoever waits:

- a rank whose actor died (Ray says so, or its process on this host is gone) is named at once;
- a rank whose call raised is named with the error's last line;
- ranks not done within the call's timeout (`cluster.learner_timeout_s`) are named.

Each error is a `LearnerFailedError` that names the rank and what it was doing, and ends with `hint()` (the driver
sets it: the last run checkpoint to resume from).
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

from moe_grpo.awake_clock import awake_now
from moe_grpo.processes import oom_kills, oom_note, process_alive

T = TypeVar("T")

NO_CHECKPOINT_HINT = "no run checkpoint was written yet"

POLL_S = 1.0
"""While `call` waits, how often it looks for a rank whose process is gone (Ray may not notice: `_check_alive`)."""


class LearnerFailedError(RuntimeError):
    """A learner rank died, raised, or did not answer in time; names the rank, the call and the last checkpoint."""

    def __init__(self, message: str, *, died: bool = False) -> None:
        super().__init__(message)
        self.died = died
        """Whether the rank's process died (a kill, a signal), rather than raised or hung."""


@dataclass(frozen=True)
class RankInfo:
    """One learner rank: its place in each Megatron group and its process (what `LearnerWorker.info` reports)."""

    rank: int
    """Its rank in the learners' torch.distributed world."""
    dp: int
    """Its data-parallel rank: which share of a batch it trains on."""
    dp_size: int
    """Data-parallel ranks (a batch is split into this many shares)."""
    tp: int = 0
    tp_size: int = 1
    pp: int = 0
    pp_size: int = 1
    ep: int = 0
    ep_size: int = 1
    parameters: int = 0
    """Parameters this rank holds."""
    pid: int | None = None
    """Its process (the actor's), on `host`."""
    host: str = ""

    @classmethod
    def of(cls, rank: int, info: dict[str, Any]) -> RankInfo:
        """The rank's `LearnerWorker.info()` as a `RankInfo` (keys it does not know are left out)."""
        missing = [k for k in ("dp", "dp_size") if k not in info]
        if missing:
            raise ValueError(f"learner rank {rank} reported {sorted(info)}: expected its data-parallel coordinates "
                             f"{missing} too")
        known = {f.name for f in dataclasses.fields(cls)} - {"rank"}
        return cls(rank=rank, **{k: v for k, v in info.items() if k in known})


@dataclass
class LearnerCall:
    """A call sent to learner ranks (rank order); `poll`, `wait` and `results` apply the group's one rule."""

    group: LearnerGroup
    what: str
    """What the ranks are doing, as errors name it ('step 4', 'publishing 3')."""
    refs: list[Any]
    deadline: float
    timeout: str
    """The limit as errors name it ('cluster.learner_timeout_s=1800')."""

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether every rank has answered (waiting up to `timeout` seconds); raises `LearnerFailedError` naming a
        rank that died or raised, or the ranks still out past the call's deadline."""
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        for ref in done:  # a dead rank is named at once, before the others time out in their collectives
            self.group._result(ref, self.refs.index(ref), self.what)
        if len(done) == len(self.refs):
            return True
        self.group._check_alive(self.what)
        if awake_now() > self.deadline:
            late = [r for r, ref in enumerate(self.refs) if ref not in done]
            raise LearnerFailedError(f"learner rank(s) {late} did not finish {self.what} within {self.timeout} s "
                                     f"(a hung collective?); {self.group.hint()}")
        return False

    def results(self) -> list[Any]:
        """Each rank's answer, rank order (call once `poll` said every rank answered, or after `wait`)."""
        return [self.group._result(ref, rank, self.what) for rank, ref in enumerate(self.refs)]

    def wait(self) -> list[Any]:
        """Block until every rank answered; each rank's answer (the rule as in `poll`)."""
        while not self.poll(timeout=POLL_S):
            pass
        return self.results()


class LearnerGroup:
    """The learner ranks of a run: their actors (rank order), their `RankInfo`, and every call to them."""

    def __init__(self, actors: Sequence[Any], infos: Sequence[RankInfo], timeout_s: float,
                 oom_since: int | None = None) -> None:
        """`timeout_s`: how long a call may take (`cluster.learner_timeout_s`). `oom_since`: this host's OOM kills
        before the ranks started (None: now)."""
        self.actors = list(actors)
        self.infos = list(infos)
        self.timeout_s = timeout_s
        self.oom_since = oom_kills() if oom_since is None else oom_since
        """This host's OOM-kill count before the ranks started: a rank here that died names the OOM killer when it
        has ended processes since."""
        self.hint: Callable[[], str] = lambda: NO_CHECKPOINT_HINT
        """What the run can go on from, said at the end of every failure (the driver's last checkpoint)."""

    @classmethod
    def start(cls, actors: Sequence[Any], *, timeout_s: float, start_timeout_s: float, where: str) -> LearnerGroup:
        """The group of freshly made rank actors, once each has built its learner and reported its coordinates
        (within `start_timeout_s`; `where`: the rendezvous, for the error)."""
        starting = cls(actors, [], timeout_s)
        infos = starting.submit("info", what=f"starting ({where})", timeout_s=start_timeout_s,
                                timeout_name="cluster.start_timeout_s").wait()
        return cls(actors, [RankInfo.of(rank, info) for rank, info in enumerate(infos)], timeout_s,
                   starting.oom_since)

    def __len__(self) -> int:
        return len(self.actors)

    @property
    def dp_size(self) -> int:
        return self.infos[0].dp_size

    def pids(self) -> list[int | None]:
        return [i.pid for i in self.infos]

    # ------------------------------------------------------------------ the data-parallel split
    def split(self, items: Sequence[T]) -> list[list[T]]:
        """Each rank's share of `items`, rank order: every `dp_size`-th item from its `dp` rank on (ranks that
        differ only in tensor, pipeline or expert rank get the same share)."""
        return [list(items[i.dp::i.dp_size]) for i in self.infos]

    # ------------------------------------------------------------------ calls
    def submit(self, method: str, *args: Any, what: str, shares: Sequence[Any] | None = None,
               ranks: int | None = None, timeout_s: float | None = None,
               timeout_name: str = "cluster.learner_timeout_s") -> LearnerCall:
        """Send `method(*args)` to every rank (the first `ranks` only, if given); with `shares`, rank r gets
        `method(shares[r], *args)` (its part of the data, `split`). `timeout_s` replaces the group's limit for this
        call (`timeout_name` says which setting it is)."""
        actors = self.actors[:ranks]
        if shares is not None and len(shares) != len(actors):
            raise ValueError(f"{method}: {len(shares)} shares for {len(actors)} learner rank(s); expected one each")
        refs = [getattr(a, method).remote(*((shares[r],) if shares is not None else ()), *args)
                for r, a in enumerate(actors)]
        limit = self.timeout_s if timeout_s is None else timeout_s
        return LearnerCall(self, what, refs, awake_now() + limit, f"{timeout_name}={limit:.0f}")

    def call(self, method: str, *args: Any, what: str, **options: Any) -> list[Any]:
        """`submit`, then wait for every rank's answer (rank order)."""
        return self.submit(method, *args, what=what, **options).wait()

    def publish(self, version: int, *, background: bool, snapshot: bool) -> None:
        """Every rank writes its shards as `version` (`background`: returns once started, overlapped with the next
        step); `snapshot`: each keeps a copy of the weights for the mismatch probe of `version`."""
        self.call("publish", version, background, snapshot, what=f"publishing {version}")

    # ------------------------------------------------------------------ the rule
    def _result(self, ref: Any, rank: int, what: str) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            if getattr(e, "actor_init_failed", False):  # its __init__ raised: the reason is in the error, say it
                raise LearnerFailedError(f"learner rank {rank} failed during {what}: {failure_line(str(e))}; "
                                         f"{self.hint()}") from e
            raise self._rank_died(rank, what) from e
        except ray.exceptions.RayTaskError as e:
            raise LearnerFailedError(f"learner rank {rank} failed during {what}: {failure_line(str(e))}; "
                                     f"{self.hint()}") from e

    def _check_alive(self, what: str) -> None:
        """Name a learner rank on this host whose process is gone, whatever Ray says. Ray learns of a dead actor
        when its connection closes, and a child the actor forked keeps it open: megatron-core's checkpoint writer
        forks one per write bucket, so a rank SIGKILLed while writing a checkpoint would otherwise leave its call
        pending until cluster.learner_timeout_s. (Ranks on other hosts: by Ray's word or that timeout.)"""
        here = socket.gethostname()
        for info in self.infos:
            if info.host == here and isinstance(info.pid, int) and not process_alive(info.pid):
                raise self._rank_died(info.rank, what)

    def _rank_died(self, rank: int, what: str) -> LearnerFailedError:
        info = self.infos[rank] if rank < len(self.infos) else None
        pid = info.pid if info is not None and info.pid is not None else "?"
        here = info is not None and info.host in ("", socket.gethostname())  # the count is this host's
        oom = oom_note(self.oom_since) if here else ""
        return LearnerFailedError(f"learner rank {rank} (pid {pid}) died during {what}{oom}; {self.hint()}",
                                  died=True)


def failure_line(text: str) -> str:
    """A rank's error in one line: its last line, and the operating system's error where one lies deeper in the
    traceback. A full disk under a checkpoint surfaced as torch's "unexpected pos 704 vs 598", with "No space left
    on device" only in the cleanup's warnings (a user's trial, 2026-11-28)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    last = lines[-1] if lines else text
    cause = next((line for line in lines if "[Errno" in line or "No space left on device" in line), None)
    return f"{last} (cause: {cause})" if cause and cause not in last else last
