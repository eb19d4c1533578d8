"""The router's pure core: picking, in-flight counts, outcome tallies, the retry budget."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetwarden.router.pool import (
    BackendFacts,
    Pool,
    RetryBudget,
    SessionRing,
    blamed_5xx,
    poison_quorum,
)
from fleetwarden.router.settings import RouterSettings

A, B, C, D = (f"http://10.0.0.{i}:8000" for i in range(1, 5))


def test_ties_rotate_for_requests_with_a_minimum_weight_version_too() -> None:
    """Backends a minimum version rules out are not ones the request failed on: its first
    attempt moves the tie-break on like any other, so sequential requests share the
    qualifying backends (the turn that falls on the one ruled out goes to the next)."""
    pool = Pool([])
    pool.replace([A, B, C, D], {A: BackendFacts(0, 1), B: BackendFacts(1, 2),
                                C: BackendFacts(2, 2), D: BackendFacts(3, 2)})
    picks = Counter(pool.pick(min_version=2) for _ in range(300))
    assert picks == {B: 150, C: 75, D: 75}


def test_the_least_loaded_backend_is_picked() -> None:
    pool = Pool([A, B, C])
    pool.dispatched(A)
    pool.dispatched(A)
    pool.dispatched(B)
    assert pool.pick() == C
    pool.dispatched(C)
    pool.dispatched(C)
    assert pool.pick() == B


def test_ties_rotate_so_an_idle_fleet_shares_sequential_requests() -> None:
    pool = Pool([A, B, C])
    picks = Counter(pool.pick() for _ in range(300))
    assert picks == {A: 100, B: 100, C: 100}


def test_a_retry_never_returns_to_a_backend_it_tried() -> None:
    pool = Pool([A, B, C])
    assert pool.pick(exclude=[A, B]) == C
    assert pool.pick(exclude=[A, B, C]) is None
    assert Pool().pick() is None


def test_retries_do_not_move_the_rotation() -> None:
    # If every retry moved the tie-break on, a failing backend could be first for every request.
    pool = Pool([A, B])
    firsts = []
    for _ in range(10):
        first = pool.pick()
        firsts.append(first)
        if first == B:
            assert pool.pick(exclude=[B]) == A
    assert firsts.count(B) == 5


def test_in_flight_is_counted_until_finished_and_a_leaver_is_forgotten_when_idle() -> None:
    pool = Pool([A, B])
    pool.dispatched(A)
    pool.replace([B, C])  # A leaves with one request still on it; C is new
    assert pool.in_flight() == {A: 1, B: 0, C: 0}
    assert pool.pick() in (B, C)  # a leaver is never picked
    pool.finished(A)
    assert pool.in_flight() == {B: 0, C: 0}
    assert pool.total_in_flight == 0


def test_a_push_replaces_the_list_and_welcomes_new_urls() -> None:
    pool = Pool([A, B])
    pool.replace([C, D, C])
    assert pool.serving == (C, D)
    assert pool.drop(C) and not pool.drop(C)
    assert pool.serving == (D,)
    pool.replace([A, B, C, D])
    assert pool.serving == (A, B, C, D)


def test_outcomes_are_tallied_per_backend_and_handed_over_once() -> None:
    pool = Pool([A, B])
    for outcome in "FFSFF":
        (pool.record_failure if outcome == "F" else pool.record_success)(A)
    pool.record_success(B)
    assert pool.drain_outcomes() == {A: (1, 4, 2), B: (1, 0, 0)}
    assert pool.drain_outcomes() == {}


def test_the_retry_budget_is_a_share_of_the_requests_in_flight_with_a_floor() -> None:
    budget = RetryBudget(ratio=0.2, minimum=3)
    budget.requests_in_flight = 10
    assert [budget.try_acquire() for _ in range(4)] == [True, True, True, False]
    budget.requests_in_flight = 100
    assert sum(budget.try_acquire() for _ in range(30)) == 20 - 3
    budget.release()
    assert budget.try_acquire() and not budget.try_acquire()


def test_a_session_stays_on_its_home_while_it_is_not_overloaded() -> None:
    pool = Pool([A, B, C], affinity_load_factor=1.25)
    home = pool.pick(session="rollout-1")
    assert all(pool.pick(session="rollout-1") == home for _ in range(10))
    sessions = Counter(pool.pick(session=f"rollout-{i}") for i in range(3000))
    assert set(sessions) == {A, B, C}
    assert min(sessions.values()) > 600  # spread over the fleet, within a few tens of per cent


def test_an_overloaded_home_falls_back_to_the_least_loaded_backend() -> None:
    pool = Pool([A, B, C], affinity_load_factor=1.25)
    home = pool.pick(session="s")
    assert home is not None
    for _ in range(4):
        pool.dispatched(home)
    # average 4/3: the bound is ceil(1.25 * 5 / 3) = 3, and home holds 4
    other = pool.pick(session="s")
    assert other != home and other is not None
    assert pool.pick(session="s", exclude=[home]) != home


def test_a_fleet_change_moves_only_the_sessions_of_the_backend_that_left() -> None:
    before = SessionRing([A, B, C, D], virtual_nodes=64)
    after = SessionRing([A, B, C], virtual_nodes=64)
    for i in range(2000):
        s = f"session-{i}"
        if before.home(s) != D:
            assert after.home(s) == before.home(s)
        else:
            assert after.home(s) in (A, B, C)
    # and every router process agrees (no per-process hash salt)
    assert SessionRing([A, B, C], virtual_nodes=64).home("x") == after.home("x")


def test_settings_refuse_504_and_name_the_field() -> None:
    with pytest.raises(ValueError, match="status_when_none_left"):
        RouterSettings(status_when_none_left=504)
    with pytest.raises(ValueError, match="retry_budget_ratio"):
        RouterSettings(retry_budget_ratio=1.5)
    with pytest.raises(ValueError, match="backend_timeout_s"):
        RouterSettings(backend_timeout_s=0)
    assert RouterSettings().backend_timeout_s == 600.0


operations = st.lists(
    st.tuples(st.sampled_from(["dispatch", "finish", "push", "drop", "pick"]),
              st.lists(st.sampled_from([A, B, C, D]), max_size=4)),
    max_size=80)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_in_flight_counts_stay_exact_under_any_sequence_of_pushes(ops: list) -> None:
    pool = Pool([A, B])
    outstanding: Counter[str] = Counter()
    for op, urls in ops:
        if op == "dispatch":
            picked = pool.pick(exclude=urls[:1])
            if picked is not None:
                assert picked in pool.serving and picked not in urls[:1]
                pool.dispatched(picked)
                outstanding[picked] += 1
        elif op == "finish":
            done = next((u for u in urls if outstanding[u] > 0), None)
            if done is not None:
                pool.finished(done)
                outstanding[done] -= 1
        elif op == "push":
            pool.replace(urls)
        elif op == "drop" and urls:
            pool.drop(urls[0])
        else:
            assert pool.pick() is None or pool.pick() in pool.serving
        in_flight = pool.in_flight()
        assert {u: n for u, n in in_flight.items() if n} == {u: n for u, n in
                                                            outstanding.items() if n}
        assert set(pool.serving) <= set(in_flight)
        assert pool.total_in_flight == sum(outstanding.values())


def test_a_push_keeps_the_facts_of_the_backends_it_serves_and_a_drop_keeps_the_rest() -> None:
    from fleetwarden.router.pool import UNKNOWN_FACTS, BackendFacts

    pool = Pool(["http://a", "http://b"])
    assert pool.facts("http://a") == UNKNOWN_FACTS
    pool.replace(["http://a/", "http://b"], {"http://a": BackendFacts(0, 2),
                                            "http://b/": BackendFacts(1, 3),
                                            "http://c": BackendFacts(2, 3)})
    assert pool.all_facts() == {"http://a": BackendFacts(0, 2), "http://b": BackendFacts(1, 3)}
    pool.drop("http://a")
    assert pool.all_facts() == {"http://b": BackendFacts(1, 3)}
    pool.replace(["http://a", "http://b"])  # an older controller's push: no facts
    assert pool.all_facts() == {} and pool.facts("http://b") == UNKNOWN_FACTS


def test_a_backend_on_trial_takes_a_second_request_only_when_nothing_else_is_left() -> None:
    pool = Pool([A, B])
    pool.set_trial([B])
    pool.dispatched(A)
    pool.dispatched(A)
    assert pool.pick() == B  # on trial, and free: it may take its one request
    pool.dispatched(B)
    assert [pool.pick() for _ in range(5)] == [A] * 5  # its trial is in flight: nobody else
    assert pool.pick(exclude=[A]) == B  # ...unless nothing else is left: sent beats refused
    pool.finished(B)
    pool.set_trial([])
    pool.dispatched(B)
    pool.dispatched(B)
    pool.dispatched(B)
    assert pool.pick() == A
    pool.finished(A)
    pool.finished(A)
    assert pool.pick() == A  # least loaded again, no longer limited


def test_a_reflex_drop_is_undone_with_its_facts_until_the_next_push() -> None:
    pool = Pool(["http://a", "http://b"])
    pool.replace(["http://a", "http://b"], {"http://a": BackendFacts(0, 3)})
    assert pool.drop("http://a") and pool.serving == ("http://b",)
    assert pool.undrop("http://a") and set(pool.serving) == {"http://a", "http://b"}
    assert pool.facts("http://a") == BackendFacts(0, 3)
    assert not pool.undrop("http://a")  # back already
    pool.drop("http://a")
    pool.replace(["http://b"])  # a push since: it says what serves, the reflex stands
    assert not pool.undrop("http://a") and pool.serving == ("http://b",)


@settings(max_examples=300, deadline=None)
@given(loads=st.lists(st.integers(0, 3), min_size=1, max_size=40),
       excluded=st.sets(st.integers(0, 39), max_size=10), requests=st.integers(1, 5))
def test_a_pick_that_stops_at_an_idle_backend_is_the_full_scans_answer(
        loads: list[int], excluded: set[int], requests: int) -> None:
    """The scan stops at the first idle backend in rotating order (none has fewer): on a big
    fleet most picks end early, and every one is still the answer of the scan to the end."""
    urls = [f"http://10.1.{i // 250}.{i % 250}:8000" for i in range(len(loads))]
    pool = Pool(urls)
    for url, load in zip(urls, loads, strict=True):
        for _ in range(load):
            pool.dispatched(url)
    exclude = {urls[i] for i in excluded if i < len(urls)}
    for _ in range(requests):
        n = len(urls)
        turn = (pool._turn + 1) % n if not exclude else pool._turn % n
        order = [urls[(turn + k) % n] for k in range(n)]
        allowed = [u for u in order if u not in exclude]
        expected = min(allowed, key=lambda u: (pool.in_flight().get(u, 0), allowed.index(u)),
                       default=None)
        assert pool.pick(exclude) == expected


def test_the_routers_pick_cost_is_on_its_metrics() -> None:
    from prometheus_client import generate_latest

    from fleetwarden.router.stats import RouterStats, make_registry

    stats = RouterStats()
    stats.picked(0.00002)
    stats.picked(0.00004)
    text = generate_latest(make_registry(stats, Pool([A]), worker=3)).decode()
    assert 'fleetwarden_router_pick_seconds_count{worker="3"} 2.0' in text
    total = [line for line in text.splitlines()
             if line.startswith("fleetwarden_router_pick_seconds_sum")]
    assert total and float(total[0].split()[1]) == pytest.approx(6e-05)


# ---------------------------------------------------------------------- poison


@pytest.mark.parametrize(("routable", "max_retries", "quorum"), [
    (4, 2, 3),  # every try it may have: a third engine may still answer
    (2, 2, 2),  # every engine there is
    (9, 0, 2),  # no retry: never read as poison on one engine's word
    (1, 2, 2),  # one engine: never read as poison
])
def test_a_request_is_poison_only_on_the_same_5xx_from_every_engine_it_may_try(
        routable: int, max_retries: int, quorum: int) -> None:
    assert poison_quorum(routable, max_retries) == quorum


def test_a_request_that_failed_everywhere_blames_no_engine_that_repeated_its_5xx() -> None:
    held = [("a", 500), ("b", 503), ("c", 500)]
    assert blamed_5xx(held, answered=True, untried=0) == ["a", "b", "c"]  # another answered
    assert blamed_5xx(held, answered=False, untried=0) == ["b"]  # 500 twice: the request's?
    assert blamed_5xx([("a", 500), ("c", 500)], answered=False, untried=1) == []
    assert blamed_5xx([("a", 500), ("b", 503)], answered=False, untried=0) == ["a", "b"]
    # one engine's 5xx: its own when its tries ran out with others left to ask, but never
    # the only engine the request could reach (nothing proves it, and it is the last one)
    assert blamed_5xx([("a", 500)], answered=False, untried=2) == ["a"]
    assert blamed_5xx([("a", 500)], answered=False, untried=0) == []
    assert blamed_5xx([], answered=False, untried=0) == []
