"""The ledger, read as a specification (docs/design.md sections 2-3, notes 000 and 001)."""

from __future__ import annotations

import pytest

from fleetwarden.ledger import (
    TRANSITIONS,
    Event,
    FleetExhausted,
    Ledger,
    LedgerError,
    Policy,
    Reading,
    ShardRecord,
    ShardState,
    Transition,
)
from fleetwarden.story import play_note_001

H, S, ST, D, R, X = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE,
                     ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(n: int = 4, **policy: object) -> tuple[Ledger, list[Transition]]:
    ledger = Ledger([f"http://127.0.0.1:{9000 + i}" for i in range(n)],
                    Policy(**policy),  # type: ignore[arg-type]
                    clock=Clock())
    seen: list[Transition] = []
    ledger.subscribe(seen.append)
    return ledger, seen


def kill(ledger: Ledger, i: int) -> None:
    assert ledger.condemn(i, "process exited")


def restart(ledger: Ledger, i: int, url: str, inc: str = "new") -> None:
    assert ledger.mark_restarting(i)
    assert ledger.mark_loaded(i, url, inc)


# ---------------------------------------------------------------- note 001


def test_a_restarted_engine_has_no_history() -> None:
    ledger, _ = make(4)
    ledger.report_failure(1, "timeout")
    ledger.report_failure(1, "timeout")
    r = ledger.shard(1)
    assert (r.state, r.consecutive_reported_failures) == (S, 2)

    for i in ledger.refit_participants():  # a refit aborts
        ledger.mark_weights_partial(i)
    r = ledger.shard(1)
    assert (r.state, r.state_before_partial, r.consecutive_reported_failures) == (ST, S, 2)
    assert ledger.suspected_shards() == [1]

    assert ledger.condemn_silent_participant(1, "refit 1 aborted")
    assert ledger.state(1) is D

    assert ledger.mark_restarting(1)
    assert ledger.mark_loaded(1, "http://127.0.0.1:9101", "launch-2")
    r = ledger.shard(1)
    assert r.state is ST
    assert r.consecutive_reported_failures == 0
    assert r.state_before_partial is None
    assert (r.consecutive_probe_failures, r.consecutive_probe_successes) == (0, 0)
    assert r.restart_attempts == 1
    assert r.base_url == "http://127.0.0.1:9101"

    for i in ledger.refit_participants():  # the next refit lands
        ledger.report_refit(i, 1)
    r = ledger.shard(1)
    assert (r.state, r.consecutive_reported_failures, r.weight_version) == (H, 0, 1)

    ledger.report_failure(1, "timeout")
    assert ledger.state(1) is S  # one failure is SUSPECT, not DEAD
    assert ledger.shard(1).consecutive_reported_failures == 1


def test_the_story_the_demo_plays_matches_note_001() -> None:
    steps = play_note_001()
    assert [(s.record.state, s.record.consecutive_reported_failures,
             s.record.state_before_partial) for s in steps] == [
        (S, 2, None), (ST, 2, S), (D, 2, S), (ST, 0, None), (H, 0, None), (S, 1, None)]


# ---------------------------------------------------------------- note 000


def test_a_shard_that_passes_every_probe_but_fails_every_generation_still_dies() -> None:
    clock = Clock()
    ledger = Ledger(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], clock=clock)
    for window in range(3):
        clock.now += 120  # past any ejection: each answered canary puts it on trial
        assert ledger.record_probe(0, ok=True, generated=True)
        ledger.report_outcomes(0, successes=0, failures=1, trailing_failures=1)  # the trial's
        if window < 2:
            assert ledger.state(0) in (H, S)
    assert ledger.state(0) is D
    assert ledger.serving_urls() == ["http://127.0.0.1:9001"]


def test_an_ok_probe_never_clears_the_reported_streak() -> None:
    ledger, _ = make(1)
    ledger.report_failure(0, "reset")
    ledger.report_failure(0, "reset")
    for _ in range(10):
        ledger.record_probe(0, ok=True)
    assert ledger.shard(0).consecutive_reported_failures == 2
    ledger.report_failure(0, "reset")
    assert ledger.state(0) is D


def test_a_success_clears_the_reported_streak() -> None:
    ledger, _ = make(1)
    ledger.report_failure(0, "reset")
    ledger.report_failure(0, "reset")
    assert ledger.report_success(0)
    assert ledger.shard(0).consecutive_reported_failures == 0
    ledger.report_failure(0, "reset")
    ledger.report_failure(0, "reset")
    assert ledger.state(0) is S  # two, not four: the success wiped the first two


