"""The refit coordinator: leases, the single-suspect rule, overruns (docs/design.md section 8)."""

from __future__ import annotations

import pytest

from fleetwarden.judge import CanaryRule, Evidence, Health, Verdict
from fleetwarden.ledger import Ledger, Policy, Reading, ShardState
from fleetwarden.reads import ReportBook
from fleetwarden.refit import (
    CANNOT_SAY,
    EngineWeights,
    ProcessSeen,
    RefitCoordinator,
    RefitError,
    confirmation,
)
from fleetwarden.watchdog import Report
from support.clock import Clock

H, S, ST, D, R, X = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE,
                     ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED)


def seen(*shards: int) -> dict[int, ProcessSeen]:
    """A lease read that answered from ``shards``, telling nothing of their processes."""
    return {i: ProcessSeen() for i in shards}


def make(n: int = 4, lease_s: float = 60) -> tuple[Ledger, RefitCoordinator, Clock]:
    clock = Clock(0.0)
    ledger = Ledger([f"http://127.0.0.1:{9000 + i}" for i in range(n)],
                    Policy(weights="trainer"), clock=clock)
    return ledger, RefitCoordinator(ledger, lease_s=lease_s, clock=clock), clock


def test_participants_are_serving_and_stale_shards_with_their_urls() -> None:
    ledger, refit, _ = make(4)
    ledger.condemn(3, "exited")
    ledger.mark_weights_partial(2)
    lease = refit.begin_refit(1)
    assert [(p.shard, p.url) for p in lease.participants] == [
        (0, "http://127.0.0.1:9000"), (1, "http://127.0.0.1:9001"), (2, "http://127.0.0.1:9002")]
    assert refit.stalls_excused() == {0, 1, 2}


def test_a_completed_refit_brings_stale_shards_back_and_sets_the_version() -> None:
    ledger, refit, _ = make(3)
    ledger.condemn(1, "exited")
    ledger.mark_restarting(1)
    ledger.mark_loaded(1, "http://127.0.0.1:7001", "launch-2")
    refit.begin_refit(5)
    record = refit.complete_refit(5)
    assert record.participants == (0, 1, 2)
    assert [ledger.state(i) for i in range(3)] == [H, H, H]
    assert {ledger.shard(i).weight_version for i in range(3)} == {5}
    assert refit.current_version == 5 and refit.lease is None


def test_an_aborted_refit_keeps_a_suspicion() -> None:
    ledger, refit, _ = make(3)
    ledger.report_failure(0, "timeout")  # SUSPECT
    ledger.report_failure(1, "timeout")  # a second suspect: nobody can be singled out
    refit.begin_refit(1)
    record = refit.abort_refit(1, "trainer timed out")
    assert record.condemned == ()
    assert [ledger.state(i) for i in range(3)] == [ST, ST, ST]
    refit.begin_refit(1)
    refit.complete_refit(1)
    assert [ledger.state(i) for i in range(3)] == [S, S, H]
    assert ledger.shard(0).consecutive_reported_failures == 1


def test_an_abort_with_exactly_one_suspect_condemns_the_silent_participant() -> None:
    ledger, refit, _ = make(4)
    ledger.report_failure(1, "timeout")
    ledger.report_failure(1, "timeout")
    refit.begin_refit(1)
    record = refit.abort_refit(1, "NCCL broadcast timed out")
    assert record.condemned == (1,)
    assert ledger.state(1) is D
    assert "NCCL broadcast timed out" in ledger.shard(1).last_error
    assert [ledger.state(i) for i in (0, 2, 3)] == [ST, ST, ST]


def test_a_lease_overrun_marks_suspect() -> None:
    ledger, refit, clock = make(3, lease_s=60)
    refit.begin_refit(1)
    clock.now = 59
    assert refit.check_lease() is None
    clock.now = 61
    record = refit.check_lease()
    assert record is not None and record.outcome == "overran"
    assert [ledger.state(i) for i in range(3)] == [S, S, S]
    assert "overran its lease of 60 s" in ledger.shard(0).last_error
    assert refit.lease is None and refit.stalls_excused() == frozenset()
    assert refit.check_lease() is None  # once


