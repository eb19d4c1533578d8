"""The cache-aware policy (router/affinity.py): prefix matches, the load guard, RL groups,
session hints, and entries that die with their engine's cache."""

from __future__ import annotations

import os
import random

import pytest

from fleetwarden.router.affinity import (
    Affinity,
    AffinitySettings,
    Query,
    load_bound,
    query_of,
    within_guard,
)
from fleetwarden.router.pool import Pool

A, B, C, D = (f"http://e{i}" for i in range(4))
FLEET = [A, B, C, D]
SYSTEM = "You are a careful assistant. " * 20  # ~580 characters shared by every request


def chat(*turns: str, system: str = SYSTEM) -> Query:
    body = {"messages": [{"role": "system", "content": system},
                         *({"role": "user", "content": t} for t in turns)]}
    query = query_of(body, None, AffinitySettings())
    assert query is not None
    return query


def talk(*turns: str, session: str | None = None) -> Query:
    """A conversation without a system prompt."""
    query = query_of({"messages": [{"role": "user", "content": t} for t in turns]}, session,
                     AffinitySettings())
    assert query is not None
    return query


def place(affinity: Affinity, pool: Pool, query: Query, now: float) -> str:
    """As the forwarding shell does: the pool asks the policy, then the choice is recorded."""
    chosen = pool.pick(prefer=lambda left, loads: affinity.choose(query, left, loads, now))
    assert chosen is not None
    affinity.placed(query, chosen, now)
    return chosen


def test_query_of_reads_chats_prompts_token_ids_and_session_keys() -> None:
    s = AffinitySettings()
    assert query_of("not a dict", None, s) is None
    assert query_of({"model": "m"}, None, s) is None
    text = query_of({"prompt": "x" * 130}, None, s)
    assert text is not None and len(text.keys) == 3  # 64 + 64 + a partial block
    ids = query_of({"prompt": list(range(40))}, None, s)
    assert ids is not None and len(ids.keys) == 3  # 16 + 16 + 8 token ids
    same = query_of({"prompt": ["x" * 130]}, None, s)
    assert same is not None and same.keys == text.keys
    keyed = query_of({"prompt": "x", "prompt_cache_key": "k", "user": "u", "n": 4}, None, s)
    assert keyed is not None and (keyed.session, keyed.n) == ("prompt_cache_key:k", 4)
    user = query_of({"prompt": "x", "user": "u"}, None, s)
    assert user is not None and user.session is None  # user is no session unless configured
    user = query_of({"prompt": "x", "user": "u"}, None, s, user_is_session=True)
    assert user is not None and user.session == "user:u"
    header = query_of({"prompt": "x", "prompt_cache_key": "k"}, "h", s)
    assert header is not None and header.session == "h"  # the header wins
    # Equal conversations share their leading keys; the new turn adds its own.
    one, two = chat("hello"), chat("hello", "more")
    assert two.keys[:len(one.keys) - 1] == one.keys[:-1]


def test_an_rl_group_stays_on_one_engine_up_to_its_share_then_takes_the_next() -> None:
    affinity = Affinity(AffinitySettings(group_per_engine=8))
    pool = Pool(FLEET)
    prompt = Query(query_of({"prompt": SYSTEM + "solve 17 * 23"}, None,
                            AffinitySettings()).keys)  # type: ignore[union-attr]
    placed = []
    for _ in range(12):  # siblings arriving together: each stays in flight
        url = place(affinity, pool, prompt, 0.0)
        pool.dispatched(url)
        placed.append(url)
    assert placed[:8] == [placed[0]] * 8  # past the load guard, up to the share
    assert len(set(placed[8:])) == 1 and placed[8] != placed[0]  # the next share, together
    # n > 1 in one request counts as that many siblings.
    affinity = Affinity(AffinitySettings(group_per_engine=8))
    pool = Pool(FLEET)
    many = Query(prompt.keys, None, 6)
    first = place(affinity, pool, many, 0.0)
    pool.dispatched(first)
    assert place(affinity, pool, many, 0.1) != first  # 6 + 6 > 8: the next engine


def test_a_conversation_returns_to_the_engine_holding_its_turns() -> None:
    affinity = Affinity()
    pool = Pool(FLEET)
    homes = {}
    for turn in range(5):  # eight agents, each turn of all eight in flight together
        sent = []
        for session in range(8):
            turns = [f"user {session} asks", *(f"turn {k}" for k in range(turn))]
            url = place(affinity, pool, chat(*turns), float(turn))
            assert homes.setdefault(session, url) == url
            pool.dispatched(url)
            sent.append(url)
        for url in sent:
            pool.finished(url)
    # First turns spread: the shared system prompt took no engine beyond the guard's slack.
    assert max(list(homes.values()).count(u) for u in FLEET) <= AffinitySettings().balance_abs


