"""The health ledger: which shards serve, which join a weight sync, which are restarted.

Owns: the shards' states, records and counters, the transition table and every operation on it;
admission (who the routers may use: :class:`Admission` and its hold table, :class:`Holds`).
Must not: do I/O, read the clock (one is injected) or know asyncio, sockets or files.

Two rules, as in h11's ``_state.py``:

* Everything that decides a shard's state lives in this file. The router, the watchdog and the
  supervisor only *report* evidence here; they never decide.
* This file does no I/O. It does not know about asyncio, sockets or files; time comes from an
  injected clock. Callers feed operations in and read state out, and subscribe to the
  :class:`Transition` events that every change emits (the journal and the dashboard do).

Every change of a shard's record goes through :meth:`Ledger._apply`, which looks the move up in
:data:`TRANSITIONS`. An operation whose guard does not hold changes nothing and says so in the
:class:`Outcome` it returns, so no sequence of calls can produce a move the table does not list.

Every counter reset says why, on its own line. Note 001 (``shared/seeds/001_*``) is what happens
when one does not: a restarted engine inherited the dead one's failure streak.

Keep in sync: :data:`TRANSITIONS`, the invariants in docs/design.md section 2, and the property test
``tests/unit/test_ledger_properties.py`` that checks them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, Self, get_args

__all__ = [
    "ABSENT",
    "COMING_BACK",
    "OUT",
    "ROUTABLE",
    "TRANSITIONS",
    "UNNAMED_PREFIX",
    "Admission",
    "Admitted",
    "Event",
    "FleetExhausted",
    "Hold",
    "HoldCause",
    "Holds",
    "Ledger",
    "LedgerError",
    "Outcome",
    "Policy",
    "Reading",
    "ShardRecord",
    "ShardState",
    "Transition",
    "WeightsMode",
    "admitted",
    "never_empty",
    "tally",
    "unnamed_incarnation",
]


class ShardState(enum.Enum):
    HEALTHY = "HEALTHY"  # serving, weights current
    SUSPECT = "SUSPECT"  # failing, not yet condemned; still serves so one blip costs nothing
    STALE = "STALE"  # process up, weights not current; joins the next refit, serves nothing
    DEAD = "DEAD"  # condemned; replacement not started
    RESTARTING = "RESTARTING"  # replacement coming up
    RETIRED = "RETIRED"  # budget exhausted or removed by an operator; terminal
    #: vLLM's sleep mode (a trainer has the GPU): process up, serves nothing, never judged
    #: stuck; it goes back to what it was (``state_before_sleep``) when it reports awake.
    SLEEPING = "SLEEPING"

    def __str__(self) -> str:
        return self.value


HEALTHY = ShardState.HEALTHY
SUSPECT = ShardState.SUSPECT
STALE = ShardState.STALE
DEAD = ShardState.DEAD
RESTARTING = ShardState.RESTARTING
RETIRED = ShardState.RETIRED
SLEEPING = ShardState.SLEEPING

#: States whose shards receive traffic.
ROUTABLE: frozenset[ShardState] = frozenset({HEALTHY, SUSPECT})
#: States whose shards have no usable process: left out of refits and of the serving set.
ABSENT: frozenset[ShardState] = frozenset({DEAD, RESTARTING, RETIRED})
#: States whose shards serve nothing now but have a way back: a restart (DEAD, RESTARTING),
#: a refit (STALE), a wake (SLEEPING). With ROUTABLE ("serving") and OUT, how the status
#: headline counts a fleet (:func:`tally`).
COMING_BACK: frozenset[ShardState] = frozenset({STALE, SLEEPING, DEAD, RESTARTING})
#: The state whose shards never serve again: retired (terminal).
OUT: frozenset[ShardState] = frozenset({RETIRED})


def tally(states: Iterable[ShardState]) -> dict[str, int]:
    """Shards as an operator counts them: ``serving`` (ROUTABLE), ``coming_back``
    (:data:`COMING_BACK`), ``out`` (:data:`OUT`); every state is in exactly one of the three."""
    counts = {"serving": 0, "coming_back": 0, "out": 0}
    for state in states:
        key = "serving" if state in ROUTABLE else "coming_back" if state in COMING_BACK else "out"
        counts[key] += 1
    return counts


class Event(enum.Enum):
    """The kinds of evidence that move a shard. Each names one row group of :data:`TRANSITIONS`."""

    PROBE_OK = "probe ok"
    RECOVERED = "recovered"  # healthy_threshold good probes in a row lift SUSPECT
    FAILURE = "failure"  # a failed probe or a failed window of real requests
    FAILURES_AT_THRESHOLD = "failures at threshold"
    REQUEST_OK = "request ok"  # a completed generation clears the reported streak
    EJECTED = "ejected"  # a failed window of real requests: out of routing until proof
    ON_TRIAL = "on trial"  # proof (a good probe) after the ejection: one request at a time
    CONFIRMED = "confirmed"  # reported failures, then a failed probe of the ejected shard
    SERVED = "served"  # a window of completed generations and no failure lifts SUSPECT
    CONDEMNED = "condemned"  # conclusive evidence: exit, proven stall, failed lost-core canary
    SILENT_PARTICIPANT = "silent participant"  # the one suspect of an aborted refit
    WEIGHTS_PARTIAL = "weights partial"  # a refit aborted while the shard received
    REFIT = "refit"  # a completed refit, nothing suspected
    REFIT_STILL_SUSPECT = "refit, still suspect"  # a completed refit that was suspected before
    MISSED_REFIT = "missed refit"  # a refit completed, but this process did not take part
    REFIT_UNCONFIRMED = "refit unconfirmed"  # a refit completed; the engine says otherwise
    IDENTIFIED = "identified"  # the first incarnation seen of a shard's process: no restart
    NEW_INCARNATION = "new incarnation"  # silent restart, weights unchanged (static mode)
    NEW_INCARNATION_WEIGHTS_LOST = "new incarnation, weights lost"  # silent restart, trainer mode
    NEW_RUN = "new run"  # fleetwarden started again; a new engine stands in, no failure of its
    NEW_RUN_WEIGHTS_LOST = "new run, weights lost"  # the same, trainer mode: checkpoint weights
    RESTART_BEGUN = "restart begun"
    BUDGET_EXHAUSTED = "budget exhausted"
    RESTART_FAILED = "restart failed"
    LOADED = "loaded"  # the replacement process answers
    RETIRED_BY_OPERATOR = "retired"
    ASLEEP = "asleep"  # it reports asleep, or the trainer put it to sleep
    WOKE = "woke"  # it reports awake again: back to HEALTHY, as it was before the sleep
    WOKE_SUSPECT = "woke, still suspect"  # ... back to SUSPECT: a sleep proves nothing
    WOKE_STALE = "woke, still stale"  # ... back to STALE: its weights are still not current
    # Admission (:class:`Admission`): held out of routing by focused reads, with no verdict;
    # self-loops of every state with a process (the shard's record does not change).
    HELD = "held"  # out of routing while focused reads watch it (a cause added)
    RELEASED = "released"  # a cause of its hold ended
    HOLD_EXPIRED = "hold expired"  # its hold reached its until-time: every cause ends

    def __str__(self) -> str:
        return self.value


E = Event

#: A hold's moves (:class:`Admission`): a self-loop of every state that has a process. A shard
#: with none routes nothing, so a hold of it ends with no transition.
def _holds(state: ShardState) -> dict[Event, ShardState]:
    return {E.HELD: state, E.RELEASED: state, E.HOLD_EXPIRED: state}


# fmt: off
#: Every move the ledger can make: state -> {evidence -> next state}. A move that is not here
#: cannot happen. Self-loops are counter updates (a streak grew, a weight version changed).
#: Read it as the answer to "what can this evidence do to a shard in this state?".
TRANSITIONS: Mapping[ShardState, Mapping[Event, ShardState]] = {
    HEALTHY: {
        E.PROBE_OK: HEALTHY,
        E.FAILURE: SUSPECT,
        E.FAILURES_AT_THRESHOLD: DEAD,
        E.REQUEST_OK: HEALTHY,
        E.EJECTED: SUSPECT,
        E.CONDEMNED: DEAD,
        E.SILENT_PARTICIPANT: DEAD,
        E.WEIGHTS_PARTIAL: STALE,
        E.MISSED_REFIT: STALE,
        E.REFIT_UNCONFIRMED: STALE,
        E.REFIT: HEALTHY,
        E.IDENTIFIED: HEALTHY,
        E.NEW_INCARNATION: HEALTHY,
        E.NEW_INCARNATION_WEIGHTS_LOST: STALE,
        E.NEW_RUN: HEALTHY,
        E.NEW_RUN_WEIGHTS_LOST: STALE,
        E.RETIRED_BY_OPERATOR: RETIRED,
        E.ASLEEP: SLEEPING,
        **_holds(HEALTHY),
    },
    SUSPECT: {
        E.PROBE_OK: SUSPECT,
        E.RECOVERED: HEALTHY,
        E.FAILURE: SUSPECT,
        E.FAILURES_AT_THRESHOLD: DEAD,
        E.REQUEST_OK: SUSPECT,
        E.EJECTED: SUSPECT,
        E.ON_TRIAL: SUSPECT,
        E.CONFIRMED: DEAD,
        E.SERVED: HEALTHY,  # successful work is evidence: no canary needed to come back
        E.CONDEMNED: DEAD,
        E.SILENT_PARTICIPANT: DEAD,
        E.WEIGHTS_PARTIAL: STALE,
        E.MISSED_REFIT: STALE,
        E.REFIT_UNCONFIRMED: STALE,
        E.REFIT_STILL_SUSPECT: SUSPECT,
        E.IDENTIFIED: SUSPECT,
        E.NEW_INCARNATION: HEALTHY,  # the suspicion was about the old process
        E.NEW_INCARNATION_WEIGHTS_LOST: STALE,
        E.NEW_RUN: HEALTHY,  # the suspicion was about the last run's process
        E.NEW_RUN_WEIGHTS_LOST: STALE,
        E.RETIRED_BY_OPERATOR: RETIRED,
        E.ASLEEP: SLEEPING,
        **_holds(SUSPECT),
    },
    STALE: {  # left only by a completed refit, a death (conclusive, or proven by failed reads)
        # or retirement. Its process is judged like any other: reads that keep failing
        # condemn it (a STALE engine that died must not wait for a refit that never comes).
        E.PROBE_OK: STALE,
        E.FAILURE: STALE,
        E.FAILURES_AT_THRESHOLD: DEAD,
        E.REQUEST_OK: STALE,
        E.CONDEMNED: DEAD,
        E.SILENT_PARTICIPANT: DEAD,
        E.WEIGHTS_PARTIAL: STALE,
        E.MISSED_REFIT: STALE,
        E.REFIT_UNCONFIRMED: STALE,
        E.REFIT: HEALTHY,
        E.REFIT_STILL_SUSPECT: SUSPECT,
        E.IDENTIFIED: STALE,
        E.NEW_INCARNATION: STALE,
        E.NEW_INCARNATION_WEIGHTS_LOST: STALE,
        E.NEW_RUN: STALE,  # its weights are whatever the new engine loaded: a refit's to say
        E.NEW_RUN_WEIGHTS_LOST: STALE,
        E.RETIRED_BY_OPERATOR: RETIRED,
        E.ASLEEP: SLEEPING,
        **_holds(STALE),
    },
    DEAD: {  # re-entry is always DEAD -> RESTARTING -> STALE -> (refit) -> HEALTHY
        E.REQUEST_OK: DEAD,
        E.RESTART_BEGUN: RESTARTING,
        E.BUDGET_EXHAUSTED: RETIRED,
        E.RETIRED_BY_OPERATOR: RETIRED,
    },
    RESTARTING: {
        E.REQUEST_OK: RESTARTING,
        E.RESTART_FAILED: DEAD,
        E.LOADED: STALE,
        E.RETIRED_BY_OPERATOR: RETIRED,
    },
    RETIRED: {},  # terminal: nothing ever changes a retired shard again
    # Asleep: serves nothing and is judged on nothing (probes, failures and outcomes only count
    # for serving shards). It wakes to the state it slept in; it takes part in a refit (a
    # trainer loads weights into a sleeping engine, and vLLM's level-2 sleep needs it), which
    # changes what it wakes to. Its process can still die, restart, or be retired.
    SLEEPING: {
        E.ASLEEP: SLEEPING,  # the trainer now holds it asleep
        E.WOKE: HEALTHY,
        E.WOKE_SUSPECT: SUSPECT,
        E.WOKE_STALE: STALE,
        # Reads of its process: one that answers ends a failed run; reads that keep failing
        # (unreachable, never a canary: none is sent to a sleeper) prove it died
        E.PROBE_OK: SLEEPING,
        E.FAILURE: SLEEPING,
        E.FAILURES_AT_THRESHOLD: DEAD,
        E.REQUEST_OK: SLEEPING,
        E.CONDEMNED: DEAD,
        E.SILENT_PARTICIPANT: DEAD,
        E.MISSED_REFIT: SLEEPING,  # wakes STALE
        E.REFIT_UNCONFIRMED: SLEEPING,  # wakes STALE
        E.WEIGHTS_PARTIAL: SLEEPING,  # wakes STALE
        E.REFIT: SLEEPING,  # wakes HEALTHY
        E.REFIT_STILL_SUSPECT: SLEEPING,  # wakes SUSPECT
        E.IDENTIFIED: SLEEPING,
        # A new process starts awake, with nothing proved of its weights: STALE, promoted by a
        # good canary with static weights, by the next refit with a trainer's.
        E.NEW_INCARNATION: STALE,
        E.NEW_INCARNATION_WEIGHTS_LOST: STALE,
        E.NEW_RUN: STALE,
        E.NEW_RUN_WEIGHTS_LOST: STALE,
        E.RETIRED_BY_OPERATOR: RETIRED,
        **_holds(SLEEPING),
    },
}
# fmt: on

WeightsMode = Literal["static", "trainer"]


@dataclass(frozen=True, slots=True)
class Reading:
    """A watchdog verdict as the ledger needs it (:meth:`Ledger.record_reading`): plain facts,
    so the ledger depends on no judge and a test needs no watchdog."""

    #: The judge's summary: ``proven`` (progress, or a canary answered), ``unproven``,
    #: ``failing`` (unreachable, or an idle engine's canary failed), ``condemned``.
    health: Literal["proven", "unproven", "failing", "condemned"]
    #: The verdict's name and evidence, for the cause.
    verdict: str
    summary: str = ""
    #: The engine restarted since the last read (start time changed, or counters went back).
    restarted: bool = False
    #: Its process start time, when it gives one.
    incarnation: str | None = None
    #: ``None``: no canary was sent with this read.
    canary_ok: bool | None = None
    canary_error: str = ""
    #: During a refit lease: a failed canary proves nothing.
    excused: bool = False
    #: False: the read compared with a sample older than the accusation it answers (the first
    #: focused read of an accused engine), so progress it shows proves nothing; a canary does.
    progress_proves: bool = True
    #: ``vllm:engine_sleep_state`` at this read: 0 awake, 1 or 2 asleep, ``None`` unknown (no
    #: sample, or an engine that does not export it).
    sleep_level: int | None = None


class LedgerError(Exception):
    """A bug: an operation tried a move that :data:`TRANSITIONS` does not list."""


class FleetExhausted(Exception):
    """Too few shards remain that could ever serve again; the run is not worth continuing."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The ledger's thresholds, each default's reason on its field (docs/design.md 3.2)."""

    #: Failed probes in a row, and failed request windows in a row, that condemn a shard.
    #: Three: one blip is noise, two can be a restart of a neighbour, three is a pattern.
    unhealthy_threshold: int = 3
    #: Good probes in a row that lift SUSPECT. Two, so one lucky probe does not.
    healthy_threshold: int = 2
    #: Restarts a shard may use over the fleet's lifetime (persisted in the journal); the sixth
    #: retires it. An engine that keeps dying costs minutes of a node each time.
    max_restart_attempts: int = 5
    #: Below this many shards that could still serve, :meth:`Ledger.raise_if_exhausted` raises.
    min_serving_shards: int = 1
    #: ``static``: weights never change, so a silent restart loses nothing and a loaded engine
    #: serves after a good canary. ``trainer``: an RL trainer pushes weights; a restarted
    #: engine holds the checkpoint's weights and waits in STALE for the trainer's next refit.
    weights: WeightsMode = "static"
    #: A shard ejected for failed requests stays out of routing at least this long before an
    #: answered canary may put it on trial; each ejection since it was last HEALTHY doubles it
    #: (1, 2, 4 ... s), as in Envoy's outlier ejection. What brings it back is proof, not the
    #: time, so the first wait is short: a busy engine that answered one blip is back when one
    #: of the requests it holds completes (at any time), an idle one after its canary, and one
    #: that keeps failing is paced by the doubling.
    ejection_base_s: float = 1.0
    #: ... up to this. A minute: an engine that failed its trial six times in a row is
    #: condemned by its reported streak long before (unhealthy_threshold windows).
    ejection_max_s: float = 60.0
    #: Envoy's panic threshold, in percent: when fewer than this share of the fleet's shards
    #: (all but RETIRED ones) are routable, the serving set is every shard that is not
    #: condemned (HEALTHY or SUSPECT, ejected ones too). An ejection says "prefer the others";
    #: with too few others left, an engine that failed a request beats a 409 for every
    #: client, and one that keeps failing is still condemned by its reads. 50, Envoy's
    #: default; 0 turns it off (ejected engines never serve, whatever is left).
    panic_threshold_percent: float = 50.0

    def __post_init__(self) -> None:
        if not 0 <= self.ejection_base_s <= self.ejection_max_s:
            raise ValueError(
                f"Policy: ejection_base_s ({self.ejection_base_s:g}) must be >= 0 and not exceed "
                f"ejection_max_s ({self.ejection_max_s:g}): the backoff doubles from the first "
                "up to the second")
        if not 0 <= self.panic_threshold_percent <= 100:
            raise ValueError(f"Policy.panic_threshold_percent must be within 0..100, got "
                             f"{self.panic_threshold_percent}")
        for name in ("unhealthy_threshold", "healthy_threshold", "min_serving_shards"):
            if getattr(self, name) < 1:
                raise ValueError(f"Policy.{name} must be at least 1, got {getattr(self, name)}")
        if self.max_restart_attempts < 0:
            raise ValueError(
                f"Policy.max_restart_attempts must be at least 0, got {self.max_restart_attempts}"
            )
        if self.weights not in get_args(WeightsMode):
            raise ValueError(f"Policy.weights must be 'static' or 'trainer', got {self.weights!r}")