def test_successes_in_a_window_clear_the_streak_before_its_failures_count() -> None:
    ledger, _ = make(1)
    ledger.report_failure(0, "reset")
    ledger.report_failure(0, "reset")
    ledger.report_outcomes(0, successes=5, failures=3, trailing_failures=1)
    assert ledger.shard(0).consecutive_reported_failures == 1
    ledger.report_outcomes(0, successes=5, failures=3, trailing_failures=0)
    assert ledger.shard(0).consecutive_reported_failures == 0


def test_a_burst_of_failures_in_one_window_is_one_observation() -> None:
    ledger, seen = make(2)
    ledger.report_outcomes(0, successes=0, failures=40, trailing_failures=40)
    assert ledger.state(0) is S
    assert ledger.shard(0).consecutive_reported_failures == 1
    assert len(seen) == 1


def test_a_quiet_window_changes_nothing() -> None:
    ledger, seen = make(1)
    ledger.report_failure(0, "reset")
    ledger.report_outcomes(0, 0, 0, 0)
    assert ledger.shard(0).consecutive_reported_failures == 1
    assert len(seen) == 1


# ---------------------------------------------------------------- probes


def test_three_failed_probes_condemn_and_two_good_ones_lift_suspect() -> None:
    ledger, _ = make(2)
    ledger.record_probe(0, ok=False, error="refused")
    assert ledger.state(0) is S
    ledger.record_probe(0, ok=True)
    assert ledger.state(0) is S
    ledger.record_probe(0, ok=True)
    assert ledger.state(0) is H
    for _ in range(3):
        ledger.record_probe(1, ok=False, error="refused")
    assert ledger.state(1) is D
    assert "refused" in ledger.shard(1).last_error


def test_probes_never_change_a_shard_without_a_process() -> None:
    ledger, seen = make(1)
    kill(ledger, 0)
    before = ledger.shard(0)
    n = len(seen)
    out = ledger.record_probe(0, ok=False, error="x")
    assert not out and "process" in out.reason
    assert ledger.shard(0) == before
    assert len(seen) == n


def test_failed_reads_condemn_a_stale_shard_and_good_ones_never_lift_it() -> None:
    """A STALE engine that died must not wait for a refit that never comes (the
    controller once kept this streak itself, and reset it without a reason)."""
    ledger, _ = make(1, weights="trainer")
    ledger.mark_weights_partial(0)
    ledger.record_probe(0, ok=True)
    ledger.record_probe(0, ok=True)
    assert ledger.state(0) is ST
    for _ in range(2):
        ledger.record_probe(0, ok=False, error="refused")
        assert ledger.state(0) is ST
    out = ledger.record_probe(0, ok=False, error="refused")
    assert ledger.state(0) is D and out.transition is not None
    assert out.transition.event is Event.FAILURES_AT_THRESHOLD


def test_steady_good_probes_emit_nothing() -> None:
    ledger, seen = make(1)
    for _ in range(50):
        ledger.record_probe(0, ok=True)
    assert len(seen) == 2  # the streak grows to the threshold, then saturates
    assert ledger.shard(0).last_ok_at is not None


# ---------------------------------------------------------------- restarts and budget


def test_the_sixth_restart_retires_and_retired_never_changes_again() -> None:
    ledger, seen = make(2)
    for n in range(5):
        kill(ledger, 0)
        restart(ledger, 0, f"http://127.0.0.1:{9500 + n}", f"launch-{n}")
        assert ledger.shard(0).restart_attempts == n + 1
        ledger.report_refit(0, 0)
    kill(ledger, 0)
    out = ledger.mark_restarting(0)
    assert out and ledger.state(0) is X
    assert "budget exhausted" in out.transition.cause  # type: ignore[union-attr]

    frozen = ledger.shard(0)
    n = len(seen)
    for call in (
        lambda: ledger.record_probe(0, True), lambda: ledger.record_probe(0, False),
        lambda: ledger.report_failure(0, "x"), lambda: ledger.report_success(0),
        lambda: ledger.report_outcomes(0, 1, 1, 1), lambda: ledger.condemn(0, "x"),
        lambda: ledger.mark_weights_partial(0), lambda: ledger.condemn_silent_participant(0, "x"),
        lambda: ledger.mark_restarting(0), lambda: ledger.mark_restart_failed(0, "x"),
        lambda: ledger.mark_loaded(0, "http://x", "y"), lambda: ledger.report_refit(0, 9),
        lambda: ledger.observe_incarnation(0, "z"), lambda: ledger.retire(0, "again"),
    ):
        assert not call()
    assert ledger.shard(0) == frozen
    assert len(seen) == n


def test_a_failed_restart_is_dead_again_and_keeps_its_spent_attempt() -> None:
    ledger, _ = make(1)
    kill(ledger, 0)
    ledger.mark_restarting(0)
    assert ledger.mark_restart_failed(0, "no /health within 60 s")
    r = ledger.shard(0)
    assert (r.state, r.restart_attempts) == (D, 1)
    assert "no /health" in r.last_error