def test_a_shared_system_prompt_never_piles_every_session_on_one_engine() -> None:
    """sglang-router's failure: the shared prefix matches above the threshold on one engine
    and its guard (64 apart) never fires. Here the guard spills, and the others then hold
    the shared prefix too."""
    affinity = Affinity()
    pool = Pool(FLEET)
    counts = dict.fromkeys(FLEET, 0)
    for session in range(24):  # 24 agents start together: each stays in flight
        url = place(affinity, pool, chat(f"agent {session}: task"), 0.0)
        pool.dispatched(url)
        counts[url] += 1
    assert max(counts.values()) <= 1.5 * 24 / 4, counts


def test_the_load_guard_bounds_a_hot_prefix_whatever_the_arrivals() -> None:
    """The thrash spiral of consistent hashing, over random fleets of 2 to 8 engines: one hot
    prefix (and a shared system prompt under every conversation) must never take an engine
    past the guard: at most balance_abs over the mean, balance_rel times it under load, and
    balance_abs in all while another engine idles. Random arrivals and completions; replay a
    failure with FLEETWARDEN_AFFINITY_SEED."""
    seed = int(os.environ.get("FLEETWARDEN_AFFINITY_SEED", random.randrange(2**32)))
    print(f"seed {seed} (FLEETWARDEN_AFFINITY_SEED={seed} replays it)")
    rng = random.Random(seed)
    for trial in range(20):
        fleet = [f"http://e{i}" for i in range(rng.randint(2, 8))]
        s = AffinitySettings(balance_abs=rng.randint(1, 8), balance_rel=rng.uniform(1.0, 2.0),
                             group_window_s=0.001)
        affinity = Affinity(s)
        pool = Pool(fleet)
        running: list[str] = []
        hot = [chat("the hot prompt"), chat("the warm prompt"),
               *(chat(f"cold {k}", "and its next turn") for k in range(5))]
        busy = rng.uniform(0.3, 0.7)  # how often a step is an arrival: quiet to saturated
        for step in range(400):
            if running and rng.random() > busy:
                pool.finished(running.pop(rng.randrange(len(running))))
                continue
            # Mostly the hot prompt, at random times: its engine is the only holder at first.
            query = hot[0] if rng.random() < 0.7 else rng.choice(hot[1:])
            loads = pool.in_flight()
            url = place(affinity, pool, query, step * 0.01)
            counts = [loads[u] for u in fleet]
            mean = (sum(counts) + 1) / len(fleet)
            # (No RL group bypasses the guard here: arrivals are further apart than its window.)
            assert loads[url] + 1 <= max(mean + s.balance_abs, s.balance_rel * mean), (
                seed, trial, step, loads, url)
            assert min(counts) > 0 or loads[url] < s.balance_abs, (seed, trial, step, loads, url)
            pool.dispatched(url)
            running.append(url)


def test_the_guard_is_measured_from_the_mean_and_never_leaves_no_choice() -> None:
    assert load_bound([0, 0], 4, 1.5) == 4  # a quiet pair: 4 on one while the other idles
    assert load_bound([3, 0], 4, 1.5) == 4
    assert load_bound([3, 1], 4, 1.5) == 2.5 + 4  # mean 2.5 with the new request
    assert load_bound([40, 40, 30, 9], 4, 1.5) == pytest.approx(1.5 * 120 / 4)  # under load
    seed = int(os.environ.get("FLEETWARDEN_AFFINITY_SEED", random.randrange(2**32)))
    print(f"seed {seed} (FLEETWARDEN_AFFINITY_SEED={seed} replays it)")
    rng = random.Random(seed)
    for _ in range(500):
        fleet = [f"http://e{i}" for i in range(rng.randint(1, 16))]
        loads = {u: rng.choice([0, rng.randint(0, 4), rng.randint(0, 200)]) for u in fleet}
        allowed = within_guard(fleet, loads, rng.randint(1, 64), rng.uniform(1.0, 3.0))
        least = min(loads.values())
        assert all(u in allowed for u in fleet if loads[u] == least), (seed, loads)