def test_a_shard_replaced_during_the_sync_did_not_get_the_weights() -> None:
    ledger, refit, _ = make(2)
    refit.begin_refit(3)
    ledger.condemn(1, "exited")
    ledger.mark_restarting(1)
    ledger.mark_loaded(1, "http://127.0.0.1:7001", "launch-2")
    record = refit.complete_refit(3)
    assert record.participants == (0,)
    assert ledger.state(1) is ST and ledger.shard(1).weight_version == 0


def test_refit_calls_out_of_order_are_errors() -> None:
    ledger, refit, _ = make(2)
    with pytest.raises(RefitError, match="no refit is open"):
        refit.complete_refit(1)
    refit.begin_refit(2)
    with pytest.raises(RefitError, match="still open"):
        refit.begin_refit(3)
    with pytest.raises(RefitError, match="version 2, not 3"):
        refit.complete_refit(3)
    refit.complete_refit(2)
    with pytest.raises(RefitError, match="older"):
        refit.begin_refit(1)
    for i in range(2):
        ledger.retire(i, "operator")
    with pytest.raises(RefitError, match="no shard can take weights"):
        refit.begin_refit(5)


def test_an_engine_restarted_on_its_url_during_the_lease_is_not_credited() -> None:
    """Two attached engines in trainer mode; during the refit to v2 engine 1
    is replaced by a new process on the same URL. It never got v2: it is not credited, and
    waits in STALE for the next refit."""
    ledger, refit, _ = make(2)
    refit.begin_refit(1)
    refit.complete_refit(1)
    refit.begin_refit(2)
    # the watchdog sees engine 1's start time change (an attached engine: never identified)
    ledger.record_reading(1, Reading("proven", "RESTARTED", restarted=True, incarnation="7.0"))
    record = refit.complete_refit(2)
    assert record.participants == (0,)
    assert (ledger.state(1), ledger.shard(1).weight_version) == (ST, 1)
    assert (ledger.state(0), ledger.shard(0).weight_version) == (H, 2)


def test_a_new_process_the_ledger_only_identified_during_the_lease_is_not_credited() -> None:
    ledger, refit, _ = make(2)
    lease = refit.begin_refit(1)
    assert [p.incarnation for p in lease.participants] == [None, None]
    ledger.observe_incarnation(1, "7.0")  # who it is now: not the process that took part
    causes: list[str] = []
    ledger.subscribe(lambda t: causes.append(t.cause))
    record = refit.complete_refit(1)
    assert record.participants == (0,)
    assert ledger.state(1) is ST
    assert any("did not get the weights" in c for c in causes)


def test_the_refit_history_in_memory_is_bounded() -> None:
    from fleetwarden.refit import HISTORY_KEPT

    _, refit, _ = make(1)
    for v in range(HISTORY_KEPT + 20):
        refit.begin_refit(v)
        refit.complete_refit(v)
    assert len(refit.history) == HISTORY_KEPT and refit.history[-1].version == HISTORY_KEPT + 19


def test_a_lease_keeps_each_participants_liveness_since_it_changed_and_names_culprits() -> None:
    _, refit, clock = make(3)
    lease = refit.begin_refit(1)
    for i in range(3):
        refit.observe_participant(i, process_alive=True, api_answers=True, evidence="IDLE")
    clock.now += 4
    refit.observe_participant(0, process_alive=True, api_answers=True, evidence="BUSY")
    silent = refit.observe_participant(1, process_alive=True, api_answers=False,
                                       evidence="UNREACHABLE: refused")
    gone = refit.observe_participant(2, process_alive=False, api_answers=None,
                                     evidence="DEAD: process exited")
    assert silent is not None and gone is not None and silent.since == gone.since == clock.now
    assert lease.status[0].since == clock.now - 4  # unchanged since the first read
    assert lease.status[0].evidence == "BUSY"
    assert [s.shard for s in lease.culprits()] == [1, 2]
    assert silent.to_dict()["culprit"] is True
    assert refit.observe_participant(3, process_alive=True, api_answers=True, evidence="") is None
    refit.abort_refit(1, "broadcast hung")
    assert refit.observe_participant(0, process_alive=True, api_answers=True,
                                     evidence="") is None  # no lease any more