@dataclass(frozen=True, slots=True)
class ShardRecord:
    """What the ledger knows of one shard (docs/design.md section 3.1). Immutable: a copy."""

    index: int
    base_url: str
    state: ShardState = HEALTHY
    #: Identity of the process (launch id and/or the engine's ``process_start_time_seconds``).
    incarnation: str | None = None
    consecutive_probe_failures: int = 0
    consecutive_probe_successes: int = 0
    #: Failed real requests (one per failed router window). No probe can reset it: a shard that
    #: answers every probe and fails every generation must still die (note 000).
    consecutive_reported_failures: int = 0
    restart_attempts: int = 0
    #: What the shard was before an aborted refit made it STALE; read once by the next refit.
    state_before_partial: ShardState | None = None
    weight_version: int = 0
    last_error: str = ""
    #: While SLEEPING: the state it wakes to (what it slept in, as refits since changed it).
    state_before_sleep: ShardState | None = None
    #: While SLEEPING: the trainer put it to sleep, so only the trainer's wake puts it back
    #: (an engine read awake between the bracket's mark and its ``/sleep`` proves nothing).
    sleep_held: bool = False
    #: Informational: when a probe or request last succeeded. Changes on every good probe, so it
    #: is not a transition of its own; the journal keeps it with the next change or snapshot.
    last_ok_at: float | None = None
    last_transition_at: float = 0.0
    #: Ejections for failed requests since the shard was last HEALTHY (the backoff's exponent).
    ejections: int = 0
    #: Out of routing since its requests failed (the router dropped it at the first failure,
    #: and no push puts it back); a good probe after this time puts it on trial. None: routed.
    ejected_until: float | None = None
    #: Back in routing on probation: one request at a time until one completes.
    on_trial: bool = False
    #: Its process holds no weights (a level-2 sleep discarded them): STALE when awake, and
    #: only a refit (or a new process) gives it weights to serve; a canary it answers proves
    #: nothing of weights it does not have.
    weights_discarded: bool = False

    @property
    def routable(self) -> bool:
        """Pushed to the routers: serving, and not ejected (a shard on trial is routable)."""
        return self.state in ROUTABLE and self.ejected_until is None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        sbp = self.state_before_partial
        d["state_before_partial"] = sbp.value if sbp is not None else None
        sbs = self.state_before_sleep
        d["state_before_sleep"] = sbs.value if sbs is not None else None
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShardRecord:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown shard record fields: {sorted(unknown)}")
        values = dict(d)
        values["state"] = ShardState(values["state"])
        sbp = values.get("state_before_partial")
        values["state_before_partial"] = ShardState(sbp) if sbp is not None else None
        sbs = values.get("state_before_sleep")
        values["state_before_sleep"] = ShardState(sbs) if sbs is not None else None
        return cls(**values)