def test_there_is_no_way_from_dead_to_serving_but_through_a_restart_and_a_refit() -> None:
    ledger, _ = make(1)
    kill(ledger, 0)
    for _ in range(5):
        ledger.record_probe(0, ok=True)
    ledger.report_success(0)
    ledger.report_refit(0, 3)
    ledger.observe_incarnation(0, "other")
    assert ledger.state(0) is D
    restart(ledger, 0, "http://127.0.0.1:9999")
    assert ledger.state(0) is ST
    assert ledger.serving_urls() == []
    ledger.report_refit(0, 1)
    assert ledger.serving_urls() == ["http://127.0.0.1:9999"]


def test_mark_loaded_refuses_a_url_that_another_shard_holds() -> None:
    """Refused as a failed guard, not raised: a launcher can be handed a port that a DEAD or
    RETIRED shard still records, and that must fail one attempt, never the caller's tick."""
    ledger, _ = make(2)
    kill(ledger, 0)
    ledger.mark_restarting(0)
    outcome = ledger.mark_loaded(0, "http://127.0.0.1:9001", "x")
    assert not outcome and "shard 1" in outcome.reason
    assert ledger.state(0) is R and ledger.shard_for_url("http://127.0.0.1:9001") == 1


def test_a_new_url_is_found_by_shard_for_url() -> None:
    ledger, _ = make(2)
    kill(ledger, 0)
    restart(ledger, 0, "http://127.0.0.1:7000")
    assert ledger.shard_for_url("http://127.0.0.1:7000") == 0
    assert ledger.shard_for_url("http://127.0.0.1:9000") is None


# ---------------------------------------------------------------- refits


def test_a_suspicion_survives_an_aborted_refit() -> None:
    ledger, _ = make(2)
    ledger.report_failure(0, "timeout")
    ledger.report_failure(0, "timeout")
    ledger.mark_weights_partial(0)
    assert ledger.state(0) is ST
    ledger.report_refit(0, 2)
    r = ledger.shard(0)
    assert (r.state, r.consecutive_reported_failures, r.weight_version) == (S, 2, 2)
    assert r.state_before_partial is None
    ledger.report_failure(0, "timeout")
    assert ledger.state(0) is D


def test_an_aborted_refit_on_a_stale_shard_keeps_what_it_was_before() -> None:
    ledger, _ = make(1)
    ledger.report_failure(0, "timeout")
    ledger.mark_weights_partial(0)
    ledger.mark_weights_partial(0)  # a second abort: STALE itself would say nothing
    assert ledger.shard(0).state_before_partial is S


def test_refit_participants_are_serving_and_stale_shards() -> None:
    ledger, _ = make(5)
    ledger.report_failure(1, "x")  # SUSPECT
    ledger.mark_weights_partial(2)  # STALE
    kill(ledger, 3)
    ledger.retire(4, "operator")
    assert ledger.refit_participants() == [0, 1, 2]
    assert ledger.serving() == [0, 1]
    assert ledger.absent() == [3, 4]


def test_a_silent_restart_goes_stale_in_trainer_mode_and_not_in_static_mode() -> None:
    trainer, _ = make(1, weights="trainer")
    static, _ = make(1, weights="static")
    for ledger in (trainer, static):
        ledger.report_failure(0, "x")
        first = ledger.observe_incarnation(0, "start=1")  # first sighting: an identity
        assert first.transition is not None and first.transition.event is Event.IDENTIFIED
        assert ledger.shard(0).consecutive_reported_failures == 1  # not a restart
        assert ledger.state(0) is S
        assert ledger.observe_incarnation(0, "start=2").transition is not None
        assert ledger.shard(0).consecutive_reported_failures == 0
    assert trainer.state(0) is ST
    assert static.state(0) is H
    assert not trainer.observe_incarnation(0, "start=2").transition  # same process: nothing


def test_once_weights_are_loaded_a_static_fleet_keeps_new_processes_stale_until_loaded() -> None:
    """Static: a good canary is a new process's refit, since its launch weights are the only
    ones. Once fleetwarden loads a checkpoint (``weights_loaded``) they are not: a canary
    would label the launch weights with the checkpoint's version. A replacement then waits in
    STALE for its load, and a silent restart goes STALE, as in trainer mode."""
    ledger, _ = make(2, weights="static")
    kill(ledger, 1)
    ledger.mark_restarting(1)
    ledger.mark_loaded(1, "http://127.0.0.1:9101", "launch-2")
    ledger.record_reading(1, Reading("proven", "IDLE", canary_ok=True))
    assert ledger.state(1) is H  # before any load: promoted by its canary
    assert ledger.weights_loaded() and not ledger.weights_loaded()  # changed once
    assert ledger.policy.weights == "trainer"
    ledger.report_refit(0, 4)
    ledger.report_refit(1, 4)
    kill(ledger, 1)
    ledger.mark_restarting(1)
    ledger.mark_loaded(1, "http://127.0.0.1:9102", "launch-3")
    ledger.record_reading(1, Reading("proven", "IDLE", canary_ok=True))
    assert ledger.state(1) is ST and ledger.serving() == [0]  # its canary is no refit
    ledger.report_refit(1, 4)  # its load, confirmed
    assert ledger.state(1) is H
    ledger.observe_incarnation(0, "start=1")
    ledger.observe_incarnation(0, "start=2")  # restarted on its own: the weights are lost
    assert ledger.state(0) is ST