def test_the_default_lease_is_nemo_rls_refit_timeout() -> None:
    from fleetwarden.config import Config

    assert Config().refit.lease_s == 300.0


def test_an_abort_condemns_no_one_when_the_culprit_already_died() -> None:
    """The participant that stalled the broadcast died during the sync; another one was
    suspected for an unrelated failed request. The abort must not condemn that one."""
    ledger, refit, _ = make(3)
    refit.begin_refit(1)
    ledger.condemn(2, "process exited")  # the culprit: already dead
    ledger.report_failure(1, "one timed-out request")  # an innocent suspect
    record = refit.abort_refit(1, "NCCL broadcast timed out")
    assert record.condemned == ()
    assert ledger.state(1) is ST and ledger.state(0) is ST
    assert ledger.shard(1).state_before_partial is S  # its suspicion is kept for the next refit


def test_an_abort_condemns_no_one_when_the_lease_names_another_culprit() -> None:
    ledger, refit, _ = make(3)
    refit.begin_refit(1)
    ledger.report_failure(1, "one timed-out request")
    refit.observe_participant(2, process_alive=True, api_answers=False,
                              evidence="UNREACHABLE: refused")
    record = refit.abort_refit(1, "broadcast hung")
    assert record.condemned == ()
    assert ledger.state(1) is ST


def test_an_engine_without_a_start_time_restarted_during_the_lease_is_not_credited() -> None:
    """SGLang, TGI, `openai` profiles give no start time: a restart is seen only as counters
    that went back. The new process gets a name of the ledger's own, so the refit that the old
    process took part in is not credited to it."""
    ledger, refit, _ = make(2)
    lease = refit.begin_refit(1)
    assert [p.incarnation for p in lease.participants] == [None, None]
    ledger.record_reading(1, Reading("proven", "RESTARTED", restarted=True, incarnation=None))
    assert ledger.shard(1).incarnation == "restart-seen-1"
    record = refit.complete_refit(1)
    assert record.participants == (0,)
    assert (ledger.state(1), ledger.shard(1).weight_version) == (ST, 0)
    # and the next restart seen is another process again
    ledger.record_reading(1, Reading("proven", "RESTARTED", restarted=True, incarnation=None))
    assert ledger.shard(1).incarnation == "restart-seen-2"


def test_an_engine_without_a_start_time_that_stopped_answering_is_not_credited() -> None:
    """Refused, then back: with no start time nothing tells a restart from a blip, so a
    version is credited only to a process seen alive through the whole lease."""
    ledger, refit, _ = make(3)
    ledger.observe_incarnation(2, "1700000000.0")  # this one gives a start time
    refit.begin_refit(1)
    for i in range(3):
        refit.observe_participant(i, process_alive=True, api_answers=True, evidence="IDLE")
    refit.observe_participant(1, process_alive=True, api_answers=False,
                              evidence="UNREACHABLE: refused")
    refit.observe_participant(2, process_alive=True, api_answers=False,
                              evidence="UNREACHABLE: refused")
    refit.observe_participant(1, process_alive=True, api_answers=True, evidence="IDLE")
    refit.observe_participant(2, process_alive=True, api_answers=True, evidence="IDLE")
    record = refit.complete_refit(1)
    # shard 2's start time did not change: the same process, credited
    assert record.participants == (0, 2)
    assert [ledger.state(i) for i in range(3)] == [H, ST, H]