#: Fields that identify a record for equality across a restore (timestamps excluded).
_COUNTER_FIELDS = (
    "consecutive_probe_failures",
    "consecutive_probe_successes",
    "consecutive_reported_failures",
    "restart_attempts",
    "state_before_partial",
    "weight_version",
    "ejections",
    "on_trial",
    "state_before_sleep",
    "sleep_held",
    "weights_discarded",
)


@dataclass(frozen=True, slots=True)
class Transition:
    """One change of one shard: a move between states, or a counter update (``from == to``)."""

    shard: int
    from_state: ShardState
    to_state: ShardState
    event: Event
    cause: str
    at: float
    #: The whole record after the change: its counters, URL, incarnation and weight version.
    record: ShardRecord

    @property
    def changes_state(self) -> bool:
        return self.from_state is not self.to_state

    def to_dict(self) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "from": self.from_state.value,
            "to": self.to_state.value,
            "event": self.event.value,
            "cause": self.cause,
            "at": self.at,
            "record": self.record.to_dict(),
        }


def _began_before_suspicion(s: _Shard, window_began_at: float | None) -> bool:
    """A window begun before its shard became SUSPECT (whatever made it so: a silent read
    between two drains): its successes may all be from before the suspicion."""
    return (window_began_at is not None and s.state is ShardState.SUSPECT
            and window_began_at < s.last_transition_at)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an operation did. Falsy when its guard did not hold and nothing changed."""

    applied: bool
    #: Why the operation was ignored; empty when it was applied.
    reason: str = ""
    #: The change it made; ``None`` when it changed nothing (ignored, or already so).
    transition: Transition | None = None

    def __bool__(self) -> bool:
        return self.applied


_UNCHANGED = Outcome(applied=True)

Subscriber = Callable[[Transition], None]


#: A record's fields, which :class:`_Shard` mirrors one for one (a unit test holds them equal).
_RECORD_FIELDS = tuple(f.name for f in fields(ShardRecord))


@dataclass(slots=True)
class _Shard:
    """The ledger's mutable copy of a record: :class:`ShardRecord`'s fields, same names, same
    defaults. Only :meth:`Ledger._apply` writes its fields (and ``last_ok_at``, which is no
    transition)."""

    index: int
    base_url: str
    state: ShardState = HEALTHY
    incarnation: str | None = None
    consecutive_probe_failures: int = 0
    consecutive_probe_successes: int = 0
    consecutive_reported_failures: int = 0
    restart_attempts: int = 0
    state_before_partial: ShardState | None = None
    weight_version: int = 0
    last_error: str = ""
    state_before_sleep: ShardState | None = None
    sleep_held: bool = False
    last_ok_at: float | None = None
    last_transition_at: float = 0.0
    ejections: int = 0
    ejected_until: float | None = None
    on_trial: bool = False
    weights_discarded: bool = False
    _record: ShardRecord | None = field(default=None, repr=False)

    def record(self) -> ShardRecord:
        if self._record is None:
            self._record = ShardRecord(**{name: getattr(self, name) for name in _RECORD_FIELDS})
        return self._record


class _LedgerCore:
    """The ledger's shards, its one writer (:meth:`_apply`: a move looked up in
    :data:`TRANSITIONS`, then emitted to the subscribers) and its reads. The operations are
    :class:`Ledger`'s, by job: health (:class:`_HealthOps`), then readings, refits, sleep
    and restarts."""

    def __init__(
        self,
        urls: Iterable[str],
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy if policy is not None else Policy()
        self._clock = clock
        now = clock()
        self._shards = [_Shard(i, url, last_transition_at=now) for i, url in enumerate(urls)]
        self._by_url = {s.base_url: s.index for s in self._shards}
        self._subscribers: list[Subscriber] = []
        #: Who the routers may use: the panic threshold, trials and the holds (:class:`Holds`).
        self.admission = Admission(self)

    @classmethod
    def from_records(
        cls,
        records: Iterable[ShardRecord],
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Self:
        """Rebuild a ledger from records (a journal restore). Indices must be 0..n-1 in order."""
        records = list(records)
        for expected, rec in enumerate(records):
            if rec.index != expected:
                raise ValueError(f"records must be indexed 0..n-1 in order; got {rec.index} "
                                 f"at position {expected}")
        ledger = cls([], policy, clock)
        ledger._shards = [
            _Shard(**{name: getattr(rec, name) for name in _RECORD_FIELDS})
            for rec in records
        ]
        ledger._by_url = {s.base_url: s.index for s in ledger._shards}
        return ledger

    # ------------------------------------------------------------------ subscribers

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber`` with every :class:`Transition`; returns a function that stops it."""
        self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            if subscriber in self._subscribers:
                self._subscribers.remove(subscriber)

        return unsubscribe

    # ------------------------------------------------------------------ the one writer

    def _apply(
        self, shard: _Shard, event: Event, cause: str, **changes: Any
    ) -> Outcome:
        """Make one change: look the move up in the table, write the fields, emit the event.

        This is the only place that writes a shard's state or counters.
        """
        try:
            to_state = TRANSITIONS[shard.state][event]
        except KeyError:
            raise LedgerError(
                f"shard {shard.index}: {event} is not a move from {shard.state}"
            ) from None
        from_state = shard.state
        if to_state is from_state and all(
            getattr(shard, name) == value for name, value in changes.items()
        ):
            return _UNCHANGED
        for name, value in changes.items():
            setattr(shard, name, value)
        now = self._clock()
        if to_state is not from_state:
            shard.state = to_state
            shard.last_transition_at = now
        if "base_url" in changes:
            self._by_url = {s.base_url: s.index for s in self._shards}
        shard._record = None
        return self._emit(shard, from_state, event, cause, now)

    def _emit(self, shard: _Shard, from_state: ShardState, event: Event, cause: str,
              now: float) -> Outcome:
        """Tell every subscriber of the change just made to ``shard`` (:meth:`_apply`, and
        :class:`Admission`'s self-loops)."""
        transition = Transition(shard.index, from_state, shard.state, event, cause, now,
                                shard.record())
        errors: list[Exception] = []
        for subscriber in list(self._subscribers):
            try:
                subscriber(transition)
            except Exception as exc:  # every subscriber hears of the change, whatever another
                errors.append(exc)  # does; the change itself is made and stays made
        if errors:
            raise errors[0]
        return Outcome(applied=True, transition=transition)

    def _shard(self, i: int) -> _Shard:
        if not 0 <= i < len(self._shards):
            raise IndexError(f"no shard {i}: the fleet has shards 0..{len(self._shards) - 1}")
        return self._shards[i]

    @staticmethod
    def _ignored(shard: _Shard, why: str) -> Outcome:
        return Outcome(applied=False, reason=f"shard {shard.index} is {shard.state}: {why}")

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._shards)

    def shard(self, i: int) -> ShardRecord:
        return self._shard(i).record()

    def state(self, i: int) -> ShardState:
        return self._shard(i).state

    def serving(self) -> list[int]:
        return [s.index for s in self._shards if s.state in ROUTABLE]

    def absent(self) -> list[int]:
        return [s.index for s in self._shards if s.state in ABSENT]

    def refit_participants(self) -> list[int]:
        """Serving and STALE shards: everyone with a process that can take new weights."""
        return [s.index for s in self._shards if s.state not in ABSENT]

    def serving_urls(self) -> list[str]:
        """Serving shards not ejected, or all below the panic threshold; before any hold
        (:meth:`Admission.serving_urls`; the routers get :meth:`Admission.routed`)."""
        return self.admission.serving_urls()

    def panicking(self) -> bool:
        return self.admission.panicking()

    def trial_urls(self) -> list[str]:
        return self.admission.trial_urls()

    def ejected(self) -> list[int]:
        return self.admission.ejected()

    def ejection_due(self, i: int) -> bool:
        """Shard ``i`` is ejected and its time out is up: proof may now put it on trial. Read
        on the ledger's own clock (``ejected_until`` is a time of that clock: the journal's
        wall clock in a fleet, not the controller's monotonic one)."""
        until = self._shard(i).ejected_until
        return until is not None and self._clock() >= until

    def now(self) -> float:
        """This ledger's clock: what evidence is dated with (``report_outcomes``)."""
        return self._clock()

    def shard_for_url(self, url: str) -> int | None:
        return self._by_url.get(url)

    def snapshot(self) -> list[ShardRecord]:
        return [s.record() for s in self._shards]

    def counts_by_state(self) -> dict[ShardState, int]:
        counts = dict.fromkeys(ShardState, 0)
        for s in self._shards:
            counts[s.state] += 1
        return counts

    def raise_if_exhausted(self) -> None:
        """Raise :class:`FleetExhausted` once fewer than ``min_serving_shards`` shards could
        ever serve again (all others retired)."""
        remaining = sum(1 for s in self._shards if s.state is not RETIRED)
        if remaining < self.policy.min_serving_shards:
            raise FleetExhausted(
                f"{remaining} of {len(self._shards)} shards can still serve; "
                f"min_serving_shards is {self.policy.min_serving_shards}"
            )


