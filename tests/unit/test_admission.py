"""Admission: who the routers may use, in the ledger (its :class:`Admission` and hold table).

Every hold ends at its until-time on the ledger's clock, tested one tick either side with a
:class:`~support.clock.Clock` the test moves (a hold ends *at* it, as the timer it replaces
fired at it); every change of a hold is a transition of the ledger's; and a hold never leaves
the routers none, whatever the panic threshold let in.
"""

from __future__ import annotations

import pytest

from fleetwarden.ledger import (
    TRANSITIONS,
    Admitted,
    Event,
    HoldCause,
    Holds,
    Ledger,
    Policy,
    ShardState,
    Transition,
    admitted,
)
from support.clock import TICK_S, Clock

FOR_S = 3.0  # a hold's longest life in these tests (the fleet's: health.stall_s)
LOST, STALLED = HoldCause.LOST_CORE, HoldCause.STALLED


def make(n: int = 3, **policy: object) -> tuple[Ledger, Clock, list[Transition], list[str]]:
    clock = Clock()
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
    ledger = Ledger(urls, Policy(**policy), clock=clock)  # type: ignore[arg-type]
    seen: list[Transition] = []
    ledger.subscribe(seen.append)
    return ledger, clock, seen, urls


def _either_side(until: float) -> list[tuple[float, bool]]:
    """(time, still held) one tick before, at and one tick after ``until``."""
    return [(until - TICK_S, True), (until, False), (until + TICK_S, False)]


# ------------------------------------------------------------------ the pure table


@pytest.mark.parametrize(("at", "held"), _either_side(1000.0 + FOR_S))
def test_the_table_holds_until_its_until_time(at: float, held: bool) -> None:
    holds = Holds()
    hold = holds.hold("u", LOST, 1000.0, FOR_S)
    assert hold is not None and hold.until == 1000.0 + FOR_S
    assert (holds.held(at) == {"u"}) is held
    assert (holds.due(at) == []) is held


def test_a_second_cause_adds_to_a_hold_and_never_lengthens_it() -> None:
    holds = Holds()
    holds.hold("u", STALLED, 1000.0, FOR_S)
    second = holds.hold("u", LOST, 1002.0, FOR_S)
    assert second is not None and second.causes == {STALLED, LOST}
    assert second.until == 1000.0 + FOR_S
    assert holds.hold("u", LOST, 1002.5, FOR_S) is None  # held so already
    assert holds.release("u", STALLED) is not None
    assert holds.held(1002.9) == {"u"}  # the other cause still holds it
    assert holds.release("u", LOST) is not None and holds.held(1002.9) == set()
    assert holds.release("u", LOST) is None  # nothing left to release


def test_a_hold_that_ran_out_is_spent_until_its_reads_end() -> None:
    holds = Holds()
    holds.hold("u", LOST, 1000.0, FOR_S)
    assert holds.expire("u") is not None and holds.spent("u")
    assert holds.hold("u", STALLED, 1004.0, FOR_S) is None
    holds.reads_ended("u")
    assert holds.hold("u", STALLED, 1004.0, FOR_S) is not None


@pytest.mark.parametrize(("facts", "expected"), [
    ({"serves": False, "ejected": False, "on_trial": False, "held": True}, Admitted.OUT),
    ({"serves": True, "ejected": True, "on_trial": False, "held": True}, Admitted.EJECTED),
    ({"serves": True, "ejected": False, "on_trial": True, "held": True}, Admitted.HELD),
    ({"serves": True, "ejected": False, "on_trial": True, "held": False}, Admitted.ON_TRIAL),
    ({"serves": True, "ejected": False, "on_trial": False, "held": False}, Admitted.ROUTED),
])
def test_a_shards_admission_from_the_ledgers_facts(facts: dict[str, bool],
                                                   expected: Admitted) -> None:
    assert admitted(**facts, panicking=False) is expected


def test_an_ejected_shard_is_admitted_below_the_panic_threshold() -> None:
    assert admitted(serves=True, ejected=True, on_trial=False, held=False,
                    panicking=True) is Admitted.ROUTED


# ------------------------------------------------------------------ in the ledger


@pytest.mark.parametrize(("after", "held"), _either_side(FOR_S))
def test_the_ledger_ends_a_hold_at_its_until_time_on_its_clock(after: float,
                                                               held: bool) -> None:
    ledger, clock, seen, urls = make()
    assert ledger.admission.hold(urls[1], LOST, FOR_S)
    assert ledger.admission.routed() == [urls[0], urls[2]]
    clock.now += after
    expired = ledger.admission.expire()  # the tick's
    assert (expired == []) is held
    assert (urls[1] in ledger.admission.routed()) is not held
    assert ledger.admission.holds(urls[1], LOST) is held
    assert [t.event for t in seen] == [Event.HELD] + ([] if held else [Event.HOLD_EXPIRED])