def test_a_participant_not_read_alive_at_the_lease_end_is_not_credited() -> None:
    """The trainer completes right after a participant restarted, before any read saw it:
    the ledger still names the old process, with a start time or not. The fleet reads every
    participant when the trainer completes; one whose read did not answer (still starting,
    or gone) may be a new process, and is STALE rather than credited with what it never
    received."""
    ledger, refit, _ = make(3)
    ledger.observe_incarnation(0, "1700000001.0")  # these give a start time
    ledger.observe_incarnation(2, "1700000000.0")
    refit.begin_refit(1)
    record = refit.complete_refit(1, read_at_end=seen(0))
    assert record.participants == (0,)
    assert [ledger.state(i) for i in range(3)] == [H, ST, ST]
    assert [ledger.shard(i).weight_version for i in range(3)] == [1, 0, 0]
    # read at the end, a restart shows (a new start time) and is not credited either
    refit.begin_refit(2)
    ledger.observe_incarnation(0, "1700000099.0")  # the end read saw a new process
    record = refit.complete_refit(2, read_at_end=seen(0, 1, 2))
    assert record.participants == (1, 2)
    assert ledger.state(0) is ST


def test_a_participant_not_read_at_the_lease_start_is_not_credited() -> None:
    """A participant with no read at the lease's start (just replaced, not read yet) has no
    baseline: a restart during the lease (a new start time) is then its first read's start
    time, and nothing tells it apart. Read at the start it is credited as usual."""
    ledger, refit, _ = make(3)
    refit.begin_refit(1)
    refit.read_at_start(seen(0, 2))
    record = refit.complete_refit(1, read_at_end=seen(0, 1, 2))
    assert record.participants == (0, 2)
    assert [ledger.state(i) for i in range(3)] == [H, ST, H]
    refit.begin_refit(2)
    refit.read_at_start(seen(0, 1, 2))
    assert refit.complete_refit(2, read_at_end=seen(0, 1, 2)).participants == (0, 1, 2)


def test_an_overrun_lease_leaves_the_old_weights_serving() -> None:
    """Every participant is suspected, none is ejected but the one the lease names as the
    culprit: the fleet keeps serving the weights it had (no empty serving set, no 409s)."""
    ledger, refit, clock = make(3, lease_s=60)
    refit.begin_refit(1)
    refit.observe_participant(2, process_alive=True, api_answers=False,
                              evidence="UNREACHABLE: refused")
    clock.now = 61
    record = refit.check_lease()
    assert record is not None and record.participants == (0, 1, 2)
    assert [ledger.state(i) for i in range(3)] == [S, S, S]
    assert ledger.serving_urls() == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert ledger.ejected() == [2]


def test_an_overrun_lease_with_no_culprit_ejects_no_one() -> None:
    ledger, refit, clock = make(2, lease_s=10)
    refit.begin_refit(1)
    clock.now = 11
    refit.check_lease()
    assert ledger.ejected() == []
    assert len(ledger.serving_urls()) == 2


def test_the_lease_compares_its_own_two_reads_of_a_participant() -> None:
    """The ledger learns of a restart only from a read that says RESTARTED against the
    watch's last sample; another read of the engine (a focused read, the tick's) may have moved
    that sample to the new process while its own report was still on its way, so the read at
    the lease's end says nothing and the ledger still names the old process. The lease keeps
    what its read at the start saw, and the read at the end that shows another process (a new
    start time; counters gone back, for an engine that gives no start time) is not credited."""
    ledger, refit, _ = make(3)
    refit.begin_refit(1)
    refit.read_at_start({0: ProcessSeen("1700000001.0", {"generation_tokens": 40.0}),
                         1: ProcessSeen(None, {"generation_tokens": 90.0}),
                         2: ProcessSeen("1700000002.0", {"generation_tokens": 7.0})})
    record = refit.complete_refit(1, read_at_end={
        0: ProcessSeen("1700000099.0", {"generation_tokens": 0.0}),  # a new start time
        1: ProcessSeen(None, {"generation_tokens": 3.0}),  # no start time; counters went back
        2: ProcessSeen("1700000002.0", {"generation_tokens": 12.0})})  # the same process
    assert record.participants == (2,)
    assert [ledger.state(i) for i in range(3)] == [ST, ST, H]
    assert [ledger.shard(i).weight_version for i in range(3)] == [0, 0, 1]