class _HealthOps(_LedgerCore):
    """The ledger's operations on health: probes, request outcomes, readings and conclusive
    evidence (a condemnation)."""

    # ------------------------------------------------------------------ probes and requests

    def record_probe(self, i: int, ok: bool, error: str = "", *, generated: bool = False
                     ) -> Outcome:
        """A watchdog probe of a shard that has a process (serving, STALE or asleep): good, or
        failed with ``error``. A STALE or sleeping shard's failed probes count as any other's,
        so an engine that died is condemned; its good probes lift nothing (only a refit, or a
        wake-up, does). ``generated``: the good probe was a generation (a canary answered),
        the only probe that ends an ejection for failed requests."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "probes only judge shards that have a process")
        p = self.policy
        if ok:
            now = s.last_ok_at = self._clock()
            successes = min(s.consecutive_probe_successes + 1, p.healthy_threshold)  # past the
            # threshold the count decides nothing, so it saturates and steady ticks emit nothing
            if s.state is SUSPECT and s.ejected_until is not None:
                if now < s.ejected_until or not generated:
                    # Progress proves that its core steps, not that its generations complete:
                    # an engine whose every generation ends in a 500 (note 000's trickle) shows
                    # progress too. Only an answered canary (or a completed request, in
                    # report_outcomes) brings it back (the history is in docs/design.md
                    # section 12, "Out stays out").
                    why = ("still ejected" if now < s.ejected_until
                           else "still ejected until a canary answers")
                    return self._apply(
                        s, E.PROBE_OK, f"probe ok; {why}",
                        consecutive_probe_failures=0,  # a good probe ends the failed-probe run
                        consecutive_probe_successes=successes,
                    )
                return self._apply(
                    s, E.ON_TRIAL, "probe ok after its ejection: on trial, one request at a time",
                    consecutive_probe_failures=0,  # a good probe ends the failed-probe run
                    consecutive_probe_successes=successes,
                    ejected_until=None,
                    on_trial=True,
                )
            if s.state is SUSPECT and s.on_trial:
                # On trial only a completed request ends the probation; probes keep counting.
                return self._apply(
                    s, E.PROBE_OK, "probe ok; on trial",
                    consecutive_probe_failures=0,  # a good probe ends the failed-probe run
                    consecutive_probe_successes=successes,
                )
            if s.state is SUSPECT and successes >= p.healthy_threshold:
                return self._apply(
                    s, E.RECOVERED, f"{successes} good probes in a row",
                    consecutive_probe_failures=0,  # a good probe ends the failed-probe run
                    consecutive_probe_successes=successes,
                    ejections=0,  # HEALTHY again: the next ejection starts the backoff afresh
                )
            return self._apply(
                s, E.PROBE_OK, "probe ok",
                consecutive_probe_failures=0,  # a good probe ends the failed-probe run
                consecutive_probe_successes=successes,
            )  # never the reported streak: only a completed generation clears that (note 000)
        failures = s.consecutive_probe_failures + 1
        fields_ = dict(
            consecutive_probe_failures=failures,
            consecutive_probe_successes=0,  # the good-probe run that would lift SUSPECT is broken
            last_error=error or "probe failed",
        )
        if (s.state is SUSPECT and s.ejected_until is not None
                and s.consecutive_reported_failures > 0):
            # Its requests failed, the router dropped it, and the focused look that followed
            # failed too: the accusation is confirmed (note 000's burst, plus one probe).
            return self._apply(
                s, E.CONFIRMED,
                f"{s.consecutive_reported_failures} failed request window(s), confirmed by a "
                f"failed probe: {error or 'probe failed'}", **fields_,
            )
        if failures >= p.unhealthy_threshold:
            return self._apply(
                s, E.FAILURES_AT_THRESHOLD,
                f"{failures} failed probes in a row: {error or 'probe failed'}", **fields_,
                **_NOT_ASLEEP,
            )
        return self._apply(s, E.FAILURE, f"probe failed: {error or 'probe failed'}", **fields_)

    def mark_suspect(self, i: int, cause: str) -> Outcome:
        """Evidence against the shard that accuses no request of its own (a refit lease that
        overran): SUSPECT, still routed, lifted as any suspicion is (good probes in a row, or
        a window of completed requests). A STALE or sleeping shard stays as it is."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "suspicion only falls on shards that have a process")
        return self._apply(
            s, E.FAILURE, cause, last_error=cause,
            consecutive_probe_successes=0,  # the run of good probes that lifts SUSPECT starts now
        )

    def report_failure(self, i: int, cause: str) -> Outcome:
        """One failed real request (or one failed router window) on a serving shard."""
        s = self._shard(i)
        if s.state not in ROUTABLE:
            return self._ignored(s, "failures only count against serving shards")
        return self._count_failure(s, s.consecutive_reported_failures + 1, cause)

    def _count_failure(self, s: _Shard, streak: int, cause: str, *, window: bool = False
                       ) -> Outcome:
        if window and s.ejected_until is not None:
            # Out of routing since the first of these failures: what still fails in a router
            # window are requests that were already on it, the same burst: one observation
            # (docs/design.md section 3.3, report_outcomes).
            streak = min(streak, max(s.consecutive_reported_failures, 1))
        fields_: dict[str, Any] = dict(
            consecutive_reported_failures=streak,
            consecutive_probe_successes=0,  # a failed request breaks the run that lifts SUSPECT
            last_error=cause,
        )
        if streak >= self.policy.unhealthy_threshold:
            return self._apply(
                s, E.FAILURES_AT_THRESHOLD, f"{streak} failed request windows in a row: {cause}",
                **fields_,
            )
        if s.ejected_until is not None:
            return self._apply(s, E.FAILURE, f"still ejected: {cause}", **fields_)
        p = self.policy
        ejections = s.ejections + 1
        out_s = min(p.ejection_base_s * 2 ** (ejections - 1), p.ejection_max_s)
        trial = " (its trial request failed)" if s.on_trial else ""
        return self._apply(
            s, E.EJECTED, f"{cause}{trial}; out of routing for at least {out_s:g} s, then back "
            "on proof", ejections=ejections, ejected_until=self._clock() + out_s,
            on_trial=False, **fields_,
        )

    def report_success(self, i: int) -> Outcome:
        """A completed generation: the engine serves, so its failed-request streak is over."""
        s = self._shard(i)
        if s.state is RETIRED:
            return self._ignored(s, "a retired shard never changes")
        s.last_ok_at = self._clock()
        return self._apply(
            s, E.REQUEST_OK, "request completed",
            consecutive_reported_failures=0,  # a completed generation proves the engine serves
        )

    def report_outcomes(
        self, i: int, successes: int, failures: int, trailing_failures: int, *,
        may_predate_suspicion: bool = False, window_began_at: float | None = None,
    ) -> Outcome:
        """One router window for a serving shard (docs/design.md section 3.3).

        If any request succeeded the streak is first cleared; then, if the window ended in
        failure (``trailing_failures > 0``, or failures with no success), it counts as *one*
        failure: a burst of concurrent failures is one observation, not three.

        ``may_predate_suspicion``: the window may have ended before what made the shard
        SUSPECT (a probe that failed in the same tick, after the window began): its completed
        requests clear the reported streak but lift nothing: work done before a suspicion is
        no proof against it (history: docs/design.md section 13); so for a window that began
        (``window_began_at``, this ledger's clock) before the shard became SUSPECT.
        """
        if min(successes, failures, trailing_failures) < 0:
            raise ValueError(f"outcome counts cannot be negative: {successes}, {failures}, "
                             f"{trailing_failures}")
        s = self._shard(i)
        if s.state not in ROUTABLE:
            return self._ignored(s, "outcomes only count for serving shards")
        predates = may_predate_suspicion or _began_before_suspicion(s, window_began_at)
        ended_in_failure = trailing_failures > 0 or (failures > 0 and successes == 0)
        if successes > 0:
            s.last_ok_at = self._clock()
        if ended_in_failure:
            if successes > 0:
                # The window's successes cleared the old streak first; the failures that ended
                # it start a new one. One change, so the window stays one observation.
                return self._count_failure(
                    s, 1, f"{trailing_failures} failed requests after {successes} completed "
                    "in the last window", window=True,
                )
            return self._count_failure(
                s, s.consecutive_reported_failures + 1,
                f"{failures} failed requests in the last window", window=True,
            )
        proof = successes > 0 and failures == 0 and s.state is SUSPECT and not predates
        if proof and s.ejected_until is not None:
            # Ejected: nothing new was routed to it, so these are requests it held from before
            # its ejection, and perhaps from before the fault (note 000's trickle completes
            # what it admitted before the fault and fails everything after). They put it on
            # trial once its ejection time is up, as a canary does, never straight back to full
            # traffic; a completed trial request is then the proof (docs/design.md section 12).
            if self._clock() < s.ejected_until:
                return _UNCHANGED
            return self._apply(
                s, E.ON_TRIAL, f"{successes} requests it held completed after its ejection: on "
                "trial, one request at a time",
                ejected_until=None,
                on_trial=True,
            )
        if proof:
            # Successful work is evidence: an engine that completes every generation routed
            # to it in a window serves, whatever made it suspect (a /metrics read that timed
            # out under load, a failed window before). Without this an idle suspect waits a
            # canary interval (an hour in some configs) for the only other evidence that lifts
            # it. A window with any failure lifts nothing. Completed generations are proof of
            # the kind a trial request gives, so they end a trial too (an ejection: above).
            return self._apply(
                s, E.SERVED, f"{successes} requests completed and none failed",
                consecutive_reported_failures=0,  # completed generations prove the engine serves
                consecutive_probe_failures=0,  # the failed reads judged an engine that serves
                ejected_until=None,  # proof: back in routing
                on_trial=False,  # proof: back in full traffic
                ejections=0,  # HEALTHY again: a later ejection starts the backoff afresh
            )
        if successes > 0:
            if s.on_trial:
                return self._apply(
                    s, E.REQUEST_OK, "its trial request completed: back in full traffic",
                    consecutive_reported_failures=0,  # a completed generation proves it serves
                    on_trial=False,
                )
            return self._apply(
                s, E.REQUEST_OK, f"{successes} requests completed",
                consecutive_reported_failures=0,  # completed generations prove the engine serves
            )
        return _UNCHANGED

    # ------------------------------------------------------------------ conclusive evidence

    def condemn(self, i: int, cause: str) -> Outcome:
        """Conclusive evidence (process exited, proven stall, failed lost-core canary): DEAD."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "already out of the fleet")
        return self._apply(s, E.CONDEMNED, cause, last_error=cause, **_NOT_ASLEEP)


class Ledger(_HealthOps):
    """The single authority on which shards serve, join a refit, or are restarted.

    Shards are addressed by index. Every operation returns an :class:`Outcome`; every change
    is emitted as a :class:`Transition` to the subscribers, in order, before the call returns.
    Its health operations are :class:`_HealthOps`', its writer and reads
    :class:`_LedgerCore`'s; here, a reading's moves (:meth:`record_reading`), refits, sleep
    and restarts.
    """

    # ------------------------------------------------------------------ readings

    def record_reading(self, i: int, r: Reading) -> Outcome:
        """One watchdog verdict, as the judge summed it up (the table in ``watchdog.py``).

        The whole mapping from a reading to the ledger's moves is here, so that the controller
        only gathers readings and calls this: a restart seen makes a new process first (its
        streaks start at 0), then the health decides. A failed canary during a refit lease
        proves nothing (an engine loading weights may not generate). A STALE shard is not
        lifted by a good read, but in static-weights mode a good canary is its refit: it has
        the only weights there are."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "readings only judge shards that have a process")
        outcome = _UNCHANGED
        if r.restarted:
            outcome = self.observe_incarnation(i, r.incarnation, restarted=True)
        if r.sleep_level is not None and r.sleep_level > 0:
            # Asleep by its own word (the SLEEPING verdict): out of routing, judged on nothing
            outcome = self.report_asleep(i, f"{r.verdict}: {r.summary}",
                                         weights_discarded=r.sleep_level >= 2)
            if s.consecutive_probe_failures:
                self.record_probe(i, True)  # it answered: a failed-read run is over
            return outcome
        if s.state is SLEEPING and r.sleep_level == 0:
            outcome = self.report_awake(i, f"reports awake: {r.summary}")  # unless held
        if s.state is SLEEPING:
            # Still asleep (the trainer holds it, or it exports no sleep state): only a read
            # that failed to reach it counts; a sleeper's silence to a canary proves nothing.
            if r.health == "failing" and r.canary_ok is None:
                return self.record_probe(i, False, f"{r.verdict}: {r.summary}")
            if r.health != "failing" and s.consecutive_probe_failures:
                return self.record_probe(i, True)
            return outcome
        if r.canary_ok is False and r.excused:
            return outcome
        why = f"{r.verdict}: {r.canary_error or r.summary}"
        if r.health == "proven" and not r.progress_proves and not r.canary_ok:
            return outcome  # progress that may predate the accusation
        if r.health == "condemned":
            return self.condemn(i, f"{r.verdict}: {r.summary}")
        if s.state is STALE and r.health == "proven":
            if self.policy.weights == "static" and r.canary_ok and not s.weights_discarded:
                version = max((x.weight_version for x in self._shards), default=0)
                return self.report_refit(i, version)
            return self.record_probe(i, True)
        if r.health == "proven":
            return self.record_probe(i, True, generated=bool(r.canary_ok))
        if r.health == "failing":
            return self.record_probe(i, False, why)
        return outcome

    # ------------------------------------------------------------------ refits

    def weights_loaded(self) -> bool:
        """Fleetwarden is loading weights into the fleet from a checkpoint (``Fleet.
        refit_from``): ``static`` holds no more. A new process starts with its launch
        command's weights, not the fleet's version, so from now on it waits in STALE until it
        is loaded (a good canary is no refit), and a silent restart loses the weights, as with
        ``weights = "trainer"``. True when this changed the mode. In memory only: a fleetwarden
        restarted on its journal starts ``static`` again (docs/rl.md, the limits)."""
        if self.policy.weights == "trainer":
            return False
        self.policy = replace(self.policy, weights="trainer")
        return True

    def mark_weights_partial(self, i: int,
                             cause: str = "a refit aborted while its weights were loading"
                             ) -> Outcome:
        """A refit aborted while this shard received: its weights are a mix. STALE. (Also a
        load fleetwarden runs itself, from its start: ``cause`` says which.)"""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "absent shards take no part in a refit")
        awake = _awake_state(s)
        before = s.state_before_partial if awake is STALE else awake  # STALE itself would
        # say nothing to the refit that reads it, so an already-STALE shard keeps its value
        asleep: dict[str, Any] = {"state_before_sleep": STALE} if s.state is SLEEPING else {}
        return self._apply(
            s, E.WEIGHTS_PARTIAL, cause,
            state_before_partial=before, **asleep,  # a sleeping shard wakes STALE
        )

    def suspected_shards(self) -> list[int]:
        """SUSPECT shards, and STALE shards that were SUSPECT before an aborted refit (asleep
        or not: a sleeping shard is judged as what it wakes to)."""
        return [
            s.index for s in self._shards
            if (awake := _awake_state(s)) is SUSPECT
            or (awake is STALE and s.state_before_partial is SUSPECT)
        ]

    def condemn_silent_participant(self, i: int, reason: str) -> Outcome:
        """The one suspected shard of an aborted refit: it is what stalled the sync. DEAD."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "already out of the fleet")
        cause = f"silent participant of an aborted refit: {reason}"
        return self._apply(s, E.SILENT_PARTICIPANT, cause, last_error=cause, **_NOT_ASLEEP)

    def missed_refit(self, i: int, version: int) -> Outcome:
        """A refit to ``version`` completed, but this shard's process is not the one that took
        part (it restarted during the sync): it holds other weights. STALE, for the next one."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "absent shards take no part in a refit")
        asleep: dict[str, Any] = {"state_before_sleep": STALE} if s.state is SLEEPING else {}
        return self._apply(
            s, E.MISSED_REFIT,
            f"a new process during the refit to version {version}: it did not get the weights",
            state_before_partial=None,  # a verdict on the process that took part, not this one
            **asleep,  # a sleeping shard wakes STALE
        )

    def refit_unconfirmed(self, i: int, version: int, reported: str) -> Outcome:
        """A refit to ``version`` completed, but this shard's engine does not confirm it
        (``reported``: what it said instead: another version, other checksums, no answer).
        It may hold any weights: STALE, for the next refit, its suspicion kept for it."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "absent shards take no part in a refit")
        awake = _awake_state(s)
        before = s.state_before_partial if awake is STALE else awake
        asleep: dict[str, Any] = {"state_before_sleep": STALE} if s.state is SLEEPING else {}
        cause = f"refit to version {version} not confirmed by the engine: {reported}"
        return self._apply(s, E.REFIT_UNCONFIRMED, cause, last_error=cause,
                           state_before_partial=before, **asleep)

    def report_refit(self, i: int, version: int) -> Outcome:
        """A refit to ``version`` completed on this shard."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "absent shards take no part in a refit")
        was_suspect = _awake_state(s) is SUSPECT or s.state_before_partial is SUSPECT
        common: dict[str, Any] = dict(
            state_before_partial=None,  # read here, once: the refit it waited for has landed
            weights_discarded=False,  # the refit loaded weights into it
            weight_version=version,
            consecutive_probe_failures=0,  # probes judged the old weights
            consecutive_probe_successes=0,  # probes judged the old weights
        )
        if s.state is SLEEPING:  # loaded while asleep: it wakes to what the refit made it
            common["state_before_sleep"] = SUSPECT if was_suspect else HEALTHY
        if was_suspect:
            # The suspicion survives: the refit has nothing to do with why requests failed,
            # and that streak is the only thing that catches an engine which fails every
            # generation while answering every probe. The reported streak is kept.
            return self._apply(
                s, E.REFIT_STILL_SUSPECT, f"refit to version {version}; still suspect", **common,
            )
        return self._apply(
            s, E.REFIT, f"refit to version {version}",
            consecutive_reported_failures=0,  # not suspected: the weights it failed with are gone
            ejections=0,  # HEALTHY: a later ejection starts the backoff afresh
            ejected_until=None,  # not suspected: nothing to keep it out for
            on_trial=False,  # not suspected: nothing to prove
            **common,
        )

    def observe_incarnation(
        self, i: int, incarnation: str | None, *, restarted: bool = False
    ) -> Outcome:
        """The engine was seen under ``incarnation``. A different one means it restarted
        without the supervisor: the new process has no history, and in trainer mode its
        weights reverted to the checkpoint. ``None``: a restart was seen (its counters went
        back) but the engine gives no start time; it is a new process all the same.

        ``restarted``: the watchdog saw the restart itself. Then a shard whose process was
        never identified (an attached engine) has a new process too; without it, the first
        incarnation seen only says who the process is."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "absent shards have no process to observe")
        if incarnation is not None and s.incarnation == incarnation:
            return _UNCHANGED
        if incarnation is None and not restarted:
            return _UNCHANGED  # no name and no restart seen: nothing was observed
        if s.incarnation is None and incarnation is not None and not restarted:
            # The first incarnation seen of this shard: who its process is, not a restart.
            return self._apply(s, E.IDENTIFIED, f"engine identified as {incarnation}",
                               incarnation=incarnation)
        trainer = self.policy.weights == "trainer"
        event = E.NEW_INCARNATION_WEIGHTS_LOST if trainer else E.NEW_INCARNATION
        cause = (f"restarted on its own (incarnation {s.incarnation} -> {incarnation})"
                 if incarnation is not None else "restarted on its own (its counters went back)")
        if incarnation is None:
            # An engine that gives no start time (SGLang, TGI, an `openai` profile) still has
            # a new process: it gets a name of the ledger's own, so that whatever was credited
            # to the old one (a refit's participant, above all) is not credited to this one.
            incarnation = unnamed_incarnation(s.incarnation)
        return self._apply(
            s, event, cause + ("; weights reverted to the checkpoint" if trainer else ""),
            incarnation=incarnation,
            weights_discarded=False,  # a new process loaded the weights it starts with
            consecutive_probe_failures=0,  # the old process failed those probes, not this one
            consecutive_probe_successes=0,  # the old process passed those probes, not this one
            consecutive_reported_failures=0,  # the old process failed those requests
            state_before_partial=None,  # that verdict was about the old process too
            ejections=0,  # the old process was ejected, not this one
            ejected_until=None,  # the old process was ejected, not this one
            on_trial=False,  # the old process was on trial, not this one
            **_NOT_ASLEEP,  # a new process starts awake
        )

    # ------------------------------------------------------------------ sleep mode

    def report_asleep(self, i: int, cause: str, *, held: bool = False,
                      weights_discarded: bool = False) -> Outcome:
        """The engine is asleep (it says so, or the trainer put it to sleep: ``held``). It
        serves nothing until it wakes; it wakes to the state it slept in.

        ``weights_discarded``: a level-2 sleep (vLLM frees the weights, not only offloads
        them). Awake again it holds no weights at all, so it wakes STALE whatever it slept
        in, and stays out of routing (and of every version label) until a refit loads some;
        what it was before is kept for that refit, as an aborted refit's is."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "absent shards have no process to sleep")
        lost: dict[str, Any] = {}
        if weights_discarded:
            awake = _awake_state(s)
            lost = dict(
                weights_discarded=True,
                state_before_sleep=STALE,  # no weights: it wakes STALE, for a refit
                # what the refit that gives it weights reads (STALE says nothing, so an
                # already-STALE shard keeps its value)
                state_before_partial=s.state_before_partial if awake is STALE else awake,
            )
        if s.state is SLEEPING:
            if (held and not s.sleep_held) or (lost and not s.weights_discarded):
                return self._apply(s, E.ASLEEP, cause, sleep_held=s.sleep_held or held, **lost)
            return _UNCHANGED
        return self._apply(s, E.ASLEEP, cause, **{"state_before_sleep": s.state,
                                                  "sleep_held": held, **lost})

    def report_awake(self, i: int, cause: str, *, by_trainer: bool = False) -> Outcome:
        """The engine is awake again: back to the state it slept in (a refit while asleep
        changed that). No counter moves: a sleep proves nothing either way. A shard the
        trainer put to sleep wakes only by the trainer's word (``by_trainer``)."""
        s = self._shard(i)
        if s.state is not SLEEPING:
            return self._ignored(s, "only a sleeping shard wakes")
        if s.sleep_held and not by_trainer:
            return self._ignored(s, "the trainer holds it asleep until its wake")
        to = s.state_before_sleep
        event = E.WOKE_SUSPECT if to is SUSPECT else E.WOKE_STALE if to is STALE else E.WOKE
        return self._apply(s, event, cause, **_NOT_ASLEEP)

    def sleeping(self) -> list[int]:
        return [s.index for s in self._shards if s.state is SLEEPING]

    def new_run(self, i: int, base_url: str, incarnation: str | None) -> Outcome:
        """fleetwarden started again (after a clean stop, or its own crash) and this shard, which
        had a process, has a new one that no failure of its own made necessary: no restart is
        spent (fleetwarden's death is not the engine's failure), and the new process starts
        with no history. In trainer mode it holds the checkpoint's weights: STALE until the
        next refit. A STALE shard stays STALE (its weights were not current before either)."""
        s = self._shard(i)
        if s.state in ABSENT:
            return self._ignored(s, "a shard with no process is restarted, not run anew")
        other = self._by_url.get(base_url)
        if other is not None and other != i:
            return self._ignored(s, f"{base_url} already belongs to shard {other}")
        trainer = self.policy.weights == "trainer"
        event = E.NEW_RUN_WEIGHTS_LOST if trainer else E.NEW_RUN
        return self._apply(
            s, event, f"fleetwarden started again: a new engine at {base_url}, no restart spent"
            + ("; weights are the checkpoint's" if trainer else ""),
            base_url=base_url,
            incarnation=incarnation,
            consecutive_probe_failures=0,  # the last run's process failed those probes
            consecutive_probe_successes=0,  # the last run's process passed those probes
            consecutive_reported_failures=0,  # the last run's process failed those requests
            state_before_partial=None,  # a verdict on the last run's process
            weights_discarded=False,  # the new engine loaded the weights it starts with
            ejected_until=None,  # the last run's process was ejected, not this one: a HEALTHY
            # shard kept out of routing by a time that passed is never pushed again
            on_trial=False,  # the last run's process was on trial, not this one
            ejections=0,  # the backoff counted the last run's process's ejections
            last_error="",
            **_NOT_ASLEEP,  # a new process starts awake
        )

    # ------------------------------------------------------------------ restarts

    def mark_restarting(self, i: int) -> Outcome:
        """The supervisor starts a replacement for a DEAD shard; it spends one restart."""
        s = self._shard(i)
        if s.state is not DEAD:
            return self._ignored(s, "only a DEAD shard is restarted")
        attempts = s.restart_attempts + 1
        limit = self.policy.max_restart_attempts
        if attempts > limit:
            cause = f"restart budget exhausted ({limit} restarts used)"
            return self._apply(
                s, E.BUDGET_EXHAUSTED, cause, restart_attempts=attempts, last_error=cause
            )
        return self._apply(
            s, E.RESTART_BEGUN, f"restart {attempts} of {limit}", restart_attempts=attempts
        )

    def mark_restart_failed(self, i: int, error: str) -> Outcome:
        """The replacement did not come up; the shard is DEAD again, awaiting the next try."""
        s = self._shard(i)
        if s.state is not RESTARTING:
            return self._ignored(s, "no restart is in progress")
        cause = f"restart failed: {error}"
        return self._apply(s, E.RESTART_FAILED, cause, last_error=cause)

    def mark_loaded(self, i: int, base_url: str, incarnation: str | None) -> Outcome:
        """The replacement answers at ``base_url``. It is a new process with no history
        (``incarnation`` None: not known yet; the watchdog's first read identifies it)."""
        s = self._shard(i)
        if s.state is not RESTARTING:
            return self._ignored(s, "no restart is in progress")
        other = self._by_url.get(base_url)
        if other is not None and other != i:
            # A launcher can be handed a port that a DEAD or RETIRED shard still records: the
            # attempt fails, the caller goes on (two shards on one URL would share evidence).
            return self._ignored(s, f"{base_url} already belongs to shard {other}")
        return self._apply(
            s, E.LOADED, f"replacement up at {base_url}",
            base_url=base_url,
            incarnation=incarnation,
            consecutive_probe_failures=0,  # the dead process failed those probes, not this one
            consecutive_probe_successes=0,  # the dead process passed those probes, not this one
            consecutive_reported_failures=0,  # the dead engine failed those requests, not this one
            state_before_partial=None,  # that verdict was about the dead engine too (note 001)
            ejections=0,  # the dead engine was ejected, not this one
            ejected_until=None,  # the dead engine was ejected, not this one
            on_trial=False,  # the dead engine was on trial, not this one
            weights_discarded=False,  # the replacement loaded the weights it starts with
            last_error="",
        )

    def retire(self, i: int, reason: str) -> Outcome:
        """Take a shard out for good (an operator's decision)."""
        s = self._shard(i)
        if s.state is RETIRED:
            return self._ignored(s, "already retired")
        return self._apply(s, E.RETIRED_BY_OPERATOR, reason, last_error=reason, **_NOT_ASLEEP)