# ---------------------------------------------------------------- events, queries, shape


def test_every_change_emits_a_transition_with_the_counters_after() -> None:
    ledger, seen = make(2)
    ledger.report_failure(0, "reset by peer")
    (t,) = seen
    assert (t.shard, t.from_state, t.to_state) == (0, H, S)
    assert t.cause.startswith("reset by peer; out of routing")
    assert t.record.consecutive_reported_failures == 1
    assert t.event is Event.EJECTED
    assert t.at == 1000.0


def test_an_ignored_operation_says_why() -> None:
    ledger, _ = make(1)
    out = ledger.mark_restarting(0)
    assert not out and out.transition is None
    assert "HEALTHY" in out.reason and "DEAD" in out.reason


def test_the_table_has_no_forbidden_move() -> None:
    for src, moves in TRANSITIONS.items():
        for dst in moves.values():
            assert (src, dst) != (D, H)
            assert src not in (D, R) or dst is not S
            if src is ST:  # a STALE shard may sleep; it wakes STALE (the property test)
                assert dst in (ST, H, S, D, X, ShardState.SLEEPING)
    assert TRANSITIONS[X] == {}


def test_an_operation_outside_the_table_is_a_ledger_bug() -> None:
    ledger, _ = make(1)
    with pytest.raises(LedgerError):
        ledger._apply(ledger._shards[0], Event.LOADED, "not a move from HEALTHY")


def test_raise_if_exhausted_when_too_few_shards_can_serve_again() -> None:
    ledger, _ = make(2, min_serving_shards=2)
    kill(ledger, 0)
    ledger.raise_if_exhausted()  # DEAD can come back
    ledger.retire(0, "operator")
    with pytest.raises(FleetExhausted, match="1 of 2"):
        ledger.raise_if_exhausted()


def test_counts_and_snapshot() -> None:
    ledger, _ = make(3)
    kill(ledger, 2)
    counts = ledger.counts_by_state()
    assert counts[H] == 2 and counts[D] == 1 and sum(counts.values()) == 3
    snap = ledger.snapshot()
    assert [r.index for r in snap] == [0, 1, 2]
    assert ShardRecord.from_dict(snap[2].to_dict()) == snap[2]


def test_unknown_shard_index_names_the_range() -> None:
    ledger, _ = make(2)
    with pytest.raises(IndexError, match=r"0\.\.1"):
        ledger.condemn(5, "x")


def test_invalid_policy_names_the_field() -> None:
    with pytest.raises(ValueError, match="unhealthy_threshold"):
        Policy(unhealthy_threshold=0)
    with pytest.raises(ValueError, match="weights"):
        Policy(weights="dynamic")  # type: ignore[arg-type]


def test_negative_outcome_counts_are_refused() -> None:
    ledger, _ = make(1)
    with pytest.raises(ValueError):
        ledger.report_outcomes(0, -1, 0, 0)


def test_the_ledger_does_no_io() -> None:
    import ast
    import inspect

    import fleetwarden.ledger as mod

    tree = ast.parse(inspect.getsource(mod))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in (node.names if isinstance(node, ast.Import) else
                              [type("A", (), {"name": node.module or ""})()])}
    assert imported.isdisjoint({"asyncio", "aiohttp", "socket", "os", "pathlib", "sqlite3",
                                "io", "threading", "subprocess"})


def test_every_subscriber_sees_a_transition_even_when_one_raises() -> None:
    """The change is made and every subscriber told before any subscriber's error surfaces:
    the ledger is never left half-applied."""
    ledger, _ = make(2)
    seen: list[int] = []

    def broken(t: object) -> None:
        raise RuntimeError("disk full")

    ledger.subscribe(broken)
    ledger.subscribe(lambda t: seen.append(t.shard))
    with pytest.raises(RuntimeError, match="disk full"):
        ledger.condemn(0, "exited")
    assert ledger.state(0) is D and seen == [0]


