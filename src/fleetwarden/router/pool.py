"""The backends a router may use, what is in flight on each, and what happened to its requests.

Owns: the backends, their in-flight counts, picking one, and the outcome tallies.
Must not: do I/O, await or read a clock (pure).

The functional core of the router: no I/O, no asyncio, no clock. The forwarding shell
(:mod:`fleetwarden.router.forward`) asks this module where to send a request and tells it how
each attempt ended; the controller reads the tallies out with :meth:`Pool.drain_outcomes`.

Two rules, after Envoy's outlier detection:

* The pool never decides health. Its serving list is whatever was last pushed
  (:meth:`Pool.replace`); the only local change is the reflex drop (:meth:`Pool.drop`), which the
  shell makes only when fleet health drives membership. The ledger keeps a dropped backend out
  of the next pushes until it proves itself, then pushes it *on trial* (:meth:`Pool.set_trial`):
  it gets one request at a time until the ledger lifts the probation.
* It counts; the ledger judges. A tally is handed over once and zeroed
  (:meth:`Pool.drain_outcomes`), so no failure is ever reported twice.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from fleetwarden.router.models import ModelCard

__all__ = ["UNKNOWN_FACTS", "BackendFacts", "OutcomeTally", "Pool", "Prefer", "RetryBudget",
           "SessionRing", "blamed_5xx", "poison_quorum"]


#: A placement policy's say in :meth:`Pool.pick`: given the backends left and the in-flight
#: counts, the one it prefers, or ``None`` to leave the choice to the pool.
Prefer = Callable[[Sequence[str], Mapping[str, int]], "str | None"]


class CompletionDefault(enum.Enum):
    """What an engine gives a completion that names no ``max_tokens``, which a continuation of
    one must keep (docs/design.md 4.1; per engine, with its source: docs/engines.md). Values:
    the controller's push's words (its engine profile's ``completion_default``)."""

    FIXED = "fixed"  # 16 (continuation.COMPLETION_DEFAULT_MAX_TOKENS): vLLM, SGLang
    ENGINE = "engine"  # its default limit, else the context left, as a chat (llama.cpp, TGI)
    UNKNOWN = "unknown"  # an engine of no known kind: such a completion, cut, ends


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """What the controller's push says of one backend, beside its URL: the shard it is and the
    weight version it holds (the ledger's). ``None``: the push did not say (an older
    controller, or a router whose membership nobody manages)."""

    shard: int | None = None
    weight_version: int | None = None
    _: KW_ONLY  # the rest by name: two optional facts of different meaning must not be swapped
    #: Its engine takes vLLM's own request fields (``return_token_ids``, a prompt of token
    #: ids, ``continue_final_message``): its profile's word. ``None``: the push did not say
    #: (the router's ``upstream_fields`` setting decides).
    upstream_fields: bool | None = None
    #: The engine process's identity as the ledger knows it: a new one means a restart, and
    #: an empty KV cache (the cache-aware policy forgets what it placed there).
    incarnation: str | None = None
    #: The models its engine serves (its ``/v1/models``, as the watchdog read it): what the
    #: router's own ``GET /v1/models`` lists. ``None``: not read yet, or the push did not say.
    models: tuple[ModelCard, ...] | None = None
    #: The API key its engine wants (``--api-key``), for the router's own requests there: a
    #: stream's continuation and its read of ``/v1/models``. Never in a repr or in
    #: :meth:`to_dict` (the router's status, the push's answer): pushed apart, as ``keys``.
    key: str | None = field(default=None, repr=False)
    #: The engine's server cap on every request's output (vLLM's ``--override-generation-config
    #: '{"max_new_tokens": N}'``), read from the command that started it: no endpoint tells it,
    #: and a continuation must not ask past it (docs/design.md 4.1). ``None``: not known.
    output_cap: int | None = None
    #: The engine's default limit of a request that names none (a chat's): vLLM's
    #: ``max_tokens`` of its ``default_sampling_params``, the model's ``generation_config.json``
    #: ``max_new_tokens``, read where the controller can read that file. A default, not a
    #: cap: a request that names a limit is not held to it (docs/design.md 4.1). ``None``:
    #: none, or not known.
    output_default: int | None = None
    #: Why the engine's server cap is not known: an attached engine that shows none (no
    #: vLLM dev mode) and declares none (docs/design.md 4.1). A continuation begun there, or
    #: sent there, goes only as far as its finishes proved, until a ``"length"`` finish
    #: reveals the cap. ``None``: known (``output_cap``, ``None`` there meaning none), or the
    #: push did not say.
    output_cap_unknown: str | None = None
    #: Why its default limit of a chat that names none is not known (its model's generation
    #: config not readable here, nothing declared): such a chat begun there is continued only
    #: as far as its finishes proved. ``None``: known (``output_default``), or not said.
    output_default_unknown: str | None = None
    #: What its engine gives a completion that names no ``max_tokens``: vLLM's 16, or its
    #: default as a chat's, or not known (its kind is not: such a completion, cut, ends):
    #: its profile's word (docs/design.md 4.1). ``None``: the push did not say (its
    #: ``upstream_fields``, else the router's setting, decides: vLLM's fields, vLLM's 16).
    completion_default: CompletionDefault | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "shard": self.shard, "weight_version": self.weight_version,
            "upstream_fields": self.upstream_fields}
        # an older router reads only the three above
        if self.incarnation is not None:
            out["incarnation"] = self.incarnation
        if self.models is not None:
            out["models"] = [card.to_dict() for card in self.models]
        if self.output_cap is not None:
            out["output_cap"] = self.output_cap
        if self.output_default is not None:
            out["output_default"] = self.output_default
        if self.output_cap_unknown is not None:
            out["output_cap_unknown"] = self.output_cap_unknown
        if self.output_default_unknown is not None:
            out["output_default_unknown"] = self.output_default_unknown
        if self.completion_default is not None:
            out["completion_default"] = self.completion_default.value
        return out