# ---------------------------------------------------------------------- admission
#
# Three things keep an engine that serves out of routing, each with its way back:
#
# * ejected (the transition table): failed requests; proof (an answered canary, a completed
#   request) puts it on trial, one request at a time, and the panic threshold lets it serve when
#   too few others are left;
# * held (the hold table below): focused reads of an accused engine hold it out while they watch
#   it, no verdict (the ledger still calls it HEALTHY); the hold ends when its cause does, or at
#   its until-time, whichever comes first, and is not taken again for the same accusation;
# * none of it leaves the routers nothing: a held engine still serves when it is all there is
#   (:func:`never_empty`), as an ejected one does below the panic threshold.
#
# The hold table does no I/O, reads no clock (its caller passes the ledger's time in) and emits
# nothing: :class:`Admission` owns it, applies its operations and emits each change as a
# transition (docs/design.md section 2), as h11's ``_state.py`` keeps its tables apart from the
# connection that drives them.


class Admitted(enum.Enum):
    """What the routers may do with a shard's engine now."""

    ROUTED = "routed"  # serving, pushed to every router
    ON_TRIAL = "on trial"  # pushed, one request at a time until one completes
    EJECTED = "ejected"  # serving, out of routing for failed requests until proof
    HELD = "held"  # serving, out of routing while focused reads watch it (no verdict)
    OUT = "out"  # no state that serves: STALE, asleep, condemned, restarting, retired

    def __str__(self) -> str:
        return self.value