def test_a_quiet_pair_of_engines_shares_conversations_that_share_a_system_prompt() -> None:
    """Eight conversations over a shared system prompt on two engines, each staying in flight:
    a slack of 8 over the least loaded engine put all eight on one engine."""
    affinity = Affinity()
    pool = Pool([A, B])
    counts = dict.fromkeys([A, B], 0)
    for session in range(8):
        url = place(affinity, pool, chat(f"agent {session}: task"), 0.0)
        pool.dispatched(url)
        counts[url] += 1
    assert sorted(counts.values()) == [4, 4], counts


def test_an_idle_engine_takes_a_shared_prefix_before_its_holders_pass_the_slack() -> None:
    """Three engines hold the shared system prompt and serve within their share of the load;
    the fourth holds nothing and idles. A new conversation goes to the idle one (which then
    holds the prompt too), not to a fourth request on a holder."""
    affinity = Affinity()
    assert affinity.settings.balance_abs == 4  # the default slack
    pool = Pool(FLEET)
    for url in (A, B, C):
        affinity.placed(chat("an earlier agent"), url, 0.0)
        for _ in range(4):  # a third of 13 in flight: under the mean's bound, 3.25 + 4
            pool.dispatched(url)
    assert place(affinity, pool, chat("a new agent"), 1.0) == D
    pool.dispatched(D)
    # Now D holds the prompt too: the next new conversation is a tie, to the least loaded.
    assert place(affinity, pool, chat("another agent"), 1.0) == D


def test_a_new_session_takes_an_idle_engine_before_a_busy_holder_of_its_prefix() -> None:
    """The cold start of a burst of conversations sharing a system prompt: a new session on a
    busy holder waits out that engine's prefills (bench/cache_model.py: the first turns were
    the whole TTFT tail). An idle engine takes it, the one holding the most of its prompt
    first; a session already at home stays there, and a request with no session is matched
    as before."""
    affinity = Affinity()
    pool = Pool([A, B, C])
    affinity.placed(Query(chat("agent 1: task").keys, "agent-1"), A, 0.0)
    pool.dispatched(A)  # agent 1's first turn is in flight on A, the only holder
    assert place(affinity, pool, Query(chat("agent 2: task").keys, "agent-2"), 0.1) in (B, C)
    pool.dispatched(B)  # (wherever it went, B is busy now)
    affinity.placed(Query(chat("agent 3: task").keys, "agent-3"), C, 0.1)  # C holds it, idle
    pool2 = Pool([A, B, C, D])
    pool2.dispatched(A)
    pool2.dispatched(B)
    # C and D idle: C holds the prompt, D nothing; the deeper match wins.
    assert place(affinity, pool2, Query(chat("agent 4: task").keys, "agent-4"), 0.2) == C
    # Agent 1's next turn: its home A is busy and D idles, but its history is on A.
    nxt = Query(chat("agent 1: task", "agent 1: more").keys, "agent-1")
    pool3 = Pool([A, D])
    pool3.dispatched(A)
    assert place(affinity, pool3, nxt, 0.3) == A
    # Without a session the prefix's holder is taken, as before (within the guard).
    assert place(affinity, pool3, chat("agent 5: task"), 0.3) == A
    # Agent 1's id reused for a new conversation: A holds only the shared prompt of it, so
    # it is no home (a bench that reuses its session ids from one workload to the next).
    assert place(affinity, pool3, Query(chat("a new task").keys, "agent-1"), 0.4) == D


def test_a_conversation_at_home_is_bounded_by_the_mean_not_by_an_idle_engine() -> None:
    """A session's fifth request in flight on its home while another engine idles: moved by
    the idle clause, it would prefill its whole history there (bench/cache_model.py: every
    move of a conversation was this, 50-80 ms against 13 at home). It stays, up to the mean's
    bound; past that bound it moves as before."""
    affinity = Affinity()
    pool = Pool([A, B])
    history = [f"agent 1 turn {t}: " + "tool output " * 20 for t in range(4)]
    affinity.placed(Query(talk(*history).keys, "agent-1"), A, 0.0)
    for _ in range(4):  # four in flight on A (balance_abs), none on B
        pool.dispatched(A)
    nxt = Query(talk(*history, "agent 1 turn 4").keys, "agent-1")
    assert place(affinity, pool, nxt, 1.0) == A
    # A request with no session and the same history: the idle clause holds it off A.
    assert place(affinity, pool, talk(*history, "another turn 4"), 1.0) == B
    # The same session id with a new conversation over the same first turn: A holds only
    # part of it, so the idle clause holds it off A like anyone's.
    assert place(affinity, pool, Query(talk(history[0], "a new turn").keys, "agent-1"),
                 1.0) == B
    for _ in range(5):  # nine on A, one on B: the mean with it is 5.5, A would be 10 > 9.5
        pool.dispatched(A)
    pool.dispatched(B)
    assert place(affinity, pool, nxt, 3.0) == B  # (3.0: past the RL-group window of the last)


