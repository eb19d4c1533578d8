"""Every threshold of the judge and the ledger, one tick either side.

As Envoy's outlier-detection tests do with a simulated clock: the time is an input (the judge
is told what passed; the ledger reads a :class:`~support.clock.Clock` the test moves), so a
rule written ``<`` where it means ``<=``, or a threshold read from the wrong field, fails
here at once. A tick is :data:`~support.clock.TICK_S`. Each rule's reason is where it lives
(judge.py's ``WatchdogPolicy``, ledger.py's ``Policy``); the supervisor's backoff and startup
timeout are tested the same way in test_supervisor.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleetwarden.engine_metrics import Sample
from fleetwarden.judge import (
    DEFAULT_POLICY,
    NO_CADENCE,
    Cadence,
    Stall,
    Verdict,
    held_its_canary,
    held_its_requests,
    held_then_canary,
    judge,
)
from fleetwarden.ledger import Event, Ledger, Policy, ShardState
from support.clock import TICK_S, Clock

BUSY = Sample(running=4, waiting=0, steps=1000, generation_tokens=4000, prompt_tokens=40,
              finished_requests=10, start_time=1.7e9)
IDLE = replace(BUSY, running=0)
P = DEFAULT_POLICY
LOAD = BUSY.running + BUSY.waiting


def _one_tick_either_side(threshold: float) -> list[tuple[float, bool]]:
    """(time, reached) just before, at, and just after ``threshold``: every rule here counts
    the threshold itself as reached (``>=``)."""
    return [(threshold - TICK_S, False), (threshold, True), (threshold + TICK_S, True)]


# ------------------------------------------------------------------------- the judge


def _second_flat_read(seconds: float, cadence: Cadence = NO_CADENCE) -> Verdict:
    """The verdict on a busy engine's second flat read, ``seconds`` after a first that found
    it busy and flat (the stall is timed from that read)."""
    return judge(BUSY, BUSY, elapsed_s=seconds, stall=Stall(1, 0.0), cadence=cadence).verdict


@pytest.mark.parametrize(("seconds", "stuck"), _one_tick_either_side(P.stall_s))
def test_a_stall_is_stuck_at_the_floor_stall_s(seconds: float, stuck: bool) -> None:
    assert _second_flat_read(seconds) is (Verdict.STUCK if stuck else Verdict.STALLED)


@pytest.mark.parametrize(("gap", "limit"), [
    (2.5, P.stall_factor * 2.5),  # its own cadence: three times its longest pause
    (10.0, P.stall_max_s),  # three times 10 s is past the ceiling
])
def test_a_learned_limit_and_its_ceiling_are_met_at_the_tick(gap: float, limit: float) -> None:
    cadence = NO_CADENCE.saw(LOAD, gap)
    assert cadence.limit(LOAD, P) == limit
    verdicts = [_second_flat_read(t, cadence) for t, _ in _one_tick_either_side(limit)]
    assert verdicts == [Verdict.STALLED, Verdict.STUCK, Verdict.STUCK]


def test_one_read_over_the_limit_is_not_stuck_and_the_second_is() -> None:
    long = 10 * P.stall_s
    assert P.stall_waits == 2
    first = judge(BUSY, BUSY, elapsed_s=long)  # the first flat read: one wait
    assert first.verdict is Verdict.STALLED and first.stall.waits == 1
    assert judge(BUSY, BUSY, elapsed_s=long, stall=first.stall).verdict is Verdict.STUCK


@pytest.mark.parametrize(("since", "due"), _one_tick_either_side(P.canary_interval_s))
def test_an_idle_engines_canary_is_due_at_the_canary_interval(since: float, due: bool) -> None:
    assert judge(IDLE, IDLE, elapsed_s=1.0, since_canary_s=since).send_canary is due


@pytest.mark.parametrize(("since", "own"), [(2.0 - TICK_S, True), (2.0, True),
                                            (2.0 + TICK_S, False)])
def test_progress_is_our_own_canarys_only_if_it_was_sent_within_the_read(
        since: float, own: bool) -> None:
    """An idle engine that moved since the last read, 2 s ago: a canary sent since explains it
    (IDLE); one sent before that read does not (the engine worked: BUSY)."""
    moved = replace(IDLE, generation_tokens=IDLE.generation_tokens + 1)
    j = judge(IDLE, moved, elapsed_s=2.0, since_canary_s=since)
    assert j.verdict is (Verdict.IDLE if own else Verdict.BUSY)


@pytest.mark.parametrize(("latency", "conclusive"), _one_tick_either_side(P.stall_s))
def test_a_canary_held_is_conclusive_at_the_floor(latency: float, conclusive: bool) -> None:
    assert (held_its_canary(IDLE, IDLE, latency) is not None) is conclusive


@pytest.mark.parametrize(("span", "conclusive"), _one_tick_either_side(7.5))
def test_a_request_held_is_conclusive_when_both_spans_reach_the_limit(
        span: float, conclusive: bool) -> None:
    # the shorter of the two decides: a request held long on counters that moved lately, or
    # counters flat long with a request sent lately
    for flat_for, held in ((span, 60.0), (60.0, span)):
        found = held_its_requests(flat_for_s=flat_for, held_s=held, limit_s=7.5, worked=True)
        assert (found is not None) is conclusive, (flat_for, held)


@pytest.mark.parametrize(("canary", "conclusive"), _one_tick_either_side(4.0))
def test_a_hold_then_a_canary_is_conclusive_when_the_two_reach_the_limit(
        canary: float, conclusive: bool) -> None:
    found = held_then_canary(IDLE, IDLE, held_flat_s=1.0, canary_latency_s=canary, limit_s=5.0)
    assert (found is not None) is conclusive


# ------------------------------------------------------------------------- the ledger


def _ledger(n: int = 2, **policy: object) -> tuple[Ledger, Clock]:
    clock = Clock()
    ledger = Ledger([f"http://127.0.0.1:{9000 + i}" for i in range(n)],
                    Policy(**policy), clock=clock)  # type: ignore[arg-type]
    return ledger, clock


def _eject(ledger: Ledger) -> float:
    """Shard 0's requests fail: ejected. Returns the time its ejection ends."""
    ledger.report_outcomes(0, successes=0, failures=1, trailing_failures=1)
    until = ledger.shard(0).ejected_until
    assert until is not None
    return until


