"""The router's own Prometheus metrics.

Owns: the router's own counters, their Prometheus registry and their summary in its status.
Must not: forward an engine's metrics, or decide anything from the counters.

The request path only bumps plain integers in :class:`RouterStats` (no locks, no label lookups);
:class:`RouterCollector` turns them into metric families when ``/metrics`` is scraped. Each
router has its own ``CollectorRegistry``, so several routers can live in one process.

The router never forwards an engine's ``/metrics``: one shard's counters would pass for the
fleet's.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from fleetwarden.router.affinity import Affinity
from fleetwarden.router.kv_index import KVIndex
from fleetwarden.router.pool import Pool

__all__ = ["ADDED_LATENCY_BUCKETS_S", "KeyTally", "RouterCollector", "RouterStats",
           "make_registry"]

#: Buckets of the added-latency histogram, in seconds. The router's own cost is tens to hundreds
#: of microseconds; retries and rescues add whole attempts, up to seconds.
ADDED_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)


class KeyTally:
    """One client key's requests, and the tokens of their answers (router/keys.py)."""

    __slots__ = ("completion_tokens", "prompt_tokens", "requests")

    def __init__(self, requests: int = 0, prompt_tokens: int = 0,
                 completion_tokens: int = 0) -> None:
        self.requests = requests
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens

    def to_list(self) -> list[int]:
        return [self.requests, self.prompt_tokens, self.completion_tokens]

    def add(self, more: KeyTally) -> None:
        self.requests += more.requests
        self.prompt_tokens += more.prompt_tokens
        self.completion_tokens += more.completion_tokens


class RouterStats:
    """Counters the request path bumps. Plain attributes and dicts: the cheapest thing to touch."""

    __slots__ = ("aborted", "added_latency_buckets", "added_latency_count", "added_latency_sum",
                 "backend_failures", "comeback_served", "comeback_waits", "connections_closed",
                 "continuations", "hedges", "hedges_won", "key_refusals", "keys",
                 "local_exhaustion", "picks", "picks_s", "poison_requests", "requests", "rescues",
                 "responses", "retries", "streams_ended", "tokens_discarded")

    def __init__(self) -> None:
        self.requests = 0
        #: status -> responses sent with it (the router's own answers included)
        self.responses: dict[int, int] = {}
        #: (backend, cause) -> failures
        self.backend_failures: dict[tuple[str, str], int] = {}
        #: kind ("free": never reached an engine; "paid": an engine may have worked on it)
        #: free: never reached an engine; replaced: its backend was dropped, so the retry moves
        #: load rather than adding it; paid: within max_retries and the fleet's retry budget.
        self.retries: dict[str, int] = {"free": 0, "paid": 0, "replaced": 0}
        self.rescues = 0
        #: Requests sent to a second backend while the first held them taking no step
        #: (``WaitingRequests.hedge``), and of those, the ones whose second answer came first.
        self.hedges = 0
        self.hedges_won = 0
        self.poison_requests = 0
        #: Requests that found no backend while the controller said one was coming back, and
        #: waited for it (``comeback_wait_s`` at most); of those, the ones a backend then took.
        self.comeback_waits = 0
        self.comeback_served = 0
        #: Requests answered 503 because the router itself was out of descriptors or buffers
        #: (never counted against an engine).
        self.local_exhaustion = 0
        #: reason -> client connections the data port ended itself (its limits at work:
        #: router/serve.py, ``Server.closed_for``)
        self.connections_closed: dict[str, int] = {}
        #: mode ("tokens": exact, from token ids; "text": from the text so far) -> streams
        #: continued on another engine after theirs failed them mid-answer
        self.continuations: dict[str, int] = {"tokens": 0, "text": 0, "restart": 0}
        #: cause -> streams that had begun and could not be continued: ended with an error event
        self.streams_ended: dict[str, int] = {}
        #: Generations an engine aborted (``finish_reason`` "abort": a ``pause?mode=abort``, a
        #: shutdown): each was re-sent or continued elsewhere, or ended with why.
        self.aborted = 0
        #: Tokens an engine generated that no client got as generated: a whole answer it
        #: aborted (its usage), and the tokens a continuation generates again before its own.
        #: Counted where the router saw them (a hedge's losing attempt, cancelled before its
        #: answer, made tokens no one counts): what a fault cost a trainer's step, at least.
        self.tokens_discarded = 0
        self.added_latency_buckets = [0] * (len(ADDED_LATENCY_BUCKETS_S) + 1)
        self.added_latency_count = 0
        self.added_latency_sum = 0.0
        #: Backends picked, and the CPU seconds the picks took (a scan of the serving set:
        #: what grows with the fleet on every request).
        self.picks = 0
        self.picks_s = 0.0
        #: key name -> its requests and tokens, while the router checks keys (router/keys.py)
        self.keys: dict[str, KeyTally] = {}
        #: why -> requests refused a 401 for their key: missing, wrong (no key of the file),
        #: ambiguous (more than one Authorization header)
        self.key_refusals: dict[str, int] = {}

    def key(self, name: str) -> KeyTally:
        """The tally of the key named ``name`` (made on its first request)."""
        tally = self.keys.get(name)
        if tally is None:
            tally = self.keys[name] = KeyTally()
        return tally

    def responded(self, status: int) -> None:
        responses = self.responses
        responses[status] = responses.get(status, 0) + 1

    def backend_failed(self, backend: str, cause: str) -> None:
        key = (backend, cause)
        self.backend_failures[key] = self.backend_failures.get(key, 0) + 1

    def stream_ended(self, cause: str) -> None:
        self.streams_ended[cause] = self.streams_ended.get(cause, 0) + 1

    def picked(self, seconds: float) -> None:
        self.picks += 1
        self.picks_s += seconds

    def observe_added_latency(self, seconds: float) -> None:
        self.added_latency_buckets[bisect.bisect_left(ADDED_LATENCY_BUCKETS_S, seconds)] += 1
        self.added_latency_count += 1
        self.added_latency_sum += seconds

    def summary(self) -> dict[str, Any]:
        """The counters as plain JSON-able data (the router's ``status()``)."""
        return {"requests": self.requests,
                "responses": {str(k): n for k, n in self.responses.items()},
                "backend_failures": sum(self.backend_failures.values()),
                "retries": dict(self.retries),
                "rescues": self.rescues,
                "hedges": self.hedges,
                "hedges_won": self.hedges_won,
                # What faults cost the requests (a trainer's step: fleet.refit_from).
                "continuations": dict(self.continuations),
                "streams_ended": dict(self.streams_ended),
                "aborted": self.aborted,
                "tokens_discarded": self.tokens_discarded,
                "failures": _by_backend(self.backend_failures),
                "poison_requests": self.poison_requests,
                "comeback_waits": self.comeback_waits,
                "comeback_served": self.comeback_served,
                "local_exhaustion": self.local_exhaustion,
                "connections_closed": dict(self.connections_closed),
                # name -> [requests, prompt tokens, completion tokens]
                "keys": {name: t.to_list() for name, t in self.keys.items()},
                "key_refusals": dict(self.key_refusals)}