def test_what_neither_read_knows_proves_no_restart() -> None:
    """No start time and no counters (a proxy read on /v1/models): nothing to compare, so the
    lease's reads do not stand in the way; the ledger's own incarnation still does."""
    assert ProcessSeen().same_process(ProcessSeen("1700000000.0", {"x": 1.0}))
    assert ProcessSeen("1.0", {"a": 1.0}).same_process(ProcessSeen(None, {}))
    assert not ProcessSeen("1.0").same_process(ProcessSeen("2.0"))


def test_a_new_process_at_a_participants_url_is_not_its_process_alive() -> None:
    """A participant restarted in place (an attached engine, a supervisor at the same URL)
    during a lease did not get the weights: the lease shows its process gone, however well
    the new one answers."""
    ledger, refit, _ = make(2)
    for i in range(2):
        ledger.observe_incarnation(i, "1000.0")
    lease = refit.begin_refit(1)
    url = ledger.shard(0).base_url
    ledger.observe_incarnation(0, "2000.0")  # a new process, same URL
    book = ReportBook(ledger, refit=refit)
    answers = Report(url, Verdict.IDLE, Evidence("idle"), Health.PROVEN, CanaryRule.NEVER,
                     None, None, None, "2000.0")
    book.observe_participant(0, url, answers)
    assert lease.status[0].process_alive is False and lease.status[0].culprit
    book.observe_participant(1, ledger.shard(1).base_url,
                             Report(ledger.shard(1).base_url, Verdict.IDLE, Evidence("idle"),
                                    Health.PROVEN, CanaryRule.NEVER, None, None, None,
                                    "1000.0"))
    assert lease.status[1].process_alive is True


# ---------------------------------------------------------------------- the engine's own word

SUMS = {"dp0:pp0:pcp0:tp0:lm_head.weight": "aa", "dp0:pp0:pcp0:tp0:embed.weight": "bb"}


def says(version: str | None, checksums: dict[str, str] | None = None,
         error: str = "") -> EngineWeights:
    return EngineWeights(can_say=True, version=version, checksums=checksums, error=error)


@pytest.mark.parametrize(("said", "sums", "expected", "words"), [
    (says("7"), None, True, "reports weight version 7"),
    (says("7", SUMS), SUMS, True, "the trainer's checksums"),
    (says("6"), None, False, "reports weight version '6', not 7"),
    (says("default"), None, False, "'default', not 7"),  # a restarted engine: never stamped
    (says("7", {**SUMS, "dp0:pp0:pcp0:tp0:lm_head.weight": "zz"}), SUMS, False,
     "differ from the trainer's on 1 of 2 parameters (dp0:pp0:pcp0:tp0:lm_head.weight)"),
    (says("7", {"dp0:pp0:pcp0:tp0:lm_head.weight": "aa"}), SUMS, False, "on 1 of 2"),
    (says("7", error="POST /weight_checker answered 500"), SUMS, False,
     "checksums could not be read: POST /weight_checker answered 500"),
    (says(None, error="GET /weight_info: TimeoutError"), None, False,
     "could not be read: GET /weight_info: TimeoutError"),
    (CANNOT_SAY, SUMS, None, "cannot say"),
])
def test_an_engine_confirms_only_its_own_version_and_checksums(
        said: EngineWeights, sums: dict[str, str] | None, expected: bool | None,
        words: str) -> None:
    ok, why = confirmation(7, sums, said)
    assert ok is expected and words in why


def test_a_participant_whose_engine_disagrees_stays_stale_and_is_named() -> None:
    ledger, refit, _ = make(4)
    ledger.mark_weights_partial(3)  # STALE before: still STALE after, with the new cause
    refit.begin_refit(1)
    record = refit.complete_refit(1, weights={0: says("1"), 1: says("default"),
                                              2: CANNOT_SAY, 3: says("0")})
    assert [ledger.state(i) for i in range(4)] == [H, ST, H, ST]
    assert record.participants == (0, 2) and record.confirmed == (0,)
    assert dict(record.unconfirmed) == {1: "reports weight version 'default', not 1",
                                        3: "reports weight version '0', not 1"}
    assert ledger.shard(1).weight_version == 0  # not credited
    assert "not confirmed by the engine" in ledger.shard(1).last_error
    assert not ledger.shard(1).routable and 1 not in ledger.serving()


