"""Refit: what an RL trainer calls around a weight sync (docs/design.md section 8).

Owns: a refit's lease, its participants and its outcome, through the ledger's operations.
Must not: do I/O (pure, an injected clock), or push to routers (the controller does).

``begin_refit(version)`` names the participants (serving and STALE shards: everyone with a
process that can take new weights) and opens a lease; while it is open the watchdog does not
judge stalls on them (an engine may pause generation while it loads weights).
``complete_refit(version)`` is ``report_refit`` for each participant still present: STALE →
HEALTHY, or back to SUSPECT when it was suspected before an abort. ``abort_refit(version,
reason)`` is ``mark_weights_partial`` for the participants, and when exactly one shard is
suspected it is the one that stalled the sync: ``condemn_silent_participant``.

**Credit only what the engine confirms.** Where the engine can say what it holds (vLLM's ``GET
/weight_info`` and ``POST /weight_checker``: :class:`EngineWeights`, read by the fleet at the
completion), a participant is credited only when its own reported version is the refit's and,
when the trainer gave checksums, its checksums are those (:func:`confirmation`); one that
disagrees is left STALE (``refit_unconfirmed``), never routed, and the refit's record names it
with what it reported. An engine that cannot say (no ``/weight_info``: SGLang, TGI, llama.cpp,
``openai`` profiles, a vLLM without dev mode) is credited on the lease's reads alone, as
before: a weaker rule, which proves the process lived through the sync, not that it loaded.

A lease that overruns marks its participants SUSPECT with the cause, once, and is closed; only
those the lease names as culprits (gone, or not answering) are also ejected, so the old
weights go on serving.

While a lease is open, each participant's liveness is kept on it as the controller sees it
every tick (:meth:`RefitCoordinator.observe_participant`): whether its process lives and its API
answers, since when, and the evidence. A trainer whose broadcast hangs reads that (``GET
/admin/refits``, ``FleetClient.refit_status()``) and aborts with the culprit named; a silent
participant is SUSPECT after one failed read, so the abort condemns it (the single suspect).

Pure: no I/O, an injected clock. The admin API and the in-process Python API both call this.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from fleetwarden.ledger import ABSENT, UNNAMED_PREFIX, Ledger

__all__ = ["CANNOT_SAY", "EngineWeights", "Lease", "ParticipantStatus", "ProcessSeen",
           "RefitCoordinator", "RefitError", "RefitRecord", "confirmation"]

#: The default of ``[refit] lease_s`` (``config.py`` gives its reason).
DEFAULT_LEASE_S = 300.0
#: Refits remembered in memory (the admin API shows the last 100). An RL run refits every
#: step, tens of thousands of times; the journal's transitions keep what each one did.
HISTORY_KEPT = 1000


class RefitError(Exception):
    """A refit call out of order (no lease, another lease open, a version mismatch)."""


@dataclass(frozen=True, slots=True)
class Participant:
    shard: int
    url: str
    #: The process that takes part: a shard whose process changed during the sync (same URL,
    #: new process) did not get the weights, whatever its URL says.
    incarnation: str | None = None


@dataclass(frozen=True, slots=True)
class ProcessSeen:
    """Who a participant's process was at one of the lease's own reads (at its start, at its
    end): the start time the engine gives (``None``: it gives none) and its counters, which a
    new process starts from zero."""

    start_time: str | None = None
    counters: Mapping[str, float] = field(default_factory=dict)

    def same_process(self, later: ProcessSeen) -> bool:
        """``later`` (a read after this one) shows no other process: no new start time, no
        counter gone back. What neither read knows (no start time, no counters) proves
        nothing either way."""
        if (self.start_time is not None and later.start_time is not None
                and self.start_time != later.start_time):
            return False
        return all(later.counters.get(name, value) >= value
                   for name, value in self.counters.items())


@dataclass(frozen=True, slots=True)
class EngineWeights:
    """What an engine said of its own weights when it was asked (at a refit's completion)."""

    #: It has a way to say (vLLM's ``/weight_info``); ``False``: none (another engine, a
    #: vLLM without dev mode answering 404), and the refit is credited on the lease's reads.
    can_say: bool
    #: The weight version it reports (``None``: the read failed).
    version: str | None = None
    #: Its weights' checksums (``None``: not read, or the read failed).
    checksums: Mapping[str, str] | None = None
    #: Why a read failed (empty when it did not).
    error: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"can_say": self.can_say, "version": self.version,
                "checksums": None if self.checksums is None else dict(self.checksums),
                "error": self.error}


#: What an engine with no way to say its weights says.
CANNOT_SAY = EngineWeights(can_say=False)