def test_the_ledgers_working_copy_has_exactly_a_records_fields() -> None:
    """``_Shard`` mirrors ``ShardRecord`` one for one (names and defaults), so a field added to
    the record is kept by the ledger, not silently dropped by a field-by-field copy."""
    from dataclasses import MISSING, fields

    from fleetwarden.ledger import ShardRecord, _Shard

    def shape(cls: type) -> list[tuple[str, object]]:
        return [(f.name, f.default if f.default is not MISSING else f.default_factory)
                for f in fields(cls) if not f.name.startswith("_")]

    assert shape(_Shard) == shape(ShardRecord)
    rec = ShardRecord(index=3, base_url="http://x", state=S, incarnation="7",
                      consecutive_probe_failures=1, consecutive_probe_successes=2,
                      consecutive_reported_failures=3, restart_attempts=4,
                      state_before_partial=D, weight_version=5, last_error="e", last_ok_at=6.0,
                      last_transition_at=7.0)
    assert _Shard(**{f.name: getattr(rec, f.name) for f in fields(rec)}).record() == rec


def test_successful_work_lifts_a_suspect_without_a_canary() -> None:
    """A shard made SUSPECT by /metrics reads that timed out under load
    and whose requests then complete is HEALTHY again from that window, not after the next
    canary (an hour away in the real-vLLM tier's config)."""
    ledger, _ = make(2)
    ledger.record_probe(1, False, "UNREACHABLE: /metrics timed out")
    ledger.record_probe(1, False, "UNREACHABLE: /metrics timed out")
    assert ledger.state(1) is S
    out = ledger.report_outcomes(1, 3, 0, 0)
    assert ledger.state(1) is H and out.transition is not None
    assert out.transition.event is Event.SERVED and "3 requests completed" in out.transition.cause
    r = ledger.shard(1)
    assert r.consecutive_probe_failures == 0 and r.consecutive_reported_failures == 0


def test_a_window_that_began_before_the_suspicion_lifts_nothing() -> None:
    """A black-holed engine's requests completed just before the fault sit in the router's
    window drained after its silence made it SUSPECT: completed work from before a suspicion
    is no proof against it. The window begun a tick after the suspicion is."""
    clock = Clock()
    ledger = Ledger(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], clock=clock)
    began = clock.now
    clock.now += 0.5
    ledger.record_probe(1, False, "SILENT: /metrics answered nothing in 1 s")
    ledger.record_probe(1, False, "SILENT: /metrics answered nothing in 1 s")
    assert ledger.state(1) is S
    suspected = clock.now
    clock.now += 0.5
    out = ledger.report_outcomes(1, 2, 0, 0, window_began_at=began)
    assert ledger.state(1) is S and out.transition is None
    assert ledger.report_outcomes(1, 2, 0, 0, window_began_at=suspected - 0.001).transition \
        is None  # a tick before the suspicion: still no proof
    ledger.report_outcomes(1, 2, 0, 0, window_began_at=suspected)
    assert ledger.state(1) is H  # begun with the suspicion: what completed came after it


def test_a_window_with_any_failure_lifts_no_suspicion() -> None:
    """Note 000's engine fails some generations and answers every probe: a window that saw a
    failure, even before its successes, is no proof that it serves."""
    clock = Clock()
    ledger = Ledger(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], clock=clock)
    ledger.report_failure(0, "500")
    assert ledger.state(0) is S
    clock.now += 1.0  # its ejection's time is up
    ledger.report_outcomes(0, 5, 1, 0)
    assert ledger.state(0) is S and ledger.ejected() == [0]
    ledger.report_outcomes(0, 5, 0, 0)  # on trial: what it held completed, nothing failed
    ledger.report_outcomes(0, 5, 0, 0)
    assert ledger.state(0) is H


# ---------------------------------------------------------------------- sleep mode

def test_a_sleeping_shard_serves_nothing_is_judged_on_nothing_and_wakes_as_it_slept() -> None:
    SL = ShardState.SLEEPING
    ledger, seen = make(3)
    ledger.report_failure(1, "timeout")
    assert ledger.state(1) is S
    for i in (0, 1):
        assert ledger.report_asleep(i, "vllm:engine_sleep_state awake 0")
    assert [ledger.state(i) for i in (0, 1)] == [SL, SL]
    assert ledger.serving() == [2] and ledger.sleeping() == [0, 1]
    assert ledger.refit_participants() == [0, 1, 2]  # a sleeping engine can take weights
    # nothing a canary, a read that says asleep or a request window says moves it
    assert not ledger.record_reading(0, Reading("failing", "IDLE", canary_ok=False)).transition
    assert not ledger.record_reading(0, Reading("unproven", "SLEEPING", sleep_level=1)).transition
    assert not ledger.report_failure(0, "held request")
    assert not ledger.report_outcomes(1, 0, 5, 5)
    assert ledger.shard(1).consecutive_reported_failures == 1  # kept through the sleep
    assert ledger.report_awake(0, "awake 1").transition.event is Event.WOKE  # type: ignore[union-attr]
    woke = ledger.report_awake(1, "awake 1").transition
    assert woke is not None and woke.event is Event.WOKE_SUSPECT and woke.to_state is S
    assert ledger.shard(1).consecutive_reported_failures == 1  # a sleep proves nothing
    assert ledger.shard(1).state_before_sleep is None
    assert [t.event for t in seen[-4:]] == [Event.ASLEEP, Event.ASLEEP, Event.WOKE,
                                            Event.WOKE_SUSPECT]