class HoldCause(enum.Enum):
    """Why focused reads hold an engine out of routing (reads.py's :class:`Focus`)."""

    #: A lost core (no work in its gauges, a request held with no step): its held requests
    #: are hedged, and a canary sent with them watches it.
    LOST_CORE = "a lost core its hedges' canary watches"
    #: It shows work, holds hedged requests and takes no step.
    STALLED = "hedged requests, work shown and no step taken"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class Hold:
    """One URL's hold: why, since when, and the time at which it holds nothing more."""

    causes: frozenset[HoldCause]
    since: float
    until: float

    @property
    def why(self) -> str:
        """Its causes, in words."""
        return ", ".join(sorted(map(str, self.causes)))

    def holds(self, now: float) -> bool:
        """Whether it still holds at ``now``: up to, not at, its until-time."""
        return now < self.until


class Holds:
    """The hold table, by URL. Every operation takes the time from its caller (the ledger's
    clock) and returns what it changed, ``None`` when it changed nothing."""

    def __init__(self) -> None:
        self._held: dict[str, Hold] = {}
        #: URLs whose hold ran out: not held again until their accusation's reads end.
        self._spent: set[str] = set()

    def get(self, url: str) -> Hold | None:
        return self._held.get(url)

    def spent(self, url: str) -> bool:
        return url in self._spent

    def hold(self, url: str, cause: HoldCause, now: float, for_s: float) -> Hold | None:
        """Hold ``url`` for ``cause``: the new hold, or ``None`` (held so already, or spent).
        The until-time is set by the first cause; a second one adds to the hold, never
        lengthens it (a hold is at most ``for_s``, whatever holds it)."""
        if url in self._spent:
            return None
        old = self._held.get(url)
        if old is not None and cause in old.causes:
            return None
        new = (Hold(frozenset({cause}), now, now + for_s) if old is None
               else replace(old, causes=old.causes | {cause}))
        self._held[url] = new
        return new

    def release(self, url: str, cause: HoldCause) -> Hold | None:
        """``cause`` ends: the hold as it was, or ``None`` (``cause`` did not hold it). The
        URL stays held for its other causes, to the same until-time."""
        old = self._held.get(url)
        if old is None or cause not in old.causes:
            return None
        rest = old.causes - {cause}
        if rest:
            self._held[url] = replace(old, causes=rest)
        else:
            del self._held[url]
        return old

    def due(self, now: float) -> list[str]:
        """The URLs whose hold no longer holds at ``now`` (:meth:`expire` ends them)."""
        return [url for url, h in self._held.items() if not h.holds(now)]

    def expire(self, url: str) -> Hold | None:
        """End ``url``'s hold at its until-time, every cause at once: spent until
        :meth:`reads_ended`."""
        old = self._held.pop(url, None)
        if old is not None:
            self._spent.add(url)
        return old

    def reads_ended(self, url: str) -> None:
        """``url``'s accusation's reads ended: a new accusation may hold it again."""
        self._spent.discard(url)

    def held(self, now: float) -> set[str]:
        """The URLs held at ``now`` (a hold past its until-time holds nothing, expired or
        not yet)."""
        return {url for url, h in self._held.items() if h.holds(now)}