def _by_backend(failures: dict[tuple[str, str], int]) -> dict[str, dict[str, int]]:
    """``{backend: {cause: n}}`` of the router's ``(backend, cause) -> n``."""
    out: dict[str, dict[str, int]] = {}
    for (backend, cause), n in failures.items():
        out.setdefault(backend, {})[cause] = n
    return out


class RouterCollector(Collector):
    """Reads :class:`RouterStats` and the pool at scrape time."""

    def __init__(self, stats: RouterStats, pool: Pool,
                 affinity: Affinity | None = None) -> None:
        self._stats = stats
        self._pool = pool
        self._affinity = affinity

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        yield from _traffic(s)
        yield from _interventions(s)
        yield from _connections_and_streams(s)
        if s.keys or s.key_refusals:
            yield from _key_families(s)
        yield from _pool_families(s, self._pool)
        if self._affinity is not None:
            yield from _cache_families(self._affinity)


def _counter(name: str, documentation: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def _by(name: str, documentation: str, label: str,
        counts: Mapping[Any, int]) -> CounterMetricFamily:
    """One sample per label value, in order."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, n in sorted(counts.items()):
        family.add_metric([str(key)], n)
    return family


def _traffic(s: RouterStats) -> Iterator[Metric]:
    """Requests, responses, backend failures and re-sends."""
    yield _counter("fleetwarden_router_requests", "Requests received on the OpenAI API.",
                   s.requests)
    yield _by("fleetwarden_router_responses", "Responses sent, by HTTP status.", "status",
              s.responses)
    failures = CounterMetricFamily(
        "fleetwarden_router_backend_failures",
        "Backend failures (transport errors, or a 5xx before any byte reached the client).",
        labels=["backend", "cause"])
    for (backend, cause), n in sorted(s.backend_failures.items()):
        failures.add_metric([backend, cause], n)
    yield failures
    yield _by("fleetwarden_router_retries",
              "Requests re-sent to another backend: free (never reached an engine) or paid.",
              "kind", s.retries)


def _interventions(s: RouterStats) -> Iterator[Metric]:
    """What the router did besides a plain send: rescues, hedges, poison, its own exhaustion."""
    yield _counter(
        "fleetwarden_router_rescues",
        "Requests moved off a backend at the controller's word (condemned, asleep, or a "
        "stream held where nothing steps): re-sent, or continued from their tokens.",
        s.rescues)
    yield _counter(
        "fleetwarden_router_hedges",
        "Requests sent to a second backend as well while the first held them taking no "
        "step (the first answer is the client's).", s.hedges)
    yield _counter(
        "fleetwarden_router_hedges_won",
        "Hedged requests answered by the second backend (the first was cancelled).",
        s.hedges_won)
    yield _counter(
        "fleetwarden_router_poison_requests",
        "Requests that got the same 5xx from a second backend: that answer is passed to "
        "the client and not counted against the second backend (the first backend's 5xx "
        "was counted before the retry).", s.poison_requests)
    yield _counter(
        "fleetwarden_router_comeback_waits",
        "Requests that found no backend while one was coming back, and waited for it "
        "(comeback_wait_s at most) instead of a 409 at once.", s.comeback_waits)
    yield _counter(
        "fleetwarden_router_comeback_served",
        "Of those, the requests a backend took once it was back.", s.comeback_served)
    yield _counter(
        "fleetwarden_router_local_exhaustion",
        "Requests answered 503 because the router was out of file descriptors or buffers "
        "when connecting to an engine: the router's trouble, never counted against one.",
        s.local_exhaustion)


def _connections_and_streams(s: RouterStats) -> Iterator[Metric]:
    """Client connections the data port ended, and streams continued or ended with an error."""
    yield _by(
        "fleetwarden_router_connections_closed",
        "Client connections the data port ended itself, by reason: head_timeout (408), "
        "idle_timeout, write_timeout (a client that stopped reading), head_too_large (431), "
        "refused (another 4xx/501), over_capacity (503), evicted_idle (to make room).",
        "reason", s.connections_closed)
    yield _by(
        "fleetwarden_router_continuations",
        "Streams continued on another engine after theirs failed mid-answer, by mode: "
        "tokens (exact, from token ids) or text (from the text produced so far).",
        "mode", s.continuations)
    yield _counter(
        "fleetwarden_router_aborted",
        "Generations an engine aborted (finish_reason abort): re-sent, continued, or "
        "ended with an error.", s.aborted)
    yield _counter(
        "fleetwarden_router_tokens_discarded",
        "Tokens engines generated that no client got as generated: aborted whole answers, "
        "and tokens a continuation generated again.", s.tokens_discarded)
    yield _by(
        "fleetwarden_router_streams_ended_with_error",
        "Streams that had begun, failed and could not be continued: ended with an error "
        "event, by cause.", "cause", s.streams_ended)


def _key_families(s: RouterStats) -> Iterator[Metric]:
    """Per client key: its requests and its answers' tokens; and the requests refused for
    their key, by why (the data port's keys: router/keys.py)."""
    names = sorted(s.keys)
    for family, documentation, field in (
            ("fleetwarden_router_key_requests", "Requests let in, by the client key's name.",
             "requests"),
            ("fleetwarden_router_key_prompt_tokens",
             "Prompt tokens of the answers to each client key's requests (their usage).",
             "prompt_tokens"),
            ("fleetwarden_router_key_completion_tokens",
             "Completion tokens of the answers to each client key's requests (their usage, "
             "or the tokens a stream carried).", "completion_tokens")):
        counter = CounterMetricFamily(family, documentation, labels=["key"])
        for name in names:
            counter.add_metric([name], getattr(s.keys[name], field))
        yield counter
    yield _by("fleetwarden_router_key_refusals",
              "Requests answered 401 for their key, by why: missing, wrong, ambiguous.",
              "why", s.key_refusals)


def _pool_families(s: RouterStats, pool: Pool) -> Iterator[Metric]:
    """The pool's state now, the time picking takes, and the latency the router adds."""
    in_flight = GaugeMetricFamily(
        "fleetwarden_router_in_flight",
        "Requests in flight per backend, dispatch to last byte.", labels=["backend"])
    for backend, n in sorted(pool.in_flight().items()):
        in_flight.add_metric([backend], n)
    yield in_flight

    picks = SummaryMetricFamily(
        "fleetwarden_router_pick_seconds",
        "Time spent picking a backend for an attempt (count: picks; sum: seconds).")
    picks.add_metric([], s.picks, s.picks_s)
    yield picks

    serving = GaugeMetricFamily(
        "fleetwarden_router_serving_backends", "Backends the router may send requests to.")
    serving.add_metric([], len(pool.serving))
    yield serving

    added = HistogramMetricFamily(
        "fleetwarden_router_added_latency_seconds",
        "Time the router adds before the first byte: the whole wait minus the answering "
        "backend's own time to headers (failed attempts and retries count as added).")
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, n in zip(ADDED_LATENCY_BUCKETS_S, s.added_latency_buckets, strict=False):
        cumulative += n
        buckets.append((repr(bound), cumulative))
    buckets.append(("+Inf", s.added_latency_count))
    added.add_metric([], buckets, s.added_latency_sum)
    yield added


def _cache_families(affinity: Affinity) -> Iterator[Metric]:
    """The cache-aware policy's predictions per backend, to be set beside the engines' own
    ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``: the rate of one is
    what the other is predicted to be."""
    predicted = sorted(affinity.predicted().items())
    blocks = CounterMetricFamily(
        "fleetwarden_router_cache_blocks",
        "Prompt blocks of the requests placed on each backend by the cache-aware policy.",
        labels=["backend"])
    hits = CounterMetricFamily(
        "fleetwarden_router_cache_predicted_hit_blocks",
        "Of those, the blocks the router's index said the backend held (predicted hits).",
        labels=["backend"])
    for backend, tally in predicted:
        blocks.add_metric([backend], tally.blocks)
        hits.add_metric([backend], tally.hit_blocks)
    yield blocks
    yield hits
    held = GaugeMetricFamily(
        "fleetwarden_router_cache_index_blocks",
        "Prompt blocks the router's index takes each backend to hold now.", labels=["backend"])
    for backend, n in sorted(affinity.held_blocks().items()):
        held.add_metric([backend], n)
    yield held
    forgotten = CounterMetricFamily(
        "fleetwarden_router_cache_forgotten_blocks",
        "Index entries dropped because their backend's cache went: it left the serving set, "
        "restarted (a new incarnation) or was refit (a new weight version).")
    forgotten.add_metric([], affinity.forgotten)
    yield forgotten
    if affinity.precise is not None:
        yield from _kv_event_families(affinity.precise)


def _kv_event_families(index: KVIndex) -> Iterator[Metric]:
    """The engines' own KV events as the router heard them (router/kv_index.py): what each
    engine holds by them, whether they route it now, and the stream's gaps and restarts."""
    now = time.monotonic()  # the clock the router's KVEvents stamps batches with
    held = GaugeMetricFamily(
        "fleetwarden_router_kv_events_blocks",
        "Prompt blocks each engine holds by its own KV events.", labels=["backend"])
    synced = GaugeMetricFamily(
        "fleetwarden_router_kv_events_synced",
        "1 while an engine's KV events route it (heard, no gap left unfilled within "
        "cache_ttl_s); 0: the guess routes it.", labels=["backend"])
    for backend in index.backends():
        held.add_metric([backend], index.blocks(backend))
        synced.add_metric([backend], 1 if index.synced(backend, now) else 0)
    yield held
    yield synced
    t = index.tallies
    for name, value, text in [
            ("batches", t.batches, "KV-event batches applied, replayed ones included."),
            ("gaps", t.gaps, "Batches that showed earlier ones missing (a replay was asked)."),
            ("lost", t.lost, "Gaps no replay filled: the engine's entries were dropped."),
            ("restarts", t.restarts, "Sequence numbers that went back: a new engine process."),
            ("unkeyed_blocks", t.unkeyed,
             "Stored blocks not keyed (parent unknown, a LoRA, extra keys, another group).")]:
        family = CounterMetricFamily(f"fleetwarden_router_kv_events_{name}", text)
        family.add_metric([], value)
        yield family


class _WorkerLabelled(Collector):
    """Every sample of ``inner`` with ``worker="N"`` added: one router of several processes
    sharing a port (``[router] workers``), so that series of different workers never mix."""

    def __init__(self, inner: Collector, worker: int) -> None:
        self._inner = inner
        self._worker = str(worker)

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            family.samples = [s._replace(labels={**s.labels, "worker": self._worker})
                              for s in family.samples]
            yield family


def make_registry(stats: RouterStats, pool: Pool, worker: int | None = None,
                  affinity: Affinity | None = None) -> CollectorRegistry:
    """A registry of its own, holding only this router's metrics; with ``worker``, each series
    labelled with it; with ``affinity``, the cache-aware policy's predictions too."""
    registry = CollectorRegistry(auto_describe=False)
    collector: Collector = RouterCollector(stats, pool, affinity)
    registry.register(collector if worker is None else _WorkerLabelled(collector, worker))
    return registry