def test_a_refit_while_asleep_changes_what_it_wakes_to() -> None:
    SL = ShardState.SLEEPING
    ledger, _ = make(3, weights="trainer")
    ledger.observe_incarnation(0, "a")
    ledger.observe_incarnation(0, "b")  # restarted on its own: STALE in trainer mode
    ledger.report_failure(1, "timeout")  # SUSPECT
    for i in range(3):
        ledger.report_asleep(i, "asleep")
    assert ledger.suspected_shards() == [1]  # judged as what it wakes to
    for i in ledger.refit_participants():
        ledger.report_refit(i, 4)
    assert [ledger.state(i) for i in range(3)] == [SL, SL, SL]  # still asleep
    assert [ledger.shard(i).state_before_sleep for i in range(3)] == [H, S, H]
    for i in range(3):
        ledger.report_awake(i, "awake")
    assert [ledger.state(i) for i in range(3)] == [H, S, H]
    assert [ledger.shard(i).weight_version for i in range(3)] == [4, 4, 4]


def test_a_stale_shard_wakes_stale_and_an_aborted_refit_while_asleep_leaves_it_stale() -> None:
    ledger, _ = make(2, weights="trainer")
    ledger.observe_incarnation(0, "a")
    ledger.observe_incarnation(0, "b")
    assert ledger.state(0) is ST
    ledger.report_asleep(0, "asleep")
    ledger.report_awake(0, "awake")
    assert ledger.state(0) is ST  # its weights are still not current
    ledger.report_failure(1, "timeout")
    ledger.report_asleep(1, "asleep")
    ledger.mark_weights_partial(1)  # an aborted refit
    assert ledger.shard(1).state_before_sleep is ST
    assert ledger.suspected_shards() == [1]  # SUSPECT before the abort: the single suspect
    ledger.report_awake(1, "awake")
    assert ledger.state(1) is ST and ledger.shard(1).state_before_partial is S


def test_the_trainer_holds_its_sleepers_until_its_own_wake() -> None:
    ledger, _ = make(1)
    ledger.report_asleep(0, "put to sleep by the trainer", held=True)
    out = ledger.report_awake(0, "read awake")
    assert not out and "trainer" in out.reason
    assert ledger.report_awake(0, "woken by the trainer", by_trainer=True)
    assert ledger.state(0) is H and not ledger.shard(0).sleep_held
    ledger.report_asleep(0, "seen asleep")
    assert ledger.report_asleep(0, "the trainer too", held=True)  # now held
    assert not ledger.report_awake(0, "read awake")


def test_a_sleeping_shard_can_still_die_restart_or_be_retired() -> None:
    ledger, _ = make(3)
    for i in range(3):
        ledger.observe_incarnation(i, "a")
        ledger.report_asleep(i, "asleep")
    ledger.condemn(0, "process exited")
    ledger.observe_incarnation(1, "b")  # a new process starts awake, nothing proved
    ledger.retire(2, "operator")
    assert [ledger.state(i) for i in range(3)] == [D, ST, X]
    assert all(ledger.shard(i).state_before_sleep is None for i in range(3))
    assert not ledger.report_asleep(0, "asleep")  # absent: no process to sleep
    round_trip = ShardRecord.from_dict(ledger.shard(1).to_dict())
    assert round_trip == ledger.shard(1)


def test_a_sleeper_that_stops_answering_is_condemned_and_one_that_answers_is_not() -> None:
    ledger, _ = make(1)
    ledger.report_asleep(0, "put to sleep by the trainer", held=True)
    unreachable = Reading("failing", "UNREACHABLE", "refused")
    ledger.record_reading(0, unreachable)
    ledger.record_reading(0, unreachable)
    ledger.record_reading(0, Reading("unproven", "SLEEPING", sleep_level=1))  # it answers
    assert ledger.shard(0).consecutive_probe_failures == 0
    for _ in range(3):
        ledger.record_reading(0, unreachable)
    assert ledger.state(0) is D and ledger.shard(0).state_before_sleep is None


# ------------------------------------------------------------------ out stays out


def ejected_ledger(**policy: object) -> tuple[Ledger, Clock]:
    clock = Clock()
    ledger = Ledger(["http://127.0.0.1:9000", "http://127.0.0.1:9001"],
                    Policy(**policy), clock=clock)  # type: ignore[arg-type]
    ledger.report_outcomes(0, successes=0, failures=2, trailing_failures=2)
    return ledger, clock