def test_a_hold_past_its_until_time_holds_nothing_before_the_tick_ends_it() -> None:
    """A push between two ticks (any transition's) carries it again: the time decides, the
    tick's :meth:`Admission.expire` only says so."""
    ledger, clock, _, urls = make()
    ledger.admission.hold(urls[1], STALLED, FOR_S)
    clock.now += FOR_S
    assert urls[1] in ledger.admission.routed()
    assert ledger.admission.of(1) is Admitted.ROUTED


def test_every_change_of_a_hold_is_a_self_loop_of_the_table_and_changes_no_record() -> None:
    ledger, clock, seen, urls = make()
    before = ledger.shard(1)
    ledger.admission.hold(urls[1], STALLED, FOR_S)
    ledger.admission.hold(urls[1], LOST, FOR_S)  # a second cause: a change too
    ledger.admission.hold(urls[1], LOST, FOR_S)  # held so already: none
    ledger.admission.release(urls[1], STALLED)
    clock.now += FOR_S + TICK_S
    ledger.admission.expire()
    assert [t.event for t in seen] == [Event.HELD, Event.HELD, Event.RELEASED,
                                       Event.HOLD_EXPIRED]
    for t in seen:
        assert t.shard == 1 and t.from_state is t.to_state is ShardState.HEALTHY
        assert TRANSITIONS[t.from_state][t.event] is t.to_state
        assert t.record == before
    assert "still held" in seen[2].cause and "hold expired after 3 s" in seen[3].cause


def test_a_hold_that_ran_out_is_not_taken_again_until_the_reads_end() -> None:
    ledger, clock, seen, urls = make()
    ledger.admission.hold(urls[1], LOST, FOR_S)
    clock.now += FOR_S + TICK_S
    # Asked again before the tick ended it: it ends now, and is spent.
    assert ledger.admission.hold(urls[1], STALLED, FOR_S).transition is None
    assert [t.event for t in seen] == [Event.HELD, Event.HOLD_EXPIRED]
    assert urls[1] in ledger.admission.routed()
    ledger.admission.reads_ended(urls[1])
    assert ledger.admission.hold(urls[1], STALLED, FOR_S).transition is not None
    assert ledger.admission.routed() == [urls[0], urls[2]]


def test_the_reads_end_a_stalled_hold_and_leave_a_lost_cores_to_its_watch() -> None:
    ledger, _, _, urls = make()
    ledger.admission.hold(urls[1], STALLED, FOR_S)
    ledger.admission.hold(urls[2], LOST, FOR_S)
    ledger.admission.reads_ended(urls[1])
    ledger.admission.reads_ended(urls[2])
    assert ledger.admission.held() == {urls[2]}
    assert ledger.admission.release(urls[2], LOST).transition is not None
    assert ledger.admission.held() == set()


def test_a_hold_never_leaves_the_routers_none() -> None:
    ledger, _, _, urls = make(2)
    ledger.admission.hold(urls[0], LOST, FOR_S)
    assert ledger.admission.routed() == [urls[1]]
    ledger.admission.hold(urls[1], STALLED, FOR_S)
    assert ledger.admission.routed() == urls  # none left: both still serve
    assert ledger.admission.of(0) is ledger.admission.of(1) is Admitted.HELD
    assert ledger.serving_urls() == urls  # holds are no verdict: the ledger's set is whole


def test_the_never_empty_rule_comes_after_the_panic_threshold() -> None:
    # Panic off: an ejected engine never serves, and a held one is all that is left.
    ledger, _, _, urls = make(2, panic_threshold_percent=0)
    ledger.report_failure(1, "500")
    ledger.admission.hold(urls[0], LOST, FOR_S)
    assert ledger.admission.of(1) is Admitted.EJECTED
    assert ledger.admission.routed() == [urls[0]]
    # Below the threshold (1 of 3 routable): the ejected ones serve, the held one is out.
    ledger, _, _, urls = make(3)
    ledger.report_failure(1, "500")
    ledger.report_failure(2, "500")
    ledger.admission.hold(urls[0], STALLED, FOR_S)
    assert ledger.panicking() and ledger.admission.routed() == [urls[1], urls[2]]


def test_a_shard_on_trial_is_admitted_one_request_at_a_time() -> None:
    ledger, clock, _, urls = make(2)
    ledger.report_failure(0, "500")
    clock.now += 1.0  # its ejection's time is up
    ledger.record_probe(0, ok=True, generated=True)
    assert ledger.admission.of(0) is Admitted.ON_TRIAL and ledger.trial_urls() == [urls[0]]


def test_a_shard_with_no_process_is_not_held_and_its_hold_ends_silently() -> None:
    ledger, clock, seen, urls = make(2)
    ledger.condemn(0, "exited")
    assert not ledger.admission.hold(urls[0], LOST, FOR_S)
    assert ledger.admission.of(0) is Admitted.OUT
    ledger.admission.hold(urls[1], LOST, FOR_S)
    ledger.condemn(1, "exited")
    seen.clear()
    clock.now += FOR_S
    ledger.admission.expire()
    assert seen == [] and ledger.admission.held() == set()
    assert not ledger.admission.hold("http://127.0.0.1:1", LOST, FOR_S)  # no shard has it