def never_empty(serving: Sequence[str], held: Set[str]) -> list[str]:
    """``serving`` less the URLs ``held``, unless that would leave none: an engine in doubt
    still serves when it is all there is (a held engine is no condemned one)."""
    kept = [url for url in serving if url not in held]
    return kept or list(serving)


def admitted(*, serves: bool, ejected: bool, on_trial: bool, held: bool,
             panicking: bool) -> Admitted:
    """One shard's admission from the ledger's facts: ``serves`` (a ROUTABLE state),
    ``ejected`` (an ejection's time set), ``on_trial``, ``held`` (held now) and whether the
    fleet is below its panic threshold (ejected engines serve then). Held is reported before
    the never-empty rule, which looks at the whole fleet (:func:`never_empty`)."""
    if not serves:
        return Admitted.OUT
    if ejected and not panicking:
        return Admitted.EJECTED
    if held:
        return Admitted.HELD
    return Admitted.ON_TRIAL if on_trial else Admitted.ROUTED


class Admission:
    """Who the routers may use, decided in one place: the ledger's states and ejections, the
    panic threshold, trials, and the holds of focused reads (:class:`Holds`), with the
    rule that a hold never leaves none. Every change of a hold is emitted as a
    :class:`Transition` of its shard (a self-loop: :data:`TRANSITIONS`); time is the ledger's
    clock, and a hold ends at its until-time at the first :meth:`expire` after it (the tick's,
    or a focused read's), holding nothing from that time on whenever it is asked."""

    def __init__(self, ledger: _LedgerCore) -> None:
        self._ledger = ledger
        self._holds = Holds()

    # ------------------------------------------------------------------ the fleet's sets

    def _members(self) -> list[_Shard]:
        return self._ledger._shards

    def serving_urls(self) -> list[str]:
        """Serving shards, less those ejected for failed requests (a shard on trial is in,
        and :meth:`trial_urls` says which); below the panic threshold, every serving shard,
        ejected or not (:meth:`panicking`). Before any hold: :meth:`routed` is the pushed set."""
        if self.panicking():
            return [s.base_url for s in self._members() if s.state in ROUTABLE]
        return [s.base_url for s in self._members()
                if s.state in ROUTABLE and s.ejected_until is None]

    def routed(self) -> list[str]:
        """What the routers may use: :meth:`serving_urls` less the engines held out, unless
        none would be left (:func:`never_empty`, the panic threshold's floor: an ejection
        yields when too few others are left, a hold when none is)."""
        return never_empty(self.serving_urls(), self.held())

    def panicking(self) -> bool:
        """Envoy's panic rule: fewer than ``panic_threshold_percent`` of the fleet's shards
        (RETIRED ones are no longer part of it) are routable, and some that are ejected could
        serve. Ejection then yields: a failed request was evidence against an engine, not a
        condemnation, and the others that would take its load are too few (or none: a 409
        for every client while engines that answer stand by)."""
        members = [s for s in self._members() if s.state is not RETIRED]
        routable = sum(1 for s in members if s.state in ROUTABLE and s.ejected_until is None)
        ejected = any(s.state in ROUTABLE and s.ejected_until is not None for s in members)
        percent = self._ledger.policy.panic_threshold_percent
        return ejected and 100 * routable < percent * len(members)

    def trial_urls(self) -> list[str]:
        """Routable shards on probation: a router sends each one request at a time."""
        return [s.base_url for s in self._members()
                if s.state in ROUTABLE and s.ejected_until is None and s.on_trial]

    def ejected(self) -> list[int]:
        """Serving shards kept out of routing for failed requests, until proof."""
        return [s.index for s in self._members()
                if s.state in ROUTABLE and s.ejected_until is not None]

    def of(self, i: int) -> Admitted:
        """Shard ``i``'s admission now (before the never-empty rule, which looks at all)."""
        s = self._ledger._shard(i)
        return admitted(serves=s.state in ROUTABLE, ejected=s.ejected_until is not None,
                        on_trial=s.on_trial, held=s.base_url in self.held(),
                        panicking=self.panicking())

    # ------------------------------------------------------------------ holds

    def held(self) -> set[str]:
        """The URLs held out of routing now (on the ledger's clock)."""
        return self._holds.held(self._ledger.now())

    def holds(self, url: str, cause: HoldCause) -> bool:
        """Whether ``url`` is held for ``cause`` now."""
        h = self._holds.get(url)
        return h is not None and cause in h.causes and h.holds(self._ledger.now())

    def hold(self, url: str, cause: HoldCause, for_s: float) -> Outcome:
        """Hold ``url``'s engine out of routing for ``cause``, for at most ``for_s`` from its
        first cause; not again once a hold of it ran out, until its reads end
        (:meth:`reads_ended`). Ignored for a URL no shard with a process has."""
        self.expire()  # a hold past its until-time is spent before it is asked again
        s = self._process(url)
        if s is None:
            return Outcome(applied=False, reason=f"{url}: no shard with a process has it")
        now = self._ledger.now()
        new = self._holds.hold(url, cause, now, for_s)
        if new is None:
            return _UNCHANGED
        return self._ledger._emit(s, s.state, E.HELD, f"held out of routing: {cause} (until "
                                  f"{new.until:.3f}, {for_s:g} s at most)", now)

    def release(self, url: str, cause: HoldCause) -> Outcome:
        """``cause`` no longer holds ``url``: routed again unless another cause holds it."""
        if self._holds.release(url, cause) is None:
            return _UNCHANGED
        left = self._holds.get(url)
        return self._note(url, E.RELEASED, f"released: {cause} ended" + (
            "" if left is None else f"; still held: {left.why}"))

    def expire(self) -> list[Outcome]:
        """End every hold at or past its until-time (the ledger's clock): all its causes at
        once, and none again for that accusation."""
        now = self._ledger.now()
        out = []
        for url in self._holds.due(now):
            old = self._holds.expire(url)
            assert old is not None
            out.append(self._note(url, E.HOLD_EXPIRED,
                                  f"hold expired after {old.until - old.since:g} s ({old.why})"))
        return out

    def reads_ended(self, url: str) -> Outcome:
        """``url``'s focused reads ended: its stalled hold ends with them, and a new
        accusation may hold it again."""
        self._holds.reads_ended(url)
        return self.release(url, HoldCause.STALLED)

    def _process(self, url: str) -> _Shard | None:
        i = self._ledger.shard_for_url(url)
        if i is None:
            return None
        s = self._ledger._shard(i)
        return None if s.state in ABSENT else s

    def _note(self, url: str, event: Event, cause: str) -> Outcome:
        """Emit a hold's end: a shard with no process (or no shard) routes nothing, and has
        no move for it, so its hold ends silently."""
        s = self._process(url)
        if s is None:
            return _UNCHANGED
        return self._ledger._emit(s, s.state, event, cause, self._ledger.now())


