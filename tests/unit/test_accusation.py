"""An accusation's course, as decisions alone (the judge's :class:`Accusation`): what each focused
read asks, and what its report leads to. The tests of :class:`Focus` in test_controller.py run the
same course with I/O."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetwarden.judge import (
    Accusation,
    AccusedFacts,
    CanaryResult,
    CanaryRule,
    Evidence,
    Health,
    Hedge,
    Report,
    Verdict,
    accused_by,
)
from support.clock import TICK_S

IDLE = AccusedFacts(asleep=False, ejected_until=None, ejection_due=False, in_doubt=False)
DOUBTED = replace(IDLE, in_doubt=True)
EJECTED = replace(IDLE, ejected_until=1001.0)
DUE = replace(EJECTED, ejection_due=True)
HEDGE_AFTER_S = 1.0
DEADLINE = 1030.0


def read(verdict: Verdict, *, held_flat_s: float = 0.0, canary: bool | None = None) -> Report:
    result = None if canary is None else CanaryResult(canary, 0.5)
    return Report("http://e", verdict, Evidence(verdict.name.lower()), Health.UNPROVEN,
                  CanaryRule.NEVER, None, None, result, None, held_flat_s=held_flat_s)


def test_the_first_read_sends_a_canary_and_a_sleeper_never_gets_one() -> None:
    a = Accusation(DEADLINE)
    assert a.plan(IDLE).canary and not a.plan(IDLE).check_health
    assert not a.plan(replace(IDLE, asleep=True)).canary
    a.concluded(read(Verdict.BUSY), IDLE, 1000.0)
    assert not a.plan(IDLE).canary  # a later read of an engine in no doubt: none
    assert a.plan(DOUBTED).canary  # in doubt: at every read, as the round does


def test_an_ejection_whose_time_is_up_gets_one_canary_that_was_sent() -> None:
    a = Accusation(DEADLINE)
    a.concluded(read(Verdict.IDLE), EJECTED, 1000.0)  # the first read
    plan = a.plan(EJECTED)
    assert not plan.canary and plan.check_health  # within its time: its health path only
    plan = a.plan(DUE)
    assert plan.canary
    a.read(DUE, plan, read(Verdict.BUSY))  # busy: the watchdog sent none; asked again
    assert a.plan(DUE).canary
    a.read(DUE, plan, read(Verdict.IDLE, canary=False))  # sent: that ejection's one
    assert not a.plan(DUE).canary
    assert a.plan(replace(DUE, ejected_until=1003.0)).canary  # a new ejection: a new one


def test_a_step_hedge_holds_and_a_silent_ones_hedges_go_on_between_reads() -> None:
    a = Accusation(DEADLINE)
    step = a.next(read(Verdict.STALLED, held_flat_s=1.5), hedge_after_s=HEDGE_AFTER_S,
                  held_stalled=False)
    assert step.hold_stalled and step.hedge is Hedge.STEP and not step.between_reads
    assert step.held_s == HEDGE_AFTER_S
    silent = a.next(read(Verdict.SILENT, held_flat_s=1.5), hedge_after_s=HEDGE_AFTER_S,
                    held_stalled=True)
    assert silent.hold_stalled and silent.between_reads


@pytest.mark.parametrize(("verdict", "held"), [
    (Verdict.STALLED, True), (Verdict.SILENT, True), (Verdict.BUSY, False),
    (Verdict.IDLE, False)])
def test_a_stall_hold_lasts_while_its_reads_stay_stalled_or_silent(verdict: Verdict,
                                                                    held: bool) -> None:
    # Under hedge_after_s: no hedge of its own, only the hold taken before.
    step = Accusation(DEADLINE).next(read(verdict, held_flat_s=0.1),
                                     hedge_after_s=HEDGE_AFTER_S, held_stalled=True)
    assert step.hedge is None and step.hold_stalled is held


def test_a_lost_core_is_hedged_and_not_held_for_a_stall() -> None:
    step = Accusation(DEADLINE).next(read(Verdict.LOST_CORE, held_flat_s=1.5),
                                     hedge_after_s=HEDGE_AFTER_S, held_stalled=False)
    assert step.hedge is Hedge.LOST_CORE and not step.hold_stalled


@pytest.mark.parametrize(("after", "concludes"), [
    (IDLE, True), (EJECTED, False), (DOUBTED, False)])
def test_a_settled_read_after_the_first_concludes_unless_ejected_or_in_doubt(
        after: AccusedFacts, concludes: bool) -> None:
    a = Accusation(DEADLINE)
    assert not a.concluded(read(Verdict.BUSY), IDLE, 1000.0)  # the first never settles it
    assert a.concluded(read(Verdict.BUSY), after, 1001.0) is concludes
    assert not Accusation(DEADLINE).concluded(read(Verdict.STALLED), IDLE, 1000.0)


@pytest.mark.parametrize(("now", "concludes"), [
    (DEADLINE - TICK_S, False), (DEADLINE, True), (DEADLINE + TICK_S, True)])
def test_the_reads_conclude_at_their_deadline(now: float, concludes: bool) -> None:
    a = Accusation(DEADLINE)
    a.concluded(read(Verdict.STALLED), IDLE, 1000.0)
    assert a.concluded(read(Verdict.STALLED), IDLE, now) is concludes


@pytest.mark.parametrize(("verdict", "has_process", "in_doubt", "why"), [
    (Verdict.STALLED, True, False, "stalled"),
    (Verdict.UNREACHABLE, True, True, "unreachable"),  # the verdict's word first
    (Verdict.SILENT, False, False, None),  # condemned meanwhile: nothing to read again
    (Verdict.IDLE, True, True, "suspect"),  # a read that left it in doubt
    (Verdict.BUSY, True, False, None),
])
def test_a_read_of_the_round_starts_an_accusation(verdict: Verdict, has_process: bool,
                                                  in_doubt: bool, why: str | None) -> None:
    assert accused_by(read(verdict), has_process=has_process, in_doubt=in_doubt) == why
