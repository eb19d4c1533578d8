"""An accusation's course: what each focused read of an accused engine asks, and what its report
leads to (read again with or without a canary, hold or release, hedge, done).

Owns: when a read of the round starts an accusation (:func:`accused_by`); one accusation from
read to read (:class:`Accusation`): whether a read sends a canary and
reads the health path, whether the engine is held for a stall or released, which hedge its report
asks for, and when the reads conclude (proven, nothing left to prove, or their time is up).
Must not: do I/O or read a clock (focus.py reads, and passes the time and the ledger's facts in),
conclude what a read means (the judge's report does: ``hedge()``, ``settled``), or decide who is
routed or for how long (the ledger's admission does).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetwarden.judge import Hedge, Report, Verdict

__all__ = ["Accusation", "Facts", "Next", "Plan", "accused_by"]


@dataclass(frozen=True, slots=True)
class Facts:
    """What the ledger says of the accused shard at one moment of a read."""

    #: SLEEPING: never canaried (a canary to an engine in vLLM's sleep mode waits until it
    #: wakes) nor judged stuck.
    asleep: bool
    #: Out of routing for failed requests until this time (the ledger's clock), or ``None``.
    ejected_until: float | None
    #: Ejected and its time out is up: proof may now put it on trial.
    ejection_due: bool
    #: SUSPECT on reads alone (not ejected, not on trial): an idle engine proves itself by
    #: nothing but a canary.
    in_doubt: bool


@dataclass(frozen=True, slots=True)
class Plan:
    """What one read asks of the engine."""

    #: Send a canary with the read (if the engine is idle: the watchdog's rule).
    canary: bool
    #: Read its health path too: out of routing for failed requests, where that proves a dead
    #: core (vLLM's API server outlives its killed core for seconds, /metrics frozen, /health
    #: 503).
    check_health: bool


@dataclass(frozen=True, slots=True)
class Next:
    """What one read's report leads to, in this order: the hold, then the hedge."""

    #: Held out of routing for a stall (``True``), or released from that hold (``False``).
    hold_stalled: bool
    #: The hedge its report asks for (``None``: none), after ``held_s`` with no step.
    hedge: Hedge | None
    held_s: float
    #: A silent engine's hedges go on between its reads (a silent read takes its whole
    #: ``silence_read_s``).
    between_reads: bool


class Accusation:
    """One run of focused reads of an accused engine, as decisions: :meth:`plan` before each
    read, :meth:`read` and :meth:`next` on its report, :meth:`concluded` once its hedges were
    asked for. Until ``deadline`` (the caller's clock)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        #: The first read answers the accusation itself: a canary whatever the engine's state.
        self.first = True
        #: The ejection a canary was sent for (once per ejection when its time is up).
        self._canaried_for: float | None = -1.0

    def plan(self, facts: Facts) -> Plan:
        """A canary, if the engine is idle: on the first read (the accusation itself), at
        every read of an engine in doubt (as the round does, reads.py ``_target``), and
        once per ejection when its time is up (the only proof that puts it on trial; a busy
        engine gets none, and is asked again at the next read). Never to a sleeper."""
        due = facts.ejection_due and self._canaried_for != facts.ejected_until
        canary = not facts.asleep and (self.first or facts.in_doubt or due)
        return Plan(canary=canary, check_health=facts.ejected_until is not None)

    def read(self, facts: Facts, plan: Plan, report: Report) -> None:
        """The read planned on ``facts`` came back: a canary it sent for an ejection whose
        time was up is that ejection's one."""
        if facts.ejection_due and plan.canary and report.canary is not None:
            self._canaried_for = facts.ejected_until

    def next(self, report: Report, *, hedge_after_s: float, held_stalled: bool) -> Next:
        """What ``report`` leads to, given whether the engine is held for a stall now: held
        for a stall while its hedge is a step's (work shown, no step taken), and while it
        stays STALLED or SILENT once held (the hold is no verdict: a read that shows a step
        routes it again); and the hedge it asks for."""
        hedge = report.hedge(hedge_after_s)
        hold = hedge is Hedge.STEP or (
            held_stalled and report.verdict in (Verdict.STALLED, Verdict.SILENT))
        return Next(hold_stalled=hold, hedge=hedge, held_s=report.hedge_after(hedge_after_s),
                    between_reads=hedge is Hedge.STEP and report.verdict is Verdict.SILENT)

    def concluded(self, report: Report, after: Facts, now: float) -> bool:
        """Whether the reads conclude at ``report``, given the ledger's facts once it was
        entered and its hedges asked for (``after``), at the caller's time ``now``: a read
        after the first that settles (proven, or nothing to prove) on an engine neither
        ejected nor in doubt (the tick takes over again), or the deadline. Else the next read
        is no longer the first."""
        settled = (not self.first and report.settled and after.ejected_until is None
                   and not after.in_doubt)
        self.first = False
        return settled or now >= self.deadline


def accused_by(report: Report, *, has_process: bool, in_doubt: bool) -> str | None:
    """Why a read of the round starts focused reads of its engine (``None``: it does not): a
    read that accuses (a stall, an unreachable read ...) of a shard with a process, by its
    verdict's name; or one that left it in doubt (SUSPECT on reads alone, a first canary that
    timed out, a failed read), ``suspect``: it needs ``healthy_threshold`` good reads in a row
    to be lifted, and the round comes back to it only once per round, which at a thousand
    engines is a minute or more. Focused reads settle the doubt at their own pace, whatever
    the fleet's size."""
    if report.accuses and has_process:
        return report.verdict.name.lower()
    return "suspect" if in_doubt else None