#: The facts of a backend the push said nothing about.
UNKNOWN_FACTS = BackendFacts()


@dataclass(slots=True)
class OutcomeTally:
    """One backend's requests since the last drain: a router window (docs/design.md 3.3)."""

    successes: int = 0
    failures: int = 0
    #: Failures since the last success in this window: did the window end failing?
    trailing_failures: int = 0

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.successes, self.failures, self.trailing_failures)


class RetryBudget:
    """Envoy's retry budget: paid retries in flight at most ``ratio`` of the requests in flight.

    A paid retry is the re-send of a request an engine may have worked on; a request holds its
    token from its first paid retry until it is answered. Free re-sends (the request never
    reached an engine) and rescues (the controller condemned the backend) take no token.
    """

    __slots__ = ("minimum", "ratio", "requests_in_flight", "retries_in_flight")

    def __init__(self, ratio: float, minimum: int) -> None:
        self.ratio = ratio
        self.minimum = minimum
        self.requests_in_flight = 0
        self.retries_in_flight = 0

    def limit(self) -> int:
        return max(self.minimum, int(self.ratio * self.requests_in_flight))

    def try_acquire(self) -> bool:
        if self.retries_in_flight >= self.limit():
            return False
        self.retries_in_flight += 1
        return True

    def release(self) -> None:
        self.retries_in_flight -= 1


def _ring_hash(key: str) -> int:
    # A keyed hash that every router process computes alike (``hash()`` is salted per process),
    # so a session lands on the same engine whichever router receives it.
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class SessionRing:
    """A consistent-hash ring over backend URLs: a session's home engine.

    The pool keeps it over the serving backends only. When an engine leaves, its sessions move
    to their next engine on the ring, and no other session moves; when one joins, it takes
    over only the sessions that now land on it.
    """

    __slots__ = ("_points", "_urls")

    def __init__(self, urls: Iterable[str], virtual_nodes: int) -> None:
        points = sorted((_ring_hash(f"{url}#{v}"), url)
                        for url in set(urls) for v in range(virtual_nodes))
        self._points = [p for p, _ in points]
        self._urls = [u for _, u in points]

    def home(self, session: str) -> str | None:
        """The first backend clockwise from the session's point, or ``None`` on an empty ring."""
        if not self._points:
            return None
        i = bisect.bisect_left(self._points, _ring_hash(session))
        return self._urls[i % len(self._urls)]