def test_a_restart_a_refit_or_leaving_forgets_the_engines_prefixes() -> None:
    affinity = Affinity()
    q = chat("remember me")
    for url in FLEET:
        affinity.placed(q, url, 0.0)
    assert set(affinity.matched(q, 0.0)) == set(FLEET)
    epochs = {A: ("p1", 1), B: ("p1", 1), C: ("p1", 1), D: (None, None)}
    assert affinity.sync(FLEET, epochs) == []  # the first push only learns the epochs
    assert sorted(affinity.sync(FLEET, {**epochs, A: ("p2", 1), B: ("p1", 2)})) == [A, B]
    assert set(affinity.matched(q, 0.0)) == {C, D}  # restarted A, refit B: caches gone
    later = {**epochs, A: ("p2", 1), B: ("p1", 2)}
    del later[C]
    assert affinity.sync([A, B, D], later) == [C]  # C slept, was condemned or retired
    assert set(affinity.matched(q, 0.0)) == {D}  # D's epoch is unknown: kept while it serves
    assert affinity.forgotten == 3 * len(q.keys)


def test_the_choice_avoids_a_forgotten_engine_and_goes_where_the_prefix_is() -> None:
    affinity = Affinity()
    pool = Pool([A, B])
    q = chat("a long conversation")
    affinity.placed(q, A, 0.0)
    affinity.placed(q, B, 0.0)
    affinity.sync([A, B], {A: ("p1", 1), B: ("p1", 1)})
    affinity.sync([A, B], {A: ("p2", 1), B: ("p1", 1)})  # A restarted
    pool.dispatched(B)  # B is busier, yet it holds the prefix
    assert place(affinity, pool, Query(chat("a long conversation", "next").keys), 1.0) == B


def test_entries_expire_after_the_ttl_and_the_index_is_bounded() -> None:
    affinity = Affinity(AffinitySettings(ttl_s=10.0, max_blocks=50))
    q = chat("x")
    affinity.placed(q, A, 0.0)
    assert affinity.matched(q, 10.0) == {A: len(q.keys)}
    assert affinity.matched(q, 10.5) == {}
    for k in range(100):
        affinity.placed(chat(f"other {k}", system=f"{k}"), B, 1.0)
    assert affinity.size == 50


def test_predicted_hits_are_tallied_per_engine() -> None:
    affinity = Affinity()
    q = chat("once")
    affinity.placed(q, A, 0.0)
    affinity.placed(q, A, 0.0)
    tally = affinity.predicted()[A]
    assert (tally.requests, tally.blocks, tally.hit_blocks) == (2, 2 * len(q.keys), len(q.keys))
    assert tally.hit_rate == pytest.approx(0.5)


def test_a_prompt_is_looked_up_once_a_request_and_a_forget_in_between_counts() -> None:
    """placed() tallies the matches choose() found for the same request (one lookup a request),
    unless the index changed in between: a restart forgotten between the pick and the record
    is no predicted hit."""
    affinity = Affinity()
    q = chat("a task")
    affinity.placed(q, A, 0.0)
    lookups = []
    real = affinity.matched

    def counted(query: Query, now: float) -> dict[str, int]:
        lookups.append(query)
        return real(query, now)

    affinity.matched = counted  # type: ignore[method-assign]
    # (Seconds apart: within the RL-group window the sibling rule answers before any lookup.)
    assert affinity.choose(q, [A, B], {}, 5.0) == A
    affinity.placed(q, A, 5.0)
    assert len(lookups) == 1
    assert affinity.predicted()[A].hit_blocks == len(q.keys)
    assert affinity.choose(q, [A, B], {}, 10.0) == A
    assert len(lookups) == 2
    affinity.sync([A, B], {A: ("second", None), B: (None, None)})  # first push: both known
    affinity.sync([A, B], {A: ("third", None), B: (None, None)})  # A restarted
    affinity.placed(q, A, 10.0)
    assert affinity.predicted()[A].hit_blocks == len(q.keys)  # nothing more predicted


