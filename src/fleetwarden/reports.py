"""What becomes of a finished read: the watchdog's report entered where the fleet keeps it.

Owns: a report's way into the ledger (as a :class:`~fleetwarden.ledger.Reading`), the journal
(its verdict, unless steady) and an open refit lease (the participant's liveness); the last
report per shard and the count of verdicts by name.
Must not: read an engine, or decide what a report means (the judge concluded it; the ledger's
table maps it).

The round (reads.py), the focused reads (focus.py) and a lease's reads of its
participants all enter their reports here, so each is applied one way whoever read it.
"""

from __future__ import annotations

from collections.abc import Mapping

from fleetwarden.journal import Journal
from fleetwarden.ledger import ABSENT, Ledger, Reading
from fleetwarden.refit import RefitCoordinator
from fleetwarden.watchdog import Report

__all__ = ["ReportBook", "reading_of"]


class ReportBook:
    """The fleet's record of the watchdog's reports, and their entry into ledger, journal and
    lease."""

    def __init__(self, ledger: Ledger, *, journal: Journal | None = None,
                 refit: RefitCoordinator | None = None) -> None:
        self.ledger = ledger
        self.journal = journal
        self.refit = refit
        #: The last watchdog report per shard (dashboards read running/waiting/tokens from it).
        self.last: dict[int, Report] = {}
        #: Verdicts seen since start, by name (the fleet's Prometheus counter).
        self.counts: dict[str, int] = {}

    def count(self, r: Report) -> None:
        self.counts[r.verdict.name] = self.counts.get(r.verdict.name, 0) + 1

    def enter(self, i: int, r: Report, *, progress_proves: bool = True) -> None:
        """One watchdog verdict into the ledger: the mapping is the ledger's
        (:meth:`Ledger.record_reading`); this only gathers and calls.

        ``progress_proves`` False: progress without a canary counts for nothing (the first
        focused read of an accused engine compares with a sample older than the accusation)."""
        if self.journal is not None and not r.steady:
            # The steady states of a fleet would flood the journal.
            self.journal.record_verdict(i, r.url, r.verdict.name, r.evidence.to_dict())
        excused = self.refit is not None and i in self.refit.stalls_excused()
        self.ledger.record_reading(i, reading_of(r, excused=excused,
                                                 progress_proves=progress_proves))

    def observe_participants(self, reports: Mapping[str, Report]) -> None:
        """During a lease: whether each participant's process lives and its API answered this
        tick's read, onto the lease (what a trainer whose broadcast hangs reads)."""
        assert self.refit is not None and self.refit.lease is not None
        for p in self.refit.lease.participants:
            self.observe_participant(p.shard, p.url, reports.get(p.url))

    def observe_participant(self, i: int, url: str, r: Report | None) -> None:
        """One read of shard ``i`` (at ``url`` when read) onto the open lease, if it takes
        part; ``None``: not read, only whether its process still lives is known."""
        lease = self.refit.lease if self.refit is not None else None
        p = next((p for p in lease.participants if p.shard == i), None) if lease else None
        if self.refit is None or p is None:
            return
        rec = self.ledger.shard(i)
        # A new process at the same URL (restarted in place) is not the participant's: it
        # did not get the weights, however well it answers. (One not named at the lease's
        # start is told by its URL alone: its first name is no restart.)
        replaced = rec.base_url != p.url or (p.incarnation is not None
                                             and rec.incarnation != p.incarnation)
        if rec.state in ABSENT or replaced:
            self.refit.observe_participant(
                i, process_alive=False, api_answers=None,
                evidence=f"{rec.state}: {rec.last_error}" if rec.last_error
                else f"its process was replaced ({rec.state})")
            return
        if r is None or url != p.url:
            return  # not read (this tick, or at its URL)
        answers = r.answered
        self.refit.observe_participant(
            i, process_alive=True, api_answers=answers,
            evidence=f"{r.verdict.name}: {r.evidence.summary}")


def reading_of(r: Report, *, excused: bool = False, progress_proves: bool = True) -> Reading:
    """A watchdog report as the ledger reads it (plain facts)."""
    return Reading(
        health=r.health.value,  # the same four words
        verdict=r.verdict.name, summary=r.evidence.summary,
        restarted=r.restarted,
        incarnation=r.incarnation,
        # A refused canary (the judge's ASKED_WRONG) proves nothing: as if none was sent.
        canary_ok=None if r.canary is None else r.canary.outcome,
        canary_error=r.canary.error if r.canary is not None else "",
        excused=excused, progress_proves=progress_proves,
        sleep_level=r.sample.sleep_level if r.sample is not None else None,
    )