class Pool:
    """Serving backends, in-flight counts, picking, outcome tallies and the retry budget."""

    def __init__(
        self,
        urls: Iterable[str] = (),
        *,
        retry_budget: RetryBudget | None = None,
        affinity_load_factor: float = 1.25,
        affinity_virtual_nodes: int = 64,
    ) -> None:
        self.retry_budget = retry_budget if retry_budget is not None else RetryBudget(0.2, 3)
        self._load_factor = affinity_load_factor
        self._virtual_nodes = affinity_virtual_nodes
        self._serving: tuple[str, ...] = ()
        #: The last push's facts, per serving backend that it gave facts for.
        self._facts: dict[str, BackendFacts] = {}
        self._ring = SessionRing((), affinity_virtual_nodes)
        #: Requests dispatched and not yet finished, per backend. Holds the serving backends and
        #: any that left the list with requests still on them (they finish where they are).
        self._in_flight: dict[str, int] = {}
        self._total_in_flight = 0
        self._tallies: dict[str, OutcomeTally] = {}
        self._turn = 0
        #: Backends on probation: each takes one request at a time (the trial request).
        self._trial: frozenset[str] = frozenset()
        #: Backends the reflex dropped since the last push, with the facts that push gave them
        #: (:meth:`undrop` puts one back as it was).
        self._dropped: dict[str, BackendFacts | None] = {}
        self.replace(urls)

    # ------------------------------------------------------------------ membership

    @property
    def serving(self) -> tuple[str, ...]:
        return self._serving

    def replace(self, urls: Iterable[str],
                facts: Mapping[str, BackendFacts] | None = None) -> None:
        """Make ``urls`` the whole serving list (a push). New URLs are welcome: a restarted
        engine comes back on a new port. Order is kept, duplicates are dropped.

        ``facts`` (shard index, weight version per URL) replace the last push's whole; a push
        without them leaves every backend's facts unknown, as an older controller's does."""
        serving = tuple(dict.fromkeys(u.rstrip("/") for u in urls))
        given = {u.rstrip("/"): f for u, f in (facts or {}).items()}
        self._facts = {u: given[u] for u in serving if u in given}
        self._dropped = {}  # a push says what serves: no reflex of before it is undone
        if serving == self._serving:
            return
        if set(serving) != set(self._serving):
            self._ring = SessionRing(serving, self._virtual_nodes)
        self._serving = serving
        for url in serving:
            self._in_flight.setdefault(url, 0)
        self._forget_idle_leavers()

    @property
    def trial(self) -> frozenset[str]:
        return self._trial

    def set_trial(self, urls: Iterable[str]) -> None:
        """Backends on probation (pushed by the ledger): at most one request in flight each,
        until the next push says otherwise."""
        self._trial = frozenset(u.rstrip("/") for u in urls)

    def drop(self, url: str) -> bool:
        """The reflex: take ``url`` out of the local list until the next push. True if it was in."""
        if url not in self._serving:
            return False
        dropped = {**self._dropped, url: self._facts.get(url)}
        self.replace((u for u in self._serving if u != url), self._facts)
        self._dropped = dropped
        return True

    def undrop(self, url: str) -> bool:
        """Undo the reflex drop of ``url`` since the last push (the failure that made it was
        the request's, not the backend's: a poison request). True if it was put back."""
        if url not in self._dropped or url in self._serving:
            return False
        dropped = dict(self._dropped)
        facts = dropped.pop(url)
        given = {**self._facts, url: facts} if facts is not None else self._facts
        self.replace([*self._serving, url], given)
        self._dropped = dropped
        return True

    def facts(self, url: str) -> BackendFacts:
        """What the last push said of ``url`` (:data:`UNKNOWN_FACTS` if nothing)."""
        return self._facts.get(url, UNKNOWN_FACTS)

    def all_facts(self) -> dict[str, BackendFacts]:
        """The last push's facts, for the serving backends it gave them for."""
        return dict(self._facts)

    def _forget_idle_leavers(self) -> None:
        # A backend that left the list and has nothing in flight needs no counter any more
        # (restarted engines come back on new ports, so old URLs would pile up otherwise).
        serving = set(self._serving)
        for url in [u for u, n in self._in_flight.items() if n == 0 and u not in serving]:
            del self._in_flight[url]

    # ------------------------------------------------------------------ picking

    def qualifies(self, url: str, min_version: int | None = None,
                  version: int | None = None) -> bool:
        """Whether the last push said ``url`` holds weights of at least ``min_version`` and
        exactly ``version`` (each ``None``: no demand). An unknown version qualifies for no
        demand: nothing proves it."""
        if min_version is None and version is None:
            return True
        held = self.facts(url).weight_version
        if held is None:
            return False
        return (min_version is None or held >= min_version) and (version is None
                                                                 or held == version)

    def pick(self, exclude: Collection[str] = (), session: str | None = None, *,
             min_version: int | None = None, version: int | None = None,
             prefer: Prefer | None = None) -> str | None:
        """The serving backend for the next attempt, or ``None`` if every one is excluded.

        With a ``session``: its home on the ring, unless excluded or loaded beyond
        ``affinity_load_factor`` times the average; otherwise, and without a session, the
        backend with the fewest requests in flight, ties taken in rotating order (the order
        moves on per request, not per retry, so a failing backend is not first for everyone).
        ``min_version`` / ``version``: only backends that :meth:`qualifies` are picked.
        ``prefer``: asked first, with the backends left and the in-flight counts (the
        cache-aware policy, router/affinity.py); its answer, if one of those, is taken.
        """
        serving = self._serving
        n = len(serving)
        if n == 0:
            return None
        retry = bool(exclude)  # backends it failed on, not those the demand rules out
        if min_version is not None or version is not None:
            exclude = set(exclude) | {u for u in serving
                                      if not self.qualifies(u, min_version, version)}
        in_flight = self._in_flight
        if self._trial:
            # A backend on trial that holds its one request is taken by nobody else.
            # When every backend left is a busy trial, the limit yields: a request sent to an
            # engine under probation beats a request refused.
            busy_trials = [u for u in self._trial if in_flight.get(u, 0) > 0]
            if busy_trials:
                limited = {*exclude, *busy_trials}
                if not all(u in limited for u in serving):
                    exclude = limited
        if prefer is not None:
            left = [u for u in serving if u not in exclude]
            chosen = prefer(left, in_flight)
            if chosen is not None and chosen in left:
                return chosen
        if session is not None:
            home = self._ring.home(session)
            if home is not None and home not in exclude:
                bound = math.ceil(self._load_factor * (self._total_in_flight + 1) / n)
                if in_flight[home] < bound:
                    return home
        if retry:
            turn = self._turn % n  # a retry scans on from this request's turn
        else:
            turn = self._turn = (self._turn + 1) % n  # each new request moves the tie-break on
        best: str | None = None
        best_load = -1
        for k in range(n):
            url = serving[(turn + k) % n]
            load = in_flight[url]
            if (best is None or load < best_load) and url not in exclude:
                best, best_load = url, load
                if load == 0:
                    break  # none has fewer: the scan's answer, without the rest of a big fleet
        return best

    def pick_same_weights(self, weight_version: int | None,
                          exclude: Collection[str] = ()) -> str | None:
        """A serving backend holding ``weight_version``, for a generation continued elsewhere
        (an RL rollout must come from one policy); least in flight among them.

        ``None``: the first engine's version is unknown (the push does not say, as in a fleet
        whose membership nobody manages, where every backend is taken to hold the same
        weights): any serving backend. A backend whose version is unknown never continues a
        generation from a known one.
        """
        return self.pick(exclude, version=weight_version)

    # ------------------------------------------------------------------ in flight

    def dispatched(self, url: str) -> None:
        """An attempt left for ``url``; it counts until its last byte (:meth:`finished`)."""
        self._in_flight[url] = self._in_flight.get(url, 0) + 1
        self._total_in_flight += 1

    def finished(self, url: str) -> None:
        n = self._in_flight[url] - 1
        self._total_in_flight -= 1
        if n == 0 and url not in self._serving:
            del self._in_flight[url]  # it left the list and is now idle: forget it
        else:
            self._in_flight[url] = n

    def in_flight(self) -> dict[str, int]:
        """Requests in flight per backend: every serving one, and leavers still finishing."""
        return dict(self._in_flight)

    @property
    def total_in_flight(self) -> int:
        return self._total_in_flight

    # ------------------------------------------------------------------ outcomes

    def record_success(self, url: str) -> None:
        tally = self._tallies.get(url)
        if tally is None:
            tally = self._tallies[url] = OutcomeTally()
        tally.successes += 1
        tally.trailing_failures = 0  # the window no longer ends failing

    def record_failure(self, url: str) -> None:
        tally = self._tallies.get(url)
        if tally is None:
            tally = self._tallies[url] = OutcomeTally()
        tally.failures += 1
        tally.trailing_failures += 1

    def drain_outcomes(self) -> dict[str, tuple[int, int, int]]:
        """``{url: (successes, failures, trailing_failures)}`` since the last drain, then zero.

        Only backends with something to report appear; each outcome is handed over once.
        """
        tallies, self._tallies = self._tallies, {}
        return {url: t.as_tuple() for url, t in tallies.items()}


