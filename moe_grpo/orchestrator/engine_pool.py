"""The inference pool as the driver sees it: engine handles, their load, served versions, requests in flight.

Every request the driver sends goes through `EnginePool.submit` and comes
back through `EnginePool.result`; that is how a failed engine is noticed and
repaired in one place:

- a request whose engine died (its vLLM process or its Ray actor) or hung
  (no answer within `rollout.request_timeout_s`) fails; its prompt goes back
  on the retry queue (`requests_resubmitted`), and the engine is restarted in
  its placement bundle: the vLLM engine inside the actor when the actor lives,
  a new actor in the same bundle when it does not;
- a restarted engine gets no work until it serves the newest published
  version (it restarts on the version it served, then takes the newest);
- an engine that fails more than `rollout.max_restarts` times within
  `rollout.restart_window_s` stops the run (`EngineFailedError`, naming it).

"Offer a version to the engines" lives here too (`offer` / `settle`): every
engine not already loading one is asked to load it between forward passes;
an engine that fails to load keeps its version and is offered the next.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from moe_grpo.awake_clock import awake_now

if TYPE_CHECKING:
    from moe_grpo.orchestrator.config import RolloutConfig

log = logging.getLogger("moe_grpo")


OFFER_BACKOFF_S = 5.0
"""Seconds before a version an engine failed to load is offered to it again."""


HARMLESS_LOAD_FAILURES = ("rolled back to version", "refused version", "already serves")
"""A failed weight load that left the engine serving its previous version whole (it is offered the version again).
Any other failure (its process dead, a load or rollback past its timeout: hung, part of a version loaded) restarts
the engine."""


class EngineFailedError(RuntimeError):
    """An engine failed more often than `rollout.max_restarts` allows; names the engine and its last failure."""


@dataclass
class Request:
    """One prompt the driver wants sampled: `kind` 'train' (a group), 'eval' (one greedy completion) or 'probe'
    (one sample at a given version, orchestrator/probe.py)."""

    kind: str
    example: Any
    seed: int | None = None
    index: int = 0
    """For 'eval': the example's position in the held-out set."""
    epoch: int = 0
    """The driver's rollback count when it was sent (results of an older epoch are thrown away)."""
    version: int = -1
    """For 'probe': the weight version it must be sampled at."""


@dataclass
class _InFlight:
    request: Request
    engine: str
    generation: int
    submitted: float
    """When it was sent, on the awake clock (`awake_now()`, as every time `check_hung` compares it with)."""


@dataclass
class EngineSlot:
    """One engine: its actor, the version it serves, and its health."""

    name: str
    bundle: int
    """Placement-group bundle the engine lives in (a replacement actor goes to the same one)."""
    handle: Any
    served: int = 0
    load: int = 0
    """Requests in flight on it."""
    generation: int = 0
    """Restarts so far: a request's failure restarts the engine only if it was sent to the current generation."""
    status: str = "up"
    """'up' (takes work), 'restarting' (vLLM or the actor starting again), 'catching_up' (loading the newest
    version before it takes work)."""
    pending: tuple[str, Any, float] | None = None
    """(what, ref, since) of a restart, replacement or catch-up load in progress; `since` on the awake clock."""
    applying: tuple[int, Any] | None = None
    """(version, ref) of a weight load offered while up (requests keep running)."""
    pid: int = 0
    """The vLLM process holding the model (what `processes.json` lists)."""
    offer_after: float = 0.0
    """Monotonic time before which no version is offered again (after a failed load)."""
    catching_up_to: int = 0
    """The version a 'catching_up' engine is loading."""
    failures: deque = field(default_factory=deque)
    """Times of recent failures (for `max_restarts` within `restart_window_s`)."""
    last_failure: str = ""