def test_a_failed_window_ejects_the_shard_and_every_push_leaves_it_out_while_suspect() -> None:
    ledger, clock = ejected_ledger()
    assert ledger.state(0) is S and ledger.ejected() == [0]
    assert ledger.serving_urls() == ["http://127.0.0.1:9001"]
    assert ledger.shard(0).ejected_until == clock.now + 1.0
    clock.now += 30
    assert ledger.serving_urls() == ["http://127.0.0.1:9001"]  # time alone brings nothing back


def test_failures_drained_after_the_ejection_are_the_same_burst() -> None:
    ledger, _ = ejected_ledger()
    for _ in range(5):  # requests that were on it when it was dropped, failing one by one
        ledger.report_outcomes(0, successes=0, failures=1, trailing_failures=1)
    assert ledger.state(0) is S and ledger.shard(0).consecutive_reported_failures == 1


def test_a_good_probe_before_the_ejection_ends_brings_nothing_back() -> None:
    ledger, clock = ejected_ledger()
    clock.now += 0.5
    ledger.record_probe(0, ok=True)
    assert ledger.ejected() == [0] and not ledger.shard(0).on_trial


def test_proof_puts_it_on_trial_and_a_completed_trial_request_returns_it_to_traffic() -> None:
    ledger, clock = ejected_ledger()
    clock.now += 1.0
    out = ledger.record_probe(0, ok=True, generated=True)  # a canary answered
    assert out.transition is not None and out.transition.event is Event.ON_TRIAL
    assert ledger.serving_urls() == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert ledger.trial_urls() == ["http://127.0.0.1:9000"]
    ledger.record_probe(0, ok=True)
    assert ledger.state(0) is S  # probes alone never end a trial: a request must complete
    ledger.report_outcomes(0, successes=1, failures=0, trailing_failures=0)
    assert ledger.trial_urls() == [] and not ledger.shard(0).on_trial
    assert ledger.shard(0).consecutive_reported_failures == 0
    ledger.record_probe(0, ok=True)
    ledger.record_probe(0, ok=True)
    assert ledger.state(0) is H and ledger.shard(0).ejections == 0


def test_progress_after_the_ejection_is_no_proof_that_its_generations_complete() -> None:
    # Note 000's trickle: every generation ends in a 500 while the core steps on. Its focused
    # reads show progress; that proves the core, not the generations, so it stays out.
    ledger, clock = ejected_ledger()
    clock.now += 5.0  # well past the ejection's 1 s
    for _ in range(3):
        ledger.record_reading(0, Reading(health="proven", verdict="BUSY"))
    assert ledger.ejected() == [0] and not ledger.shard(0).on_trial
    assert ledger.serving_urls() == ["http://127.0.0.1:9001"]
    ledger.record_reading(0, Reading(health="proven", verdict="IDLE", canary_ok=True))
    assert ledger.trial_urls() == ["http://127.0.0.1:9000"]  # an answered canary is proof


def test_requests_it_held_that_complete_put_an_ejected_engine_on_trial_once_its_time_is_up(
) -> None:
    # They were sent before the ejection, perhaps before the fault: the trickle's engine
    # completes what it admitted before the fault and fails everything after.
    ledger, clock = ejected_ledger()
    clock.now += 0.5
    ledger.report_outcomes(0, successes=2, failures=0, trailing_failures=0)
    assert ledger.ejected() == [0] and not ledger.shard(0).on_trial  # within its time
    assert ledger.shard(0).consecutive_reported_failures == 1  # the burst still stands
    clock.now += 0.5
    ledger.report_outcomes(0, successes=1, failures=0, trailing_failures=0)
    assert ledger.trial_urls() == ["http://127.0.0.1:9000"] and ledger.state(0) is S
    ledger.report_outcomes(0, successes=1, failures=0, trailing_failures=0)  # its trial
    assert ledger.trial_urls() == [] and ledger.state(0) is H


def test_an_engine_that_keeps_failing_its_trial_is_kept_out_longer_each_time() -> None:
    ledger, clock = ejected_ledger(unhealthy_threshold=10)
    outs = []
    for _ in range(4):
        rec = ledger.shard(0)
        assert rec.ejected_until is not None
        outs.append(rec.ejected_until - clock.now)
        clock.now = rec.ejected_until
        ledger.record_probe(0, ok=True, generated=True)  # proof: on trial
        ledger.report_outcomes(0, successes=0, failures=1, trailing_failures=1)  # trial fails
    assert outs == [1.0, 2.0, 4.0, 8.0]
    assert ledger.shard(0).ejections == 5 and ledger.state(0) is S