# ---------------------------------------------------------------------- poison


def poison_quorum(routable: int, max_retries: int) -> int:
    """How many distinct engines must answer one request with the same 5xx before the router
    reads the request itself as the problem (poison) and passes that 5xx on: every engine the
    request may try, that is the engines it could be sent to (``routable``, those it tried
    included) up to its ``max_retries + 1`` tries, and never fewer than two (one engine's 5xx
    alone says nothing about the request). Read any sooner, two engines that fail at once (a
    crash beside a trickle) pass their 5xx to the client while a healthy one would have
    answered (docs/design.md section 4, "Poison")."""
    return max(2, min(routable, max_retries + 1))


def blamed_5xx(held: Sequence[tuple[str, int]], answered: bool, untried: int) -> list[str]:
    """Which of a request's held 5xx (``(backend, status)`` in the order they came) count
    against their backends once the request has ended; ``untried``: the engines it could
    still have been sent to (its tries ran out first).

    ``answered``: another engine answered the request: each 5xx was its own engine's, since a
    poison request fails everywhere. Not answered:

    * a status that two engines gave may be the request's: it counts against neither;
    * a 5xx that another engine contradicted with a different 5xx is its engine's (two
      engines broken in two ways);
    * one engine's 5xx and no other engine's answer: its own when other engines could have
      been tried (the tries ran out: as for a request with one try, the usual evidence of a
      trickle), never when it was the only engine the request could reach. That one is the
      fleet's last, and ejected for a poison request's 5xx it left nothing to route.

    A transport failure between them proves nothing either way: a crashed engine refuses a
    poison request as it refuses any."""
    if answered:
        return [backend for backend, _ in held]
    engines: dict[int, set[str]] = {}
    for backend, status in held:
        engines.setdefault(status, set()).add(backend)
    if len(engines) == 1 and (len(held) > 1 or untried == 0):
        return []
    return [backend for backend, status in held if len(engines[status]) == 1]