#: The prefix of the incarnations the ledger names itself (:func:`unnamed_incarnation`).
UNNAMED_PREFIX = "restart-seen-"


def unnamed_incarnation(previous: str | None) -> str:
    """A name for a new process of an engine that gives no start time: the restart the ledger
    saw, counted (``restart-seen-1``, ``-2`` ...), never equal to the name it replaces."""
    n = 0
    if previous is not None and previous.startswith(UNNAMED_PREFIX):
        tail = previous[len(UNNAMED_PREFIX):]
        n = int(tail) if tail.isdigit() else 0
    return f"{UNNAMED_PREFIX}{n + 1}"


#: The fields of a shard that is not asleep (every move out of SLEEPING writes them).
_NOT_ASLEEP: Mapping[str, Any] = {"state_before_sleep": None, "sleep_held": False}


def _awake_state(s: _Shard) -> ShardState:
    """What the shard is, or wakes to when asleep: what refits and their aborts read."""
    if s.state is SLEEPING and s.state_before_sleep is not None:
        return s.state_before_sleep
    return s.state


def same_counters(a: ShardRecord, b: ShardRecord) -> bool:
    """Two records agree on everything but timestamps (what a journal restore must keep)."""
    return (
        a.index == b.index
        and a.base_url == b.base_url
        and a.state is b.state
        and a.incarnation == b.incarnation
        and a.last_error == b.last_error
        and all(getattr(a, f) == getattr(b, f) for f in _COUNTER_FIELDS)
    )