def test_a_burst_confirmed_by_a_failed_probe_is_enough_to_condemn() -> None:
    # Seed 000: three requests park on the wedge and fail together. One window, one reported
    # failure, and the focused look that follows fails: condemned, without two more windows.
    ledger, _ = ejected_ledger()
    assert ledger.shard(0).consecutive_reported_failures == 1
    out = ledger.record_probe(0, ok=False, error="canary: no answer within 5 s")
    assert out.transition is not None and out.transition.event is Event.CONFIRMED
    assert ledger.state(0) is D


def test_a_failed_probe_without_reported_failures_is_one_failed_probe() -> None:
    ledger, _ = make(2)
    ledger.record_probe(0, ok=False, error="unreachable")
    assert ledger.state(0) is S and ledger.serving_urls() == [
        "http://127.0.0.1:9000", "http://127.0.0.1:9001"]  # suspicion alone ejects nothing


def test_a_new_process_is_neither_ejected_nor_on_trial() -> None:
    ledger, _ = ejected_ledger()
    ledger.observe_incarnation(0, "1.0")
    ledger.observe_incarnation(0, "2.0")
    rec = ledger.shard(0)
    assert (rec.ejected_until, rec.on_trial, rec.ejections) == (None, False, 0)
    assert rec.consecutive_reported_failures == 0
    assert "http://127.0.0.1:9000" in ledger.serving_urls()


# ---------------------------------------------------------------- level-2 sleep


@pytest.mark.parametrize("weights", ["static", "trainer"])
def test_a_level_2_sleeper_wakes_stale_and_serves_again_only_after_a_refit(weights: str) -> None:
    """vLLM's level-2 sleep frees the weights. Awake again it has none: it must never serve
    under the version label it had, in either weights mode; not even an answered canary (an
    engine with no weights still generates) brings it back, only a refit."""
    ledger, _ = make(2, weights=weights)
    ledger.report_failure(1, "timeout")  # SUSPECT before its sleep: kept for the refit
    for i in (0, 1):
        ledger.report_asleep(i, "put to sleep by the trainer (level 2)", held=True)
        ledger.report_asleep(i, "level-2 sleep", held=True, weights_discarded=True)
        ledger.report_awake(i, "woken by the trainer", by_trainer=True)
    assert [ledger.state(i) for i in (0, 1)] == [ST, ST]
    assert ledger.serving_urls() == [] and ledger.serving() == []
    ledger.record_reading(0, Reading("proven", "IDLE", canary_ok=True))
    assert ledger.state(0) is ST  # a canary proves nothing of weights it does not have
    for i in (0, 1):
        ledger.report_refit(i, 3)
    assert [ledger.state(i) for i in (0, 1)] == [H, S]
    assert not ledger.shard(0).weights_discarded


def test_an_engine_that_reports_a_level_2_sleep_wakes_stale() -> None:
    ledger, _ = make(2)
    ledger.record_reading(0, Reading("unproven", "SLEEPING", sleep_level=2))
    assert ledger.shard(0).weights_discarded
    ledger.record_reading(0, Reading("proven", "IDLE", sleep_level=0))
    assert ledger.state(0) is ST
    # a level-1 sleeper keeps its weights and wakes as it slept
    ledger.record_reading(1, Reading("unproven", "SLEEPING", sleep_level=1))
    ledger.record_reading(1, Reading("proven", "IDLE", sleep_level=0))
    assert ledger.state(1) is H


# ---------------------------------------------------------------- the panic threshold


def test_below_the_panic_threshold_ejected_engines_serve_again() -> None:
    """Envoy's rule: fewer than half of the fleet routable, and the ejected (not condemned)
    ones are routed too, rather than a 409 for every client."""
    ledger, _ = make(4)
    ledger.condemn(3, "exited")  # condemned: never routed, counted in the fleet
    ledger.report_failure(0, "500")
    assert not ledger.panicking()  # 2 of 4 routable: at the threshold, not below
    assert ledger.serving_urls() == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    ledger.report_failure(1, "500")
    ledger.report_failure(2, "500")
    assert ledger.ejected() == [0, 1, 2] and ledger.panicking()
    assert ledger.serving_urls() == [f"http://127.0.0.1:{9000 + i}" for i in range(3)]


def test_retired_shards_are_not_part_of_the_fleet_and_0_turns_panic_off() -> None:
    ledger, _ = make(3)
    ledger.retire(2, "operator")
    ledger.report_failure(0, "500")
    assert ledger.serving_urls() == ["http://127.0.0.1:9001"]  # 1 of 2: at the threshold
    off, _ = make(2, panic_threshold_percent=0)
    off.report_failure(0, "500")
    off.report_failure(1, "500")
    assert off.serving_urls() == [] and not off.panicking()
    with pytest.raises(ValueError, match="panic_threshold_percent"):
        Policy(panic_threshold_percent=101)