def test_an_answered_canary_puts_an_ejected_engine_on_trial_at_its_time_not_a_tick_before(
) -> None:
    """The ejection doubles (1, 2, 4 s) up to ejection_max_s (4 s): each from both sides."""
    ledger, clock = _ledger(unhealthy_threshold=10, ejection_base_s=1.0, ejection_max_s=4.0)
    for out_s in (1.0, 2.0, 4.0, 4.0):
        start = clock.now
        until = _eject(ledger)
        assert until == start + out_s
        clock.now = until - TICK_S
        early = ledger.record_probe(0, ok=True, generated=True)
        assert early.transition is not None and early.transition.event is Event.PROBE_OK
        assert ledger.ejected() == [0] and not ledger.shard(0).on_trial
        clock.now = until
        on_time = ledger.record_probe(0, ok=True, generated=True)
        assert on_time.transition is not None and on_time.transition.event is Event.ON_TRIAL
        assert ledger.trial_urls() == ["http://127.0.0.1:9000"]


@pytest.mark.parametrize(("after", "on_trial"), [(1.0 - TICK_S, False), (1.0, True)])
def test_requests_it_held_that_complete_put_it_on_trial_at_its_time_not_a_tick_before(
        after: float, on_trial: bool) -> None:
    ledger, clock = _ledger()
    start = clock.now
    _eject(ledger)
    clock.now = start + after
    ledger.report_outcomes(0, successes=1, failures=0, trailing_failures=0)
    assert ledger.shard(0).on_trial is on_trial
    assert ledger.ejected() == ([] if on_trial else [0])


@pytest.mark.parametrize(("probes", "state"), [(2, ShardState.SUSPECT), (3, ShardState.DEAD)])
def test_failed_probes_condemn_at_the_unhealthy_threshold(probes: int,
                                                          state: ShardState) -> None:
    ledger, _ = _ledger()
    assert ledger.policy.unhealthy_threshold == 3
    for _ in range(probes):
        ledger.record_probe(0, ok=False, error="unreachable")
    assert ledger.state(0) is state


@pytest.mark.parametrize(("failed", "state"), [(2, ShardState.SUSPECT), (3, ShardState.DEAD)])
def test_failed_requests_condemn_at_the_unhealthy_threshold(failed: int,
                                                            state: ShardState) -> None:
    ledger, _ = _ledger()
    for _ in range(failed):
        ledger.report_failure(0, "500")
    assert ledger.state(0) is state


@pytest.mark.parametrize(("probes", "state"), [(1, ShardState.SUSPECT),
                                                (2, ShardState.HEALTHY)])
def test_good_probes_lift_suspicion_at_the_healthy_threshold(probes: int,
                                                             state: ShardState) -> None:
    ledger, _ = _ledger()
    assert ledger.policy.healthy_threshold == 2
    ledger.record_probe(0, ok=False, error="unreachable")
    for _ in range(probes):
        ledger.record_probe(0, ok=True)
    assert ledger.state(0) is state


@pytest.mark.parametrize(("ejected", "panicking"), [(7, False), (8, True)])
def test_the_panic_threshold_is_met_below_its_share_not_at_it(ejected: int,
                                                              panicking: bool) -> None:
    """30 % of 10 shards: 3 routable is at the threshold (the ejected stay out), 2 below it
    (every shard not condemned serves)."""
    ledger, _ = _ledger(10, panic_threshold_percent=30)
    for i in range(ejected):
        ledger.report_failure(i, "500")
    assert ledger.ejected() == list(range(ejected))
    assert ledger.panicking() is panicking
    assert len(ledger.serving_urls()) == (10 if panicking else 10 - ejected)