def test_a_continued_stream_makes_its_new_engine_the_holder() -> None:
    affinity = Affinity()
    q = Query(chat("a long generation").keys, "s1")
    affinity.placed(q, A, 0.0)
    affinity.forget(A)  # its engine died mid-stream
    affinity.moved(q, B, 1.0)  # the router continued the stream on B, which prefilled it
    assert affinity.matched(q, 1.0) == {B: len(q.keys)}
    pool = Pool([A, B])
    pool.dispatched(B)
    assert place(affinity, pool, Query(chat("a long generation", "next").keys, "s1"), 2.0) == B


def test_new_sessions_spread_evenly_not_by_the_session_hash() -> None:
    """Sessions with a header and a prompt nobody holds: placed by load (ties to the smallest
    index), never by the pool's hash ring, whose 24 sessions on four engines land unevenly;
    then each stays where its conversation is."""
    affinity = Affinity()
    pool = Pool(FLEET)
    for turn in range(3):  # in lockstep: every session's turn in flight together
        sent = []
        for session in range(24):
            turns = [f"agent {session} asks", *(f"turn {k}" for k in range(turn))]
            q = talk(*turns, session=f"agent-{session}")
            url = pool.pick(session=q.session,
                            prefer=lambda left, loads, q=q: affinity.choose(q, left, loads, 0.0))
            assert url is not None
            affinity.placed(q, url, 0.0)
            pool.dispatched(url)
            sent.append(url)
        assert sorted(sent.count(u) for u in FLEET) == [6, 6, 6, 6], (turn, sent)
        for url in sent:
            pool.finished(url)


def test_a_session_hint_whose_home_holds_none_of_the_prompt_is_not_followed() -> None:
    affinity = Affinity()
    pool = Pool([A, B])
    affinity.placed(Query(chat("an earlier conversation").keys, "s1"), A, 0.0)
    pool.dispatched(A)
    # The same session, a prompt A holds nothing of: the less loaded engine, not the home.
    assert place(affinity, pool, Query(talk("something else").keys, "s1"), 1.0) == B
    # A prompt its home holds part of (below the threshold): the hint still counts.
    long_turn = "a new question " * 200
    q = Query(chat("an earlier conversation", long_turn).keys, "s1")
    assert max(affinity.matched(q, 1.0).values()) / len(q.keys) <= AffinitySettings().threshold
    affinity.placed(Query(chat("an earlier conversation").keys, "s1"), A, 1.0)
    assert place(affinity, pool, q, 1.0) == A


def test_after_a_restart_prompts_nobody_holds_refill_the_restarted_engine() -> None:
    affinity = Affinity()
    pool = Pool([A, B])
    held_by_b = talk("B's conversation")
    affinity.placed(talk("A's conversation"), A, 0.0)
    affinity.placed(held_by_b, B, 0.0)
    affinity.sync([A, B], {A: ("p1", 1), B: ("p1", 1)})
    affinity.sync([A, B], {A: ("p2", 1), B: ("p1", 1)})  # A restarted: its cache went
    assert affinity.held_blocks() == {B: len(held_by_b.keys)}
    # Equal loads: the prompt nobody holds goes to the engine with the emptier index ...
    assert place(affinity, pool, talk("A's conversation", "next"), 1.0) == A
    # ... and the one B holds, to B.
    assert place(affinity, pool, talk("B's conversation", "next"), 1.0) == B


def test_the_index_counts_per_backend_follow_every_change() -> None:
    """held_blocks() is kept as entries come and go (placed, moved, forgotten, evicted past
    max_blocks): after random changes it equals a recount of the index. Replay a failure with
    FLEETWARDEN_AFFINITY_SEED."""
    seed = int(os.environ.get("FLEETWARDEN_AFFINITY_SEED", random.randrange(2**32)))
    print(f"seed {seed} (FLEETWARDEN_AFFINITY_SEED={seed} replays it)")
    rng = random.Random(seed)
    affinity = Affinity(AffinitySettings(max_blocks=40))
    queries = [chat(*(f"turn {k}" for k in range(rng.randint(1, 4))), system=f"s{j % 3}")
               for j in range(12)]
    for step in range(600):
        roll = rng.random()
        url = rng.choice(FLEET)
        if roll < 0.05:
            affinity.forget(url)
        elif roll < 0.15:
            affinity.moved(rng.choice(queries), url, float(step))
        else:
            affinity.placed(rng.choice(queries), url, float(step))
        recount: dict[str, int] = {}
        for holders in affinity._index.values():
            for u in holders:
                recount[u] = recount.get(u, 0) + 1
        assert affinity.held_blocks() == recount, (seed, step)
