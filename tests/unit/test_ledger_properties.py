"""Every invariant of docs/design.md section 2, checked after each step of random operation runs."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    INVARIANT_MARKER,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from fleetwarden.ledger import (
    ABSENT,
    ROUTABLE,
    TRANSITIONS,
    HoldCause,
    Ledger,
    Policy,
    Reading,
    ShardRecord,
    ShardState,
    Transition,
    WeightsMode,
)

N = 4
H, S, ST, D, R, X = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE,
                     ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)
SL = ShardState.SLEEPING
shard = st.integers(0, N - 1)


class LedgerMachine(RuleBasedStateMachine):
    #: Trainer mode: a new run is STALE. :class:`StaticLedgerMachine` runs the same rules with
    #: static weights, where a new run of a SUSPECT shard is HEALTHY at once.
    weights: WeightsMode = "trainer"

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0
        self.ledger = Ledger([f"http://10.0.0.{i}:8000" for i in range(N)],
                             Policy(weights=self.weights), clock=lambda: self.t)
        self.seen: list[Transition] = []
        self.ledger.subscribe(self.seen.append)
        self.before = self.ledger.snapshot()
        self.port = 20000
        self.last_op: tuple[str, int] = ("init", -1)

    def _op(self, name: str, i: int) -> None:
        self.t += 1.0
        self.before = self.ledger.snapshot()
        self.seen_before = len(self.seen)
        self.last_op = (name, i)

    @rule(i=shard, ok=st.booleans())
    def record_probe(self, i: int, ok: bool) -> None:
        self._op("record_probe", i)
        self.ledger.record_probe(i, ok, "" if ok else "refused")

    @rule(i=shard)
    def report_failure(self, i: int) -> None:
        self._op("report_failure", i)
        self.ledger.report_failure(i, "timeout")

    @rule(i=shard)
    def report_success(self, i: int) -> None:
        self._op("report_success", i)
        self.ledger.report_success(i)

    @rule(i=shard, ok=st.integers(0, 3), bad=st.integers(0, 3), data=st.data())
    def report_outcomes(self, i: int, ok: int, bad: int, data: st.DataObject) -> None:
        trailing = data.draw(st.integers(0, bad))
        self._op("report_outcomes", i)
        self.ledger.report_outcomes(i, ok, bad, trailing)

    @rule(i=shard)
    def condemn(self, i: int) -> None:
        self._op("condemn", i)
        self.ledger.condemn(i, "exited")

    @rule(i=shard)
    def mark_weights_partial(self, i: int) -> None:
        self._op("mark_weights_partial", i)
        self.ledger.mark_weights_partial(i)

    @rule()
    def abort_refit(self) -> None:
        self._op("abort_refit", -1)
        for i in self.ledger.refit_participants():
            self.ledger.mark_weights_partial(i)
        suspects = self.ledger.suspected_shards()
        if len(suspects) == 1:
            self.ledger.condemn_silent_participant(suspects[0], "aborted")

    @rule(i=shard)
    def condemn_silent_participant(self, i: int) -> None:
        self._op("condemn_silent_participant", i)
        self.ledger.condemn_silent_participant(i, "aborted")

    @rule(i=shard)
    def mark_restarting(self, i: int) -> None:
        self._op("mark_restarting", i)
        self.ledger.mark_restarting(i)

    @rule(i=shard)
    def mark_restart_failed(self, i: int) -> None:
        self._op("mark_restart_failed", i)
        self.ledger.mark_restart_failed(i, "no health")

    @rule(i=shard)
    def mark_loaded(self, i: int) -> None:
        self._op("mark_loaded", i)
        self.port += 1
        self.ledger.mark_loaded(i, f"http://10.0.0.{i}:{self.port}", f"launch-{self.port}")

    @rule(i=shard, version=st.integers(0, 5))
    def report_refit(self, i: int, version: int) -> None:
        self._op("report_refit", i)
        self.ledger.report_refit(i, version)

    @rule(version=st.integers(0, 5))
    def complete_refit(self, version: int) -> None:
        self._op("complete_refit", -1)
        for i in self.ledger.refit_participants():
            self.ledger.report_refit(i, version)

    @rule(i=shard, inc=st.sampled_from(["a", "b", "c"]))
    def observe_incarnation(self, i: int, inc: str) -> None:
        self._op("observe_incarnation", i)
        self.ledger.observe_incarnation(i, inc)

    @rule(i=shard, held=st.booleans(), discarded=st.booleans())
    def report_asleep(self, i: int, held: bool, discarded: bool) -> None:
        self._op("report_asleep", i)
        self.ledger.report_asleep(i, "asleep", held=held, weights_discarded=discarded)

    @rule(i=shard)
    def mark_suspect(self, i: int) -> None:
        self._op("mark_suspect", i)
        self.ledger.mark_suspect(i, "refit lease overran")

    @rule(i=shard, by_trainer=st.booleans())
    def report_awake(self, i: int, by_trainer: bool) -> None:
        self._op("report_awake", i)
        self.last_awake_by_trainer = by_trainer
        self.ledger.report_awake(i, "awake", by_trainer=by_trainer)

    @rule(i=shard, inc=st.sampled_from([None, "a", "d"]))
    def observe_restart(self, i: int, inc: str | None) -> None:
        self._op("observe_incarnation", i)
        self.ledger.observe_incarnation(i, inc, restarted=True)

    @rule(i=shard)
    def new_run(self, i: int) -> None:
        self._op("new_run", i)
        self.port += 1
        self.ledger.new_run(i, f"http://10.0.1.{i}:{self.port}", f"run-{self.port}")

    @rule(i=shard, version=st.integers(0, 5))
    def missed_refit(self, i: int, version: int) -> None:
        self._op("missed_refit", i)
        self.ledger.missed_refit(i, version)

    @rule(i=shard, health=st.sampled_from(["proven", "unproven", "failing", "condemned"]),
          restarted=st.booleans(), canary=st.sampled_from([None, True, False]),
          excused=st.booleans(), sleep=st.sampled_from([None, 0, 1, 2]))
    def record_reading(self, i: int, health: str, restarted: bool, canary: bool | None,
                       excused: bool, sleep: int | None) -> None:
        self._op("record_reading", i)
        self.ledger.record_reading(i, Reading(
            health, "X", restarted=restarted, incarnation="r" if restarted else None,  # type: ignore[arg-type]
            canary_ok=canary, excused=excused, sleep_level=sleep))

    @precondition(lambda self: self.t > 30)  # retirements late, so most runs see restarts first
    @rule(i=shard)
    def retire(self, i: int) -> None:
        self._op("retire", i)
        self.ledger.retire(i, "operator")

    @rule(i=shard, cause=st.sampled_from(HoldCause), held=st.booleans())
    def hold(self, i: int, cause: HoldCause, held: bool) -> None:
        """Focused reads hold an engine out (3 s at most: three operations) or release it."""
        self._op("hold" if held else "release", i)
        url = self.ledger.shard(i).base_url
        if held:
            self.ledger.admission.hold(url, cause, 3.0)
        else:
            self.ledger.admission.release(url, cause)

    @rule(i=shard)
    def expire_holds_and_end_reads(self, i: int) -> None:
        self._op("expire", i)
        self.ledger.admission.expire()
        self.ledger.admission.reads_ended(self.ledger.shard(i).base_url)

    # ------------------------------------------------------------ invariants

    def _pairs(self) -> list[tuple[ShardRecord, ShardRecord]]:
        return list(zip(self.before, self.ledger.snapshot(), strict=True))

    @invariant()
    def a_hold_never_leaves_the_routers_none(self) -> None:
        routed, serving = self.ledger.admission.routed(), self.ledger.serving_urls()
        assert set(routed) <= set(serving) and bool(routed) == bool(serving)
        held = self.ledger.admission.held()
        assert all(u in held for u in set(serving) - set(routed))

    @invariant()
    def only_moves_in_the_table(self) -> None:
        for t in self.seen[getattr(self, "seen_before", 0):]:
            assert TRANSITIONS[t.from_state][t.event] is t.to_state

    @invariant()
    def no_dead_to_healthy_and_no_absent_to_suspect(self) -> None:
        for a, b in self._pairs():
            assert not (a.state is D and b.state is H)
            assert not (a.state in (D, R) and b.state is S)
            # re-entry is always DEAD -> RESTARTING -> STALE -> HEALTHY
            if a.state is D:
                assert b.state in (D, R, X)
            if a.state is R:
                assert b.state in (R, ST, D, X)

    @invariant()
    def stale_is_left_only_by_refit_death_or_retirement(self) -> None:
        name, _ = self.last_op
        for a, b in self._pairs():
            if a.state is ST and b.state is not ST:
                assert b.state in (H, S, D, X, SL)
                if b.state is SL:
                    assert name in ("report_asleep", "record_reading")
                    assert b.state_before_sleep is ST
                if b.state in (H, S):  # a refit (static weights: a good canary is one)
                    assert name in ("report_refit", "complete_refit", "record_reading")
                if b.state is D:
                    assert name in ("condemn", "condemn_silent_participant", "abort_refit",
                                    "record_probe", "record_reading")

    @invariant()
    def a_sleeping_shard_wakes_to_what_it_slept_in_as_refits_made_it(self) -> None:
        name, _ = self.last_op
        for a, b in self._pairs():
            if a.state is SL and b.state is not SL:
                if name == "report_awake":
                    assert b.state is a.state_before_sleep
                    assert not a.sleep_held or self.last_awake_by_trainer
                elif b.state in (H, S):  # a read that says awake, then what else it says
                    # (a held sleep is the old process's: a restart's new process is awake)
                    assert name == "record_reading" and (
                        not a.sleep_held or b.incarnation != a.incarnation)
                else:
                    assert b.state in (ST, D, X)  # woke STALE, a new process, death, retirement
            if a.state is SL and b.state is SL and a.state_before_sleep is not ST \
                    and b.state_before_sleep is ST:
                assert name in ("mark_weights_partial", "abort_refit", "complete_refit",
                                "missed_refit", "record_reading") or (  # or a restart, asleep
                    name == "report_asleep" and b.weights_discarded)  # a level-2 sleep
            if a.state is not SL and b.state is SL:
                assert name in ("report_asleep", "record_reading")
                # a reading may tell a restart first: the new process starts with no history
                # (STALE in trainer mode, HEALTHY on static weights), then falls asleep
                assert b.state_before_sleep is a.state or (
                    name == "record_reading" and b.state_before_sleep is ST) or (
                    name == "record_reading" and b.incarnation != a.incarnation) or (
                    b.weights_discarded and b.state_before_sleep is ST)  # a level-2 sleep
        for r in self.ledger.snapshot():
            assert (r.state_before_sleep is not None) == (r.state is SL)
            assert r.state_before_sleep in (None, H, S, ST)
            assert not r.sleep_held or r.state is SL

    @invariant()
    def probes_never_change_a_shard_without_a_process_nor_lift_a_stale_one(self) -> None:
        name, i = self.last_op
        if name == "record_probe":
            a, b = self.before[i], self.ledger.shard(i)
            if a.state in ABSENT:
                assert a == b
            if a.state is ST:
                assert b.state in (ST, D)  # failed reads may prove it dead; none lift it
            if a.state is SL:
                assert b.state in (SL, D)  # nor wake a sleeper

    @invariant()
    def retired_never_changes_and_attempts_never_decrease(self) -> None:
        for a, b in self._pairs():
            if a.state is X:
                assert a == b
            assert b.restart_attempts >= a.restart_attempts
            assert b.restart_attempts <= self.ledger.policy.max_restart_attempts + 1

    @invariant()
    def a_new_process_starts_with_no_history(self) -> None:
        for a, b in self._pairs():
            if a.state is R and b.state is ST:
                assert (b.consecutive_probe_failures, b.consecutive_probe_successes,
                        b.consecutive_reported_failures) == (0, 0, 0)
                assert b.state_before_partial is None
                assert b.restart_attempts == a.restart_attempts
                assert b.weight_version == a.weight_version

    @invariant()
    def a_healthy_shard_is_routed(self) -> None:
        # HEALTHY is the ledger's promise that the shard serves: it is in every push. An
        # ejection or a trial is about a SUSPECT shard only; one kept past the state that
        # justified it would keep a HEALTHY shard out of routing for good.
        snap = self.ledger.snapshot()
        for r in snap:
            if r.state is H:
                assert r.routable and not r.on_trial, r
        urls = set(self.ledger.serving_urls())
        assert {r.base_url for r in snap if r.state is H} <= urls

    @invariant()
    def queries_agree_with_states(self) -> None:
        snap = self.ledger.snapshot()
        assert self.ledger.serving() == [r.index for r in snap if r.state in ROUTABLE]
        assert self.ledger.absent() == [r.index for r in snap if r.state in ABSENT]
        assert self.ledger.refit_participants() == [r.index for r in snap if r.state not in ABSENT]
        assert sum(self.ledger.counts_by_state().values()) == N
        for r in snap:
            assert self.ledger.shard_for_url(r.base_url) == r.index
            assert r.state_before_partial is not ST
            if r.state_before_partial is not None:
                assert r.state is ST or r.state in ABSENT or (
                    r.state is SL and r.state_before_sleep is ST)

    @invariant()
    def an_engine_that_lost_its_weights_never_serves_under_a_version_label(self) -> None:
        pushed = set(self.ledger.serving_urls())
        for r in self.ledger.snapshot():
            if r.weights_discarded:
                assert r.state not in ROUTABLE and r.base_url not in pushed

    @invariant()
    def the_serving_set_is_never_empty_while_a_serving_shard_could_serve(self) -> None:
        """Envoy's panic rule (50 %): ejected shards serve again rather than nobody; nothing
        that is not HEALTHY or SUSPECT is ever pushed."""
        snap = self.ledger.snapshot()
        serving = {r.base_url for r in snap if r.state in ROUTABLE}
        pushed = set(self.ledger.serving_urls())
        assert pushed <= serving
        assert bool(pushed) == bool(serving)
        if not self.ledger.panicking():
            assert pushed == {r.base_url for r in snap if r.routable}

    @invariant()
    def every_change_was_emitted(self) -> None:
        emitted = {t.shard for t in self.seen[getattr(self, "seen_before", 0):]}
        for a, b in self._pairs():
            if (a.state, a.consecutive_reported_failures, a.restart_attempts, a.base_url) != (
                b.state, b.consecutive_reported_failures, b.restart_attempts, b.base_url):
                assert a.index in emitted
        if self.seen:
            last = {t.shard: t.record for t in self.seen}
            for i, rec in last.items():
                now = self.ledger.shard(i)
                assert (rec.state, rec.consecutive_reported_failures) == (
                    now.state, now.consecutive_reported_failures)


LedgerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
test_ledger_invariants_hold_for_any_sequence_of_operations = LedgerMachine.TestCase


class StaticLedgerMachine(LedgerMachine):
    weights: WeightsMode = "static"


StaticLedgerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
test_ledger_invariants_hold_with_static_weights = StaticLedgerMachine.TestCase


def test_kept_case_a_suspect_engine_restarted_asleep_on_static_weights() -> None:
    """Hypothesis's shrunk counterexample, kept: a SUSPECT shard's reading tells a restart and
    sleep at once; on static weights the new process sleeps as HEALTHY (no inherited
    suspicion), which the sleep invariant once refused."""
    machine = StaticLedgerMachine()
    checks = [getattr(machine, name) for name in dir(StaticLedgerMachine)
              if hasattr(getattr(StaticLedgerMachine, name), INVARIANT_MARKER)]
    assert len(checks) >= 10  # the invariants were found, not an empty loop

    def check() -> None:
        for f in checks:
            f()

    check()
    machine.mark_suspect(i=0)
    check()
    machine.record_reading(canary=None, excused=False, health="proven", i=0, restarted=True,
                           sleep=1)
    check()
    assert machine.ledger.shard(0).state_before_sleep is H
    machine.teardown()


def test_kept_case_an_engine_held_asleep_restarted_awake_on_static_weights() -> None:
    """Hypothesis's shrunk counterexample, kept: a shard the trainer holds asleep, whose
    reading tells a restart, awake. The hold was the old process's; the new process starts
    awake with no history and, on static weights, serves (the sleep invariant once refused)."""
    machine = StaticLedgerMachine()
    checks = [getattr(machine, name) for name in dir(StaticLedgerMachine)
              if hasattr(getattr(StaticLedgerMachine, name), INVARIANT_MARKER)]

    def check() -> None:
        for f in checks:
            f()

    machine.report_asleep(discarded=False, held=True, i=0)
    check()
    assert machine.ledger.shard(0).sleep_held
    machine.record_reading(canary=True, excused=False, health="proven", i=0, restarted=True,
                           sleep=None)
    check()
    assert machine.ledger.shard(0).state is H and not machine.ledger.shard(0).sleep_held
    machine.teardown()