class EnginePool:
    """The engines, what runs on them, and their repair."""

    def __init__(self, slots: list[EngineSlot], rollout: RolloutConfig, make_engine: Callable[[int], Any],
                 start_timeout_s: float) -> None:
        self.slots = {s.name: s for s in slots}
        self.rollout, self.make_engine, self.start_timeout_s = rollout, make_engine, start_timeout_s
        self.in_flight: dict[Any, _InFlight] = {}
        self.retry: deque[Request] = deque()
        """Requests to send again (their engine failed, or they were in flight at checkpoint time)."""
        self.failed_probes: list[tuple[Request, str]] = []
        """(request, engine) of probe requests whose engine failed: never sent again (a probe is tied to its engine
        and version); the driver tells the probe."""
        self.published = 0
        self.restarts = 0
        self.requests_resubmitted = 0
        self.sync_failures = 0
        self.changed = True
        """Set when an engine's process changed (the driver rewrites `processes.json`)."""
        self.abandoned: list[Any] = []
        """Calls whose answer no longer matters (a load or restart of an engine that failed meanwhile): kept until
        they end and read then, or Ray prints each one's error as an "Unhandled error" traceback on the console."""
        self.stopping = False
        """Set when a SIGTERM asked the run to stop (Driver.on_signal): a failed engine is then left stopped, not
        restarted (the checkpoint the run stops at needs none). A SIGTERM to every process of the run (scancel)
        kills the engines with Ray's own processes: replacing an actor then waited 60 s on a dead GCS and the driver
        exited without its cleanup (a user's trial, 2026-11-28)."""

    # ------------------------------------------------------------------ state a checkpoint keeps
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the requests that were in flight (sent again after resume), the counters."""
        pending = [f.request for f in self.in_flight.values()] + list(self.retry)
        return {"requests": pending, "restarts": self.restarts, "requests_resubmitted": self.requests_resubmitted,
                "sync_failures": self.sync_failures, "served": {n: s.served for n, s in self.slots.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> int:
        """Queue the checkpoint's in-flight requests to be sent again; returns how many."""
        self.restarts = int(state.get("restarts", 0))
        self.requests_resubmitted = int(state.get("requests_resubmitted", 0))
        self.sync_failures = int(state.get("sync_failures", 0))
        requests = list(state.get("requests", []))
        self.retry.extend(requests)
        return len(requests)

    # ------------------------------------------------------------------ sending work
    def up(self) -> list[EngineSlot]:
        return [s for s in self.slots.values() if s.status == "up"]

    def submit(self, request: Request, sampling: Any, engine: str | None = None) -> bool:
        """Send `request` to the least-loaded engine that is up (to `engine`, if named and up); False when none is."""
        ready = [s for s in self.up() if engine is None or s.name == engine]
        if not ready:
            return False
        slot = min(ready, key=lambda s: s.load)
        ref = slot.handle.generate.remote(list(request.example.prompt_ids), sampling)
        self.in_flight[ref] = _InFlight(request, slot.name, slot.generation, awake_now())
        slot.load += 1
        return True

    def send(self, request: Request, sampling: Any) -> None:
        """`submit`, or queue `request` to be sent once an engine is up (`resend`)."""
        if not self.submit(request, sampling):
            self.retry.append(request)

    def queue(self, request: Request) -> None:
        """Queue `request` to be sent again (`resend`)."""
        self.retry.append(request)

    def resend(self, sampling: Callable[[Request], Any], epoch: int) -> None:
        """Send the queued requests while an engine is up, oldest first; those of an epoch before `epoch` (sampled
        for weights a rollback threw away) are dropped."""
        while self.retry and self.up():
            request = self.retry.popleft()
            if request.epoch == epoch:
                self.submit(request, sampling(request))

    def drop_queued(self, kind: str) -> None:
        """Forget the queued requests of `kind` (a rollback: its fresh prompts replace them)."""
        self.retry = deque(r for r in self.retry if r.kind != kind)

    def take_failed_probes(self) -> list[tuple[Request, str]]:
        """(request, engine) of the probe requests that failed since the last call (the driver tells the probe)."""
        failed, self.failed_probes = self.failed_probes, []
        return failed

    def take_changed(self) -> bool:
        """Whether an engine's process changed since the last call (the driver then rewrites `processes.json`)."""
        changed, self.changed = self.changed, False
        return changed

    def stats(self, timeout_s: float) -> dict[str, dict[str, float]]:
        """Each engine that is up and answers within `timeout_s`: its `stats()` (busy seconds, resubmissions). An
        engine that does not answer is left out: its failure is the pool's business (`result`, `check_hung`)."""
        import ray

        out = {}
        for slot in self.up():
            try:
                out[slot.name] = ray.get(slot.handle.stats.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - see above
                continue
        return out

    def in_flight_count(self, kind: str = "train") -> int:
        return sum(1 for f in self.in_flight.values() if f.request.kind == kind) + sum(
            1 for r in self.retry if r.kind == kind)

    def refs(self) -> list[Any]:
        """Everything the driver may wait on: requests, weight loads, restarts."""
        return list(self.in_flight) + self.refs_of_loads()

    def request_refs(self, kind: str) -> list[Any]:
        """The requests of one kind ('train', 'eval', 'probe') in flight."""
        return [ref for ref, flight in self.in_flight.items() if flight.request.kind == kind]

    # ------------------------------------------------------------------ results and failures
    def result(self, ref: Any) -> tuple[Request, str, list[Any]] | None:
        """(request, engine, completions) for a finished request; None if `ref` is not a request or it failed
        (then its request is queued again and its engine repaired). Also advances loads and restarts."""
        import ray

        if ref not in self.in_flight:
            self._advance(ref)
            return None
        flight = self.in_flight.pop(ref)
        slot = self.slots[flight.engine]
        slot.load -= 1
        try:
            return flight.request, flight.engine, ray.get(ref)
        except Exception as e:  # noqa: BLE001 - dead or hung engine (EngineError) or dead actor (RayActorError)
            if flight.request.kind == "probe":
                self.failed_probes.append((flight.request, flight.engine))
            else:
                self.retry.append(flight.request)
                self.requests_resubmitted += 1
            if flight.generation == slot.generation and slot.status == "up":
                self._fail(slot, _reason(e), actor_dead=isinstance(e, ray.exceptions.RayActorError))
            return None

    def check_hung(self) -> None:
        """An actor that has not answered a request well past the engine's own timeout is hung itself: replace it.

        Only a request whose answer has not arrived counts: one the engine answered that the driver has not
        collected yet (it was busy elsewhere) is the driver's delay, not the engine's."""
        import ray

        now = awake_now()  # a whole-job freeze is nobody's hang
        limit = self.rollout.request_timeout_s + 30.0
        overdue = [ref for ref, flight in self.in_flight.items() if now - flight.submitted > limit]
        answered = set(ray.wait(overdue, num_returns=len(overdue), timeout=0)[0]) if overdue else set()
        for ref in overdue:
            flight = self.in_flight[ref]
            slot = self.slots[flight.engine]
            if ref not in answered and flight.generation == slot.generation and slot.status == "up":
                self._fail(slot, f"a rollout has not returned after {now - flight.submitted:.0f} s "
                                 f"(rollout.request_timeout_s={self.rollout.request_timeout_s:.0f}); the engine actor "
                                 "is hung", actor_dead=True)
        for slot in self.slots.values():
            if slot.pending is not None and now - slot.pending[2] > self.start_timeout_s:
                what = slot.pending[0]
                self._abandon(slot)
                self._fail(slot, f"its {what} did not finish within {self.start_timeout_s:.0f} s", actor_dead=True)

    def _fail(self, slot: EngineSlot, reason: str, *, actor_dead: bool) -> None:

        now = time.monotonic()
        slot.failures.append(now)
        while slot.failures and now - slot.failures[0] > self.rollout.restart_window_s:
            slot.failures.popleft()
        slot.last_failure = reason
        if self.stopping:  # the checkpoint the run stops at needs no engine
            self._abandon(slot)
            slot.status = "stopped"
            log.warning("%s: %s; not restarted: the run is stopping", slot.name, reason)
            if all(s.status == "stopped" for s in self.slots.values()):  # nothing left to wait on (an evaluation)
                raise EngineFailedError(f"every engine died while the run was stopping (last: {slot.name}: {reason})")
            return
        if len(slot.failures) > self.rollout.max_restarts:
            raise EngineFailedError(
                f"{slot.name} failed {len(slot.failures)} times within {self.rollout.restart_window_s:.0f} s "
                f"(rollout.max_restarts={self.rollout.max_restarts}); last failure: {reason}")
        slot.generation += 1
        self._abandon(slot)
        slot.status = "restarting"
        self.restarts += 1
        log.warning("%s: %s; restarting it (%s, failure %d of at most %d within %.0f s); its %d request(s) in "
                    "flight are sent again", slot.name, reason, "new actor" if actor_dead else "new vLLM process",
                    len(slot.failures), self.rollout.max_restarts + 1, self.rollout.restart_window_s, slot.load)
        if actor_dead:
            self._replace(slot)
        else:
            slot.pending = ("restart", slot.handle.restart.remote(), awake_now())

    def _abandon(self, slot: EngineSlot) -> None:
        """Forget the slot's load and restart in progress (their engine failed), keeping their refs to read."""
        self.abandoned += [pair[1] for pair in (slot.applying, slot.pending) if pair is not None]
        slot.applying = slot.pending = None

    def read_abandoned(self) -> None:
        """Read the abandoned calls that ended (their errors were dealt with when their engine failed)."""
        import ray

        if self.abandoned:
            ended = ray.wait(self.abandoned, num_returns=len(self.abandoned), timeout=0)[0]
            for ref in ended:
                self.abandoned.remove(ref)
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - the failure it reports was handled as its engine's
                    pass

    def _replace(self, slot: EngineSlot) -> None:
        """A new engine actor in the dead one's placement bundle (it starts from the run's model directory).

        The old actor's vLLM processes die with it (process_ties); the new actor starts its vLLM only once nothing
        of the old one is left on its host, and fails naming the pids left if they stay (EngineWorker,
        `LEFTOVER_TIMEOUT_S`): that failure counts as the engine's next one."""
        import ray

        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        slot.handle = self.make_engine(slot.bundle)
        slot.served = 0
        slot.pending = ("replacement", slot.handle.pid.remote(), awake_now())

    def _advance(self, ref: Any) -> None:
        """A restart, replacement or weight load finished: move its engine on."""
        import ray

        for slot in self.slots.values():
            if slot.applying is not None and slot.applying[1] == ref:
                version, slot.applying = slot.applying[0], None
                try:
                    ray.get(ref)
                    slot.served = version
                except Exception as e:  # noqa: BLE001 - the engine keeps its version and is offered it again
                    self.sync_failures += 1
                    reason = _reason(e)
                    log.warning("%s did not take version %d: %s", slot.name, version, reason)
                    slot.offer_after = time.monotonic() + OFFER_BACKOFF_S
                    if isinstance(e, ray.exceptions.RayActorError):
                        self._fail(slot, reason, actor_dead=True)
                    elif not any(ok in reason for ok in HARMLESS_LOAD_FAILURES):  # dead, hung or half-loaded
                        self._fail(slot, reason, actor_dead=False)
                return
            if slot.pending is not None and slot.pending[1] == ref:
                what, slot.pending = slot.pending[0], None
                try:
                    out = ray.get(ref)
                except Exception as e:  # noqa: BLE001
                    self._fail(slot, f"its {what} failed: {_reason(e)}",
                               actor_dead=what != "catch-up" or isinstance(e, ray.exceptions.RayActorError))
                    return
                if what == "restart":
                    slot.served = int(out["policy_version"])
                    slot.pid = int(out["pid"])
                elif what == "replacement":
                    slot.pid = int(out)
                elif what == "catch-up":
                    slot.served = slot.catching_up_to
                if slot.served < self.published:
                    slot.status = "catching_up"
                    slot.catching_up_to = self.published
                    slot.pending = ("catch-up", slot.handle.apply_version.remote(
                        self.published, self.rollout.request_timeout_s), awake_now())
                else:
                    slot.status = "up"
                    self.changed = True
                    log.info("%s is back (vLLM process %d), serving version %d", slot.name, slot.pid, slot.served)
                return

    # ------------------------------------------------------------------ weight versions
    def offer(self, version: int) -> None:
        """Ask every engine that is up and not loading to load `version` between forward passes (one whose last
        load failed is asked again after `OFFER_BACKOFF_S`)."""
        self.published = max(self.published, version)
        now = time.monotonic()
        for slot in self.up():
            if slot.applying is None and slot.served < version and now >= slot.offer_after:
                slot.applying = (version, slot.handle.apply_version.remote(version, self.rollout.request_timeout_s))

    def settle(self, *, block: bool) -> None:
        """Collect finished loads and offer the newest version again to engines behind it (a failed load is not
        the end: without this an engine that missed a version would wait for the next publish, and in async mode
        the learner may be waiting for groups that engine must sample first); `block`: wait until every engine is
        up and serves the newest version."""
        import ray

        deadline = awake_now() + self.rollout.request_timeout_s + self.start_timeout_s
        while True:
            self.read_abandoned()
            for slot in self.slots.values():
                for pair in (slot.applying, slot.pending):
                    if pair is not None and ray.wait([pair[1]], timeout=0)[0]:
                        self._advance(pair[1])
            self.offer(self.published)
            if not block or self.all_current():
                return
            if awake_now() > deadline:
                late = [s.name for s in self.slots.values() if s.status != "up" or s.served < self.published]
                raise RuntimeError(f"{', '.join(late)}: not serving version {self.published} within "
                                   f"{self.rollout.request_timeout_s + self.start_timeout_s:.0f} s")
            refs = self.refs_of_loads()
            if refs:
                ray.wait(refs, num_returns=1, timeout=1.0)
            else:
                time.sleep(0.05)
            self.check_hung()

    def refs_of_loads(self) -> list[Any]:
        return [p[1] for s in self.slots.values() for p in (s.applying, s.pending) if p is not None]

    def all_current(self) -> bool:
        return all(s.status == "up" and s.served >= self.published and s.applying is None
                   for s in self.slots.values() if s.status != "stopped")

    def oldest_served(self) -> int:
        return min(s.served for s in self.slots.values())

    def handles(self) -> dict[str, Any]:
        return {n: s.handle for n, s in self.slots.items()}


def _reason(e: BaseException) -> str:
    """The line of an actor's error that says what went wrong (Ray wraps it in a header and a traceback)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    said = [line for line in lines if "Error:" in line]
    return (said[-1] if said else lines[0] if lines else type(e).__name__)[:400]