def confirmation(version: int, checksums: Mapping[str, str] | None,
                 said: EngineWeights) -> tuple[bool | None, str]:
    """Whether the engine confirms that it holds ``version`` (and, when the trainer gave
    ``checksums``, those weights): ``(True, ...)`` it does, ``(False, what it reported)`` it
    does not, ``(None, ...)`` it cannot say. A failed read confirms nothing: an engine that
    can say and did not is not credited."""
    if not said.can_say:
        return None, "the engine cannot say its weights: credited on the lease's reads alone"
    if said.version is None:
        return False, f"its weight version could not be read: {said.error or 'no answer'}"
    if said.version != str(version):
        return False, f"reports weight version {said.version!r}, not {version}"
    if checksums is None:
        return True, f"reports weight version {version}"
    if said.checksums is None:
        return False, (f"reports weight version {version}, but its checksums could not be "
                       f"read: {said.error or 'no answer'}")
    differ = sorted(k for k in checksums.keys() | said.checksums.keys()
                    if checksums.get(k) != said.checksums.get(k))
    if differ:
        return False, (f"reports weight version {version}, but its checksums differ from the "
                       f"trainer's on {len(differ)} of {len(checksums)} parameters "
                       f"({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})")
    return True, f"reports weight version {version} and the trainer's checksums"


@dataclass(frozen=True, slots=True)
class ParticipantStatus:
    """One participant of an open lease, as the controller last saw it."""

    shard: int
    url: str
    #: Its process lives: the shard still has it (not condemned, not replaced).
    process_alive: bool
    #: Its API answered the last read (``/metrics`` or ``/health``); ``None``: not read yet.
    api_answers: bool | None
    #: When this (process_alive, api_answers) began: the first read that saw it.
    since: float
    #: What the last read found (the watchdog's summary, or why the process is gone).
    evidence: str

    @property
    def culprit(self) -> bool:
        """What a hung broadcast waits on: a participant gone, or one that does not answer."""
        return not self.process_alive or self.api_answers is False

    def to_dict(self) -> dict[str, object]:
        return {"shard": self.shard, "url": self.url, "process_alive": self.process_alive,
                "api_answers": self.api_answers, "since": self.since,
                "evidence": self.evidence, "culprit": self.culprit}


@dataclass(slots=True)
class Lease:
    version: int
    participants: tuple[Participant, ...]
    started_at: float
    deadline: float
    #: Each participant's liveness, as the controller last saw it (by shard).
    status: dict[int, ParticipantStatus] = field(default_factory=dict)
    #: Participants seen gone or not answering at some read of the lease: for an engine that
    #: gives no start time, the only sign of a restart that its counters did not betray.
    interrupted: set[int] = field(default_factory=set)
    #: Participants whose read at the lease's start did not answer (:meth:`RefitCoordinator.
    #: read_at_start`): no baseline, so no read at the end can tell whether they restarted.
    unread_at_start: set[int] = field(default_factory=set)
    #: Each participant's process as the read at the lease's start saw it: the read at the end
    #: is compared with it directly, not through the ledger's incarnation, which learns of a
    #: restart only from a read that says RESTARTED against the watch's last sample, and any
    #: other read of the engine (a focused read, the tick's) may have moved that sample.
    seen_at_start: dict[int, ProcessSeen] = field(default_factory=dict)

    def culprits(self) -> list[ParticipantStatus]:
        return [s for _, s in sorted(self.status.items()) if s.culprit]

    @property
    def shards(self) -> frozenset[int]:
        return frozenset(p.shard for p in self.participants)


@dataclass(frozen=True, slots=True)
class RefitRecord:
    """One refit in the history: how it ended and who it touched."""

    version: int
    outcome: str  # "completed", "aborted", "overran"
    started_at: float
    ended_at: float
    participants: tuple[int, ...]
    detail: str = ""
    condemned: tuple[int, ...] = field(default=())
    #: Participants credited on their engine's own word (version, and checksums when given).
    confirmed: tuple[int, ...] = field(default=())
    #: Participants whose engine disagreed, with what it reported: left STALE.
    unconfirmed: tuple[tuple[int, str], ...] = field(default=())