def test_without_the_engines_word_the_lease_reads_alone_credit() -> None:
    """A caller that asked no engine (``weights=None``), or an engine not among those asked:
    the weaker rule, the lease's reads alone."""
    _, refit, _ = make(2)
    refit.begin_refit(1)
    record = refit.complete_refit(1)
    assert record.participants == (0, 1) and record.confirmed == () == record.unconfirmed
    refit.begin_refit(2)
    record = refit.complete_refit(2, weights={0: says("2")})
    assert record.participants == (0, 1) and record.confirmed == (0,)


def test_a_failed_load_is_not_credited_even_where_the_engine_cannot_say() -> None:
    ledger, refit, _ = make(3)
    refit.begin_refit(1)
    record = refit.complete_refit(1, weights={0: CANNOT_SAY, 1: CANNOT_SAY, 2: says("1")},
                                  failed={1: "POST /pause answered 404: Not Found",
                                          2: "POST /resume: ClientConnectorError"})
    assert [ledger.state(i) for i in range(3)] == [H, ST, ST]
    assert dict(record.unconfirmed)[1] == "its load failed: POST /pause answered 404: Not Found"


def test_an_unconfirmed_suspect_comes_back_suspect_after_the_next_refit() -> None:
    """Left STALE by its engine's word, a suspected shard keeps its suspicion for the refit that
    finally lands, as after an aborted one: the failures it was suspected for are not the
    weights'."""
    ledger, refit, _ = make(2)
    ledger.report_failure(0, "a failed window")
    refit.begin_refit(1)
    refit.complete_refit(1, weights={0: says("0"), 1: says("1")})
    assert ledger.state(0) is ST and ledger.shard(0).state_before_partial is S
    refit.begin_refit(2)
    refit.complete_refit(2, weights={0: says("2"), 1: says("2")})
    assert ledger.state(0) is S and ledger.state(1) is H


def test_a_steps_cost_is_what_the_routers_counted_since_the_last_load() -> None:
    """``cost_totals`` sums the routers' fault counters; ``cost_since`` charges a step with
    what they counted since the last load, and a router restarted in between (its counters
    from zero) with what it counted since its start, never a negative count."""
    from fleetwarden.weight_sync import cost_since, cost_totals

    def router(retries: int, aborted: int, tokens: int, failed: int) -> dict[str, object]:
        return {"retries": {"free": 1, "paid": retries}, "rescues": 1, "aborted": aborted,
                "continuations": {"tokens": 2, "text": 1, "restart": 5},
                "streams_ended": {"reset": 1}, "tokens_discarded": tokens,
                "failures": {"http://e:1": {"aborted": failed}}}

    before = cost_totals([router(2, 1, 10, 1), router(0, 0, 0, 0)])
    assert before == {"re_sent": 4, "continued": 6, "aborted": 1, "rescued": 2,
                      "ended_with_error": 2, "tokens_discarded": 10,
                      "failures": {"http://e:1": {"aborted": 1}}}
    now = cost_totals([router(5, 4, 70, 3), router(0, 0, 0, 0)])
    assert cost_since(before, now) == {"re_sent": 3, "continued": 0, "aborted": 3,
                                       "rescued": 0, "ended_with_error": 0,
                                       "tokens_discarded": 60,
                                       "failures": {"http://e:1": {"aborted": 2}}}
    assert cost_since(now, now)["failures"] == {}
    restarted = cost_totals([router(0, 1, 5, 1)])  # one router, counting from zero again
    assert cost_since(now, restarted)["aborted"] == 1
    assert cost_since(now, restarted)["tokens_discarded"] == 5