class RefitCoordinator:
    def __init__(
        self,
        ledger: Ledger,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.ledger = ledger
        self.lease_s = lease_s
        self.clock = clock
        self.lease: Lease | None = None
        self.history: list[RefitRecord] = []

    @property
    def current_version(self) -> int:
        """The highest version any shard holds: what a new or restarted engine is behind."""
        return max((r.weight_version for r in self.ledger.snapshot()), default=0)

    def begin_refit(self, version: int, lease_s: float | None = None) -> Lease:
        if self.lease is not None:
            raise RefitError(f"refit to version {self.lease.version} is still open; complete "
                             "or abort it first")
        if version < self.current_version:
            raise RefitError(f"version {version} is older than the fleet's {self.current_version}")
        now = self.clock()
        participants = tuple(
            Participant(i, rec.base_url, rec.incarnation)
            for i in self.ledger.refit_participants()
            for rec in (self.ledger.shard(i),)
        )
        if not participants:
            raise RefitError("no shard can take weights: every shard is DEAD, RESTARTING or "
                             "RETIRED")
        self.lease = Lease(version, participants, now, now + (lease_s or self.lease_s))
        return self.lease

    def _close(self, version: int) -> Lease:
        lease = self.lease
        if lease is None:
            raise RefitError(f"no refit is open (version {version})")
        if lease.version != version:
            raise RefitError(f"the open refit is to version {lease.version}, not {version}")
        self.lease = None
        return lease

    def complete_refit(self, version: int, *,
                       read_at_end: Mapping[int, ProcessSeen] | None = None,
                       weights: Mapping[int, EngineWeights] | None = None,
                       checksums: Mapping[str, str] | None = None,
                       failed: Mapping[int, str] | None = None) -> RefitRecord:
        """Close the lease, crediting ``version`` to each participant whose process took part
        from its start to its end. ``read_at_end``: the participants read, their API
        answering, after the trainer asked to complete (the fleet reads them all first), with
        what each read saw (:class:`ProcessSeen`); one not among them may have been restarted
        since the ledger last saw it, and one whose process is not the one the read at the
        start saw was: neither is credited. ``None``: no such read (a caller without engines
        to read).

        ``weights``: what each participant's engine said of its own weights (one not among
        them: it cannot say), and ``checksums`` the trainer's: a participant credited by the
        reads is credited only when its engine confirms (:func:`confirmation`); one that
        disagrees is left STALE. ``None``: nobody asked the engines (today's weaker rule).
        ``failed``: participants whose load is known to have failed (fleetwarden ran the sync
        itself: :meth:`fleet.Fleet.refit_from`), with the error: left STALE whatever their
        engine says, since one that cannot say would otherwise be credited."""
        lease = self._close(version)
        done = []
        confirmed: list[int] = []
        unconfirmed: list[tuple[int, str]] = []
        for p in lease.participants:
            # A shard that died during the sync, or whose process was replaced (a new URL, or
            # a new process on the same URL), did not get these weights: it stays out (absent)
            # or STALE (a new process) for the next refit.
            rec = self.ledger.shard(p.shard)
            if rec.state in ABSENT:
                continue
            unread = (p.shard in lease.unread_at_start
                      or (read_at_end is not None and p.shard not in read_at_end))
            if unread or _moved(lease, p.shard, read_at_end) or not _same_process(
                    p, rec.base_url, rec.incarnation) or (
                    p.shard in lease.interrupted and not _named_by_itself(p.incarnation)):
                # A version is credited only to a process known alive through the whole
                # lease. One that gives no start time and stopped answering during it may have
                # been restarted (refused, then back), one not read at its end may have been
                # restarted since the last read, and one whose two lease reads saw two
                # processes was: nothing proves it is the one that received. When the ledger
                # cannot know, it does not credit: STALE.
                self.ledger.missed_refit(p.shard, version)
                continue
            if failed is not None and p.shard in failed:
                why = f"its load failed: {failed[p.shard]}"
                self.ledger.refit_unconfirmed(p.shard, version, why)
                unconfirmed.append((p.shard, why))
                continue
            if weights is not None:
                said, why = confirmation(version, checksums, weights.get(p.shard, CANNOT_SAY))
                if said is False:
                    # Its own word against the trainer's: the engine knows what it loaded.
                    self.ledger.refit_unconfirmed(p.shard, version, why)
                    unconfirmed.append((p.shard, why))
                    continue
                if said:
                    confirmed.append(p.shard)
            if self.ledger.report_refit(p.shard, version):
                done.append(p.shard)
        record = RefitRecord(version, "completed", lease.started_at, self.clock(), tuple(done),
                             confirmed=tuple(confirmed), unconfirmed=tuple(unconfirmed))
        self._remember(record)
        return record

    def read_at_start(self, answered: Mapping[int, ProcessSeen]) -> None:
        """The participants read, their API answering, just after the lease began (the fleet
        reads them all before it answers the trainer), with what each read saw: the baseline
        that the read at the end is compared with (a new start time, counters gone back). A
        participant not among them has none, and is not credited at the completion."""
        if self.lease is not None:
            self.lease.unread_at_start = set(self.lease.shards - answered.keys())
            self.lease.seen_at_start = {i: seen for i, seen in answered.items()
                                        if i in self.lease.shards}

    def abort_refit(self, version: int, reason: str) -> RefitRecord:
        lease = self._close(version)
        touched = []
        gone = set()
        for p in lease.participants:
            rec = self.ledger.shard(p.shard)
            if rec.state in ABSENT or not _same_process(p, rec.base_url, rec.incarnation):
                gone.add(p.shard)
                continue
            if self.ledger.mark_weights_partial(p.shard):
                touched.append(p.shard)
        condemned: tuple[int, ...] = ()
        suspects = [i for i in self.ledger.suspected_shards() if i in lease.shards - gone]
        culprits = {c.shard for c in lease.culprits()}
        if len(suspects) == 1 and not gone and culprits <= set(suspects):
            # Exactly one participant was already failing: it is the one that went silent.
            # With several, or none, nobody can be singled out, and nobody is. Nor when a
            # participant died or was replaced during the sync, or the lease names another
            # culprit: that one explains the hung broadcast, and a suspicion of another
            # engine (one failed request, a slow read) is no proof that it stalled it.
            self.ledger.condemn_silent_participant(suspects[0], f"refit to version {version} "
                                                   f"aborted: {reason}")
            condemned = (suspects[0],)
        record = RefitRecord(version, "aborted", lease.started_at, self.clock(), tuple(touched),
                             reason, condemned)
        self._remember(record)
        return record

    def check_lease(self) -> RefitRecord | None:
        """Called every tick: a lease past its deadline marks its participants SUSPECT.

        Only a participant the lease names as a culprit (gone, or not answering) is also
        ejected from routing. The others are suspected and go on serving the weights they
        held: an overrun is evidence against the sync, not against any one engine, and
        ejecting every participant at once left the fleet with nothing to route (409s for
        every client) while the old weights could serve."""
        lease = self.lease
        if lease is None or self.clock() < lease.deadline:
            return None
        self.lease = None
        cause = (f"refit to version {lease.version} overran its lease of "
                 f"{lease.deadline - lease.started_at:.0f} s")
        culprits = {c.shard for c in lease.culprits()}
        marked = [p.shard for p in lease.participants
                  if self.ledger.shard(p.shard).base_url == p.url
                  and (self.ledger.report_failure(p.shard, cause) if p.shard in culprits
                       else self.ledger.mark_suspect(p.shard, cause))]
        record = RefitRecord(lease.version, "overran", lease.started_at, self.clock(),
                             tuple(marked), cause)
        self._remember(record)
        return record

    def _remember(self, record: RefitRecord) -> None:
        self.history.append(record)
        if len(self.history) > HISTORY_KEPT:
            del self.history[: len(self.history) - HISTORY_KEPT]

    def observe_participant(self, shard: int, *, process_alive: bool,
                            api_answers: bool | None, evidence: str) -> ParticipantStatus | None:
        """What the controller saw of a participant this tick; ``since`` moves only when
        ``process_alive`` or ``api_answers`` changes. ``None`` when no lease has the shard."""
        lease = self.lease
        p = next((p for p in lease.participants if p.shard == shard), None) if lease else None
        if lease is None or p is None:
            return None
        old = lease.status.get(shard)
        since = self.clock()
        if old is not None and (old.process_alive, old.api_answers) == (process_alive,
                                                                        api_answers):
            since = old.since
        status = ParticipantStatus(shard, p.url, process_alive, api_answers, since, evidence)
        lease.status[shard] = status
        if status.culprit:
            lease.interrupted.add(shard)
        return status

    def stalls_excused(self) -> frozenset[int]:
        """Shards whose stalls the watchdog must not judge right now."""
        return self.lease.shards if self.lease is not None else frozenset()


def _moved(lease: Lease, shard: int, read_at_end: Mapping[int, ProcessSeen] | None) -> bool:
    """The lease's own two reads of ``shard`` saw two processes."""
    start = lease.seen_at_start.get(shard)
    if start is None or read_at_end is None or shard not in read_at_end:
        return False
    return not start.same_process(read_at_end[shard])


def _same_process(p: Participant, url: str, incarnation: str | None) -> bool:
    return p.url == url and p.incarnation == incarnation


def _named_by_itself(incarnation: str | None) -> bool:
    """The incarnation is the engine's own start time, or a launch id (a launched process,
    whose exit the supervisor sees): a restart would have changed it. ``None``, or a name
    the ledger gave a restart it saw, proves nothing about a restart it did not see."""
    return incarnation is not None and not incarnation.startswith(UNNAMED_PREFIX)
