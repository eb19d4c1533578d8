"""Forwarding one request: pick a backend, send, stream the answer back, count what happened.

Owns: one request's way through the backends: send, retry, rescue, stream back, count.
Must not: decide health or change the serving set: it reports outcomes, the controller and the
ledger judge.

The imperative shell around :class:`~fleetwarden.router.pool.Pool`. Its rules (docs/design.md
section 4):

* Upstream statuses pass through untouched. A transport error (refused, reset, timeout), or a
  5xx before any byte reached the client, is a backend failure, and so is a whole 200 whose
  generation the engine aborted (vLLM's ``finish_reason`` "abort": what a vLLM shut down with
  SIGTERM answers for what it held, truncated); a completed 2xx/3xx response
  is a success; a 4xx (429 included) is neither: the client's request was at fault, and an
  engine whose core is wedged still answers validation errors from its API process.
* A request that has sent nothing to its client can be re-sent elsewhere: freely if it never
  reached an engine (refused, connect timeout), at most ``max_retries`` times and within the
  fleet's retry budget if an engine may have worked on it. The same 5xx from every engine the
  request may try (:func:`~fleetwarden.router.pool.poison_quorum`) marks the request itself as
  the problem (poison): it is answered with that 5xx, and counted against none of them. A 5xx
  is held until the request ends: counted once another engine has answered the request, or
  when no other engine repeated it (:func:`~fleetwarden.router.pool.blamed_5xx`).
* While a request waits on a backend with nothing sent to its client, the controller may
  :meth:`Forwarder.rescue` it: it is cancelled there and re-sent elsewhere at once.
* A request held on a backend is one that has received nothing from it: waiting for its head,
  or a stream with its head and no event since its send or its last event (a stream's head
  comes at once; its tokens are the evidence). :meth:`Forwarder.silent` reports both alike, so
  a stream parked on a wedge accuses its engine as fast as a request waiting there does.
* The controller may also :meth:`Forwarder.hedge` a backend that holds requests while it takes
  no step: each request waiting there long enough with nothing sent to its client is sent to
  another backend as well, and the first answer is the client's; the other attempt is
  cancelled (its engine sees the disconnect and aborts). The engine keeps its chance: a long
  step that ends answers as before; when the hedge answers first, the held attempt lost a
  race (``hedged``): its engine leaves this router's list until the next push, and nothing
  is reported against it (a long step looks the same as a wedge until it ends; only the
  stall limit condemns). A hedge takes a token of the
  retry budget while it is in flight, unless its backend is already out of the serving set
  (then, as for a reflex drop, it moves load rather than adding to it). Streams the router
  continues are never hedged (two engines cannot write one client's stream): one held as long
  is moved instead, continued elsewhere at once as a rescue does, and its engine has failed it
  (``hedged``), as if it had lost the race.
* A streamed completion or chat whose engine fails it after its first bytes reached the client
  (a crash, a reset, a rescue from a wedge) is continued on another engine with the same
  weights, from the tokens already produced, and spliced into the client's stream
  (:mod:`fleetwarden.router.splice` decides and rewrites; this module does the I/O). One that
  cannot be continued ends with an error event naming the cause, never with a silent cut.
* When it cannot serve, the router answers deliberately: ``status_when_others_serve`` (500)
  while backends remain, ``status_when_none_left`` (409) when none does. Never 504: clients
  retry it without bound. A request that finds none while the controller's push says an engine
  is coming back waits for the next push, ``comeback_wait_s`` at most, before that 409: a
  rolling restart leaves a small fleet none for the moment between one engine's stop and the
  last one's admission (docs/design.md, "None left, one coming"). (An exception that escapes
  a handler is answered 500 by the server, :mod:`fleetwarden.router.serve`; none is meant
  to.)
* Every answer an engine produced carries the weight version and shard index the controller's
  push gave that engine (``x-fleetwarden-weight-version``, ``x-fleetwarden-shard``). A request
  with ``x-fleetwarden-min-weight-version: N`` is sent only to engines at version N or later;
  when none is, it is answered ``status_when_none_left`` (409), type
  ``weight_version_unavailable``, naming the versions that serve.
* The router decides nothing about health. Its one local act, the reflex drop, happens only
  when fleet health drives membership (``health_managed``), so that the next push undoes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

from fleetwarden.router.affinity import Affinity, AffinitySettings, Query, query_of
from fleetwarden.router.kv_events import KVEvents, Source, sources_of
from fleetwarden.router.kv_index import KVIndex
from fleetwarden.router.pool import (
    UNKNOWN_FACTS,
    BackendFacts,
    Pool,
    blamed_5xx,
    poison_quorum,
)
from fleetwarden.router.retry import AfterFailure, Cause, Retries, settle
from fleetwarden.router.serve import (
    BodyTooLarge,
    RawHeaders,
    Request,
    Response,
    StreamResponse,
    error_body,
)
from fleetwarden.router.settings import (
    FORBIDDEN_STATUS,
    GENERATE,
    MIN_VERSION_HEADER,
    SHARD_HEADER,
    WEIGHT_VERSION_HEADER,
    WEIGHT_VERSIONS_HEADER,
    RouterSettings,
)
from fleetwarden.router.splice import (
    ABORTED_ERROR,
    DONE,
    Continuation,
    EngineLimits,
    EventAction,
    Splice,
    SseSplitter,
    error_event,
    read_stream_request,
)
from fleetwarden.router.stats import RouterStats
from fleetwarden.router.upstream import (
    Address,
    Answer,
    ConnectFailed,
    ConnectTimeout,
    LocalExhaustion,
    UpstreamClient,
    UpstreamError,
)

__all__ = ["Forwarder", "error_response"]

log = logging.getLogger("fleetwarden.router")

#: Hop-by-hop headers (RFC 9110 section 7.6.1) and those the router recomputes: never forwarded.
#: Lower case, as bytes: headers travel as they came on the wire (``RawHeaders``).
_HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
#: The body is buffered and re-sent, so its length is recomputed and there is nothing left to
#: expect; the Host is the backend's.
_NOT_FORWARDED = _HOP_BY_HOP | {b"host", b"content-length", b"expect"}
#: An answer relayed whole is re-framed: its length is recomputed.
_NOT_RELAYED_WHOLE = _HOP_BY_HOP | {b"content-length"}
#: The router's word on which weights answered, never an engine's header of the same name.
_FACT_HEADERS = frozenset({WEIGHT_VERSION_HEADER.encode(), WEIGHT_VERSIONS_HEADER.encode(),
                           SHARD_HEADER.encode()})
_WEIGHT_VERSION = WEIGHT_VERSION_HEADER.encode()
_WEIGHT_VERSIONS = WEIGHT_VERSIONS_HEADER.encode()
_SHARD = SHARD_HEADER.encode()
_MIN_VERSION = MIN_VERSION_HEADER.encode()
_CLOSE = (b"Connection", b"close")
#: Digits of a minimum weight version read (a 64-bit counter has 20).
_MAX_VERSION_DIGITS = 20
#: Parsed target URLs kept (backends x allowlisted paths, plus any query strings).
_MAX_CACHED_TARGETS = 4096
#: Answers of known length up to this size are read whole and sent in one write: a
#: non-streamed completion arrives in one or two TCP segments anyway, and this saves a system
#: call and several awaits per request. Streams (no length) and larger bodies go chunk by chunk.
_WHOLE_ANSWER_BYTES = 256 * 1024


_DESCRIPTIONS = {
    Cause.REFUSED: "refused the connection",
    Cause.CONNECT_TIMEOUT: "did not accept a connection in time",
    Cause.RESET: "broke the connection",
    Cause.TIMEOUT: "did not answer within the backend timeout",
    Cause.SERVER_ERROR: "answered with a server error",
    Cause.RESCUED: "was condemned while the request waited on it",
    Cause.HEDGED: "held the request without a step while another engine took it over",
    Cause.STREAM_ERROR: "ended the stream with a server error",
    Cause.ABORTED: "aborted the generation",
    Cause.LOCAL_EXHAUSTION: "could not be reached: the router is out of descriptors or buffers",
}

#: A choice the engine aborted, in a whole answer (compact JSON, as vLLM writes it, or spaced).
_ABORTED = re.compile(rb'"finish_reason":\s*"abort"')


def _classify(exc: BaseException) -> Cause:
    # Order matters: the connect errors are subclasses of the generic ones below them.
    if isinstance(exc, LocalExhaustion):
        return Cause.LOCAL_EXHAUSTION
    if isinstance(exc, ConnectTimeout):
        return Cause.CONNECT_TIMEOUT
    if isinstance(exc, ConnectFailed):
        return Cause.REFUSED
    if isinstance(exc, TimeoutError):  # the total timeout, or a socket read timeout
        return Cause.TIMEOUT
    return Cause.RESET


@dataclass(slots=True)
class _Failure:
    """One attempt that ended without an answer the client could be given as it stands."""

    backend: str
    cause: Cause
    #: For SERVER_ERROR and ABORTED: the engine's answer, kept so that it can be passed
    #: through when it cannot be re-sent.
    status: int = 0
    headers: RawHeaders | None = None
    body: bytes = b""
    #: What the push said of the backend when the attempt left (it may have left the list since).
    facts: BackendFacts = UNKNOWN_FACTS
    #: Already counted against its backend (where a hedge was awaited after it).
    counted: bool = False
    #: HEDGED only: the controller said a lost race of this request fails its engine (one
    #: whose gauges show no work: no step is in progress there, so no long one either).
    race_fails: bool = False


@dataclass(slots=True)
class _Won:
    """A hedge's answer that arrived first: its headers are in, nothing reached the client."""

    backend: str
    upstream: Answer
    backend_time: float
    facts: BackendFacts


@dataclass(slots=True, eq=False)
class _Exchange:
    """One client request on its way through the backends, across its attempts: what each
    attempt sends, and what the attempts so far left. A hedge of a waiting request reads it
    too (the hedge's backend joins ``tried``)."""

    request: Request
    body: bytes
    #: The client's headers as forwarded (hop-by-hop and recomputed ones dropped).
    headers: RawHeaders
    #: ``time.perf_counter()`` when it arrived.
    started: float
    session: str | None
    #: The client's minimum weight version (``x-fleetwarden-min-weight-version``).
    min_version: int | None
    #: A streamed completion or chat the router continues; None: an answer relayed as it is.
    stream: _Stream | None
    #: What the cache-aware policy reads of it (None without that policy, or unreadable).
    query: Query | None
    tried: list[str] = field(default_factory=list)
    #: The last failed attempt, and the step it led to.
    last: _Failure | None = None
    resend: AfterFailure | None = None
    #: Its paid retries, from its first failure that counts against an engine.
    retries: Retries | None = None
    #: The 5xx not yet reported against their backends: whether the request is poison (the
    #: same 5xx from every engine it may try) is known only when it ends, and a request that
    #: fails everywhere must eject no engine it touched. Reported when it ends, as
    #: :func:`blamed_5xx` says; the reflex drops of the others are undone.
    held: list[_Failure] = field(default_factory=list)
    #: An engine answered the request (a whole answer, or a stream's first bytes).
    answered: bool = False
    #: When it first found no backend left while one was coming back (the start of its
    #: wait, ``comeback_wait_s`` at most); None: it has not, or a backend took it since.
    none_left_since: float | None = None
    #: The weight versions loaded into its engine while it was there (:meth:`Forwarder.
    #: weights_changing`): its tokens may come from each, after the version it began on.
    crossed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Stream:
    """A streamed completion or chat on its way to its client, across attempts."""

    splice: Splice
    #: The client's response, once its first byte went: from then on the stream is continued,
    #: never restarted.
    response: StreamResponse | None = None
    #: How the current attempt continues the stream (``None``: it is the first).
    continuation: Continuation | None = None
    #: The first engine's weight version: a continuation must come from the same weights.
    weight_version: int | None = None
    #: The backends its attempts went to, and the client's minimum weight version: where it
    #: could go next (:meth:`Forwarder._elsewhere`).
    tried: list[str] = field(default_factory=list)
    min_version: int | None = None
    #: The backend whose attempt began the generation: its limits are the ones kept.
    began_on: str | None = None
    #: Its exchange's ``crossed`` (the same list).
    crossed: list[int] = field(default_factory=list)

    @property
    def began(self) -> bool:
        """From here on it is continued, never restarted: its first bytes reached the client,
        or (an answer the router assembles) the engine produced tokens."""
        return self.response is not None or (self.splice.request.assemble
                                             and self.splice.produced > 0)


def error_response(status: int, message: str, error_type: str,
                   headers: dict[str, str] | None = None, **extra: object) -> Response:
    """A JSON error in the OpenAI shape (``{"error": {...}}``), with extra fields if given."""
    return Response(status=status, body=error_body(status, message, error_type, **extra),
                    content_type="application/json", headers=headers)


def _versions(version: int | None, crossed: list[int]) -> list[int]:
    """Every weight version that may have produced an answer begun on weights ``version``, in
    order: its own, then those loaded under it (``crossed``)."""
    if version is None:
        return []
    versions = [version]
    for v in crossed:
        if v != versions[-1]:
            versions.append(v)
    return versions


def _versions_label(stream: _Stream, version: int | None) -> bytes:
    """The event that names the weight versions of a stream begun on weights ``version``,
    where a load crossed it (its head named the first only); ``b""`` where one version made
    it all."""
    versions = _versions(version, stream.crossed)
    return stream.splice.versions_event(versions) if len(versions) > 1 else b""


#: A span's version as a header may carry it: what ``str(int)`` gives, or a label of vLLM's own
#: (``"default"``); never a comma, which would split it.
_SPAN_VERSION = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def _span_versions(body: bytes) -> list[str] | None:
    """The weight versions a whole ``/inference/v1/generate`` answer's spans name, in order of
    their first token over its choices; ``None`` where it names none (an engine that reports
    no spans, an error) or one a header cannot carry."""
    if b'"weight_versions"' not in body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    versions: list[str] = []
    choices = parsed.get("choices") if isinstance(parsed, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        spans = choice.get("weight_versions") if isinstance(choice, dict) else None
        for span in spans if isinstance(spans, list) else ():
            v = span.get("version") if isinstance(span, dict) else None
            if not isinstance(v, str) or _SPAN_VERSION.fullmatch(v) is None:
                return None
            if v not in versions:
                versions.append(v)
    return versions or None


def _response_headers(upstream: RawHeaders, dropped: frozenset[bytes] = _HOP_BY_HOP,
                      facts: BackendFacts = UNKNOWN_FACTS,
                      crossed: list[int] | None = None,
                      spans: list[str] | None = None) -> RawHeaders:
    """The engine's answer headers the client gets: ``dropped``, those the engine's
    ``Connection`` names (hop-by-hop, RFC 9110 7.6.1) and any it gave of the router's own
    removed, then the facts of the push added. An answer whose engine loaded other weights
    while it was there (``crossed``) names every version in ``x-fleetwarden-weight-versions``
    and none in ``x-fleetwarden-weight-version``: one version named for a mixed answer would
    be a wrong label (docs/rl.md). ``spans``: the versions the engine itself reported for the
    answer's tokens (:func:`_span_versions`): its word, exact, is named in place of the push's."""
    named = [v for k, v in upstream if k.lower() == b"connection"]
    if named:
        dropped = dropped | {t.strip().lower() for v in named for t in v.split(b",")}
    headers = [(k, v) for k, v in upstream
               if (lowered := k.lower()) not in dropped and lowered not in _FACT_HEADERS]
    if spans is None and not crossed:  # nearly every answer: the push's one version
        if facts.weight_version is not None:
            headers.append((_WEIGHT_VERSION, str(facts.weight_version).encode()))
    else:
        versions = spans or [str(v) for v in _versions(facts.weight_version, crossed or [])]
        if len(versions) > 1 or (spans and not spans[0].isdigit()):
            headers.append((_WEIGHT_VERSIONS, ",".join(versions).encode()))
        elif versions:
            headers.append((_WEIGHT_VERSION, versions[0].encode()))
    if facts.shard is not None:
        headers.append((_SHARD, str(facts.shard).encode()))
    return headers


def _with_key(headers: RawHeaders, key: str | None) -> RawHeaders:
    """``headers`` with ``Authorization: Bearer key`` in place of any the client sent, for a
    request the router makes on its own account; as they are without a key."""
    if key is None:
        return headers
    kept = [(k, v) for k, v in headers if k.lower() != b"authorization"]
    return [*kept, (b"Authorization", b"Bearer " + key.encode("latin-1", "replace"))]


def _min_version(value: bytes | None) -> int | Response | None:
    """The request's minimum weight version, ``None`` without one, or the 400 for a bad one."""
    if value is None:
        return None
    raw = value.decode("latin-1")
    digits = raw.strip()
    # Bounded: Python refuses to read an integer of over 4,300 digits (ValueError), and no
    # weight version needs more than a 64-bit counter's 20.
    if not (digits.isascii() and digits.isdigit()) or len(digits) > _MAX_VERSION_DIGITS:
        return error_response(400, f"{MIN_VERSION_HEADER} must be an integer >= 0, got "
                              f"{raw!r}.", "invalid_request_error", param=MIN_VERSION_HEADER)
    return int(digits)


async def _read(upstream: Answer) -> bytes:
    """The whole body; on any interruption the connection is closed, never pooled half-read."""
    try:
        return await upstream.read()
    except BaseException:
        upstream.close()
        raise


class _Hold:
    """A request's wait on a backend that the controller may interrupt (a rescue) or its hedge
    may end (its answer came first): the wait's task is cancelled, and the wait, catching that,
    asks :meth:`caught` whether it was this interrupt (then it moves on) or its client leaving
    (then it ends). What ``asyncio.timeout(None)`` with ``reschedule(now)`` did, without its
    ``async with`` (5 µs a request, measured under uvloop); the same cancel-count rule, so a
    client that leaves at the same moment still ends its handler."""

    __slots__ = ("_cancelling", "_interrupted", "_task", "crossed", "since", "stream", "why")

    def __init__(self, *, stream: _Stream | None = None, since: float = 0.0,
                 crossed: list[int] | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._interrupted = False
        #: The stream the router continues whose wait this is: moved, never hedged.
        self.stream = stream
        #: For a stream relayed (:attr:`Forwarder._streaming`): the loop time since which it has
        #: waited on its engine with nothing received (what :meth:`Forwarder.silent` reports;
        #: infinity while it is written to its client: then it waits on nobody's engine).
        self.since = since
        #: What the attempt ends as when this hold is interrupted.
        self.why = Cause.RESCUED
        #: Where a weight load on its backend is noted (its request's ``crossed``).
        self.crossed = crossed

    def interrupt(self, why: Cause = Cause.RESCUED) -> None:
        if not self._interrupted:
            self._interrupted = True
            self.why = why
            self._task.cancel()

    def caught(self) -> bool:
        """In ``except CancelledError``: whether this hold's interrupt was the cancel (it is
        then spent: the task goes on)."""
        return self._interrupted and self._task.uncancel() <= self._cancelling


class Forwarder:
    """Sends requests to the pool's backends over keep-alive connections
    (:mod:`fleetwarden.router.upstream`)."""

    def __init__(self, pool: Pool, settings: RouterSettings, stats: RouterStats, *,
                 health_managed: bool) -> None:
        self.pool = pool
        self.settings = settings
        self.stats = stats
        self.health_managed = health_managed
        #: Seconds a client should wait before retrying, when the caller expects a backend back.
        self.retry_after: float | None = None
        #: Engines the last push said are coming back (:meth:`pushed`), and the event the
        #: requests waiting for one wait on: set, and replaced, at every push.
        self.coming_back = 0
        self._push_seen = asyncio.Event()
        self._client: UpstreamClient | None = None
        #: Requests waiting on each backend with nothing sent to their client: what a rescue
        #: may cancel. Each is the hold around its wait, with the loop time it began
        #: (what :meth:`silent` reports) and its request, for a hedge (None: not hedgeable).
        self._waiting: dict[str, dict[_Hold, tuple[float, _Exchange | None]]] = {}
        #: Hedges in flight, by the hold of the wait they hedge (:meth:`hedge`).
        self._hedging: dict[_Hold, asyncio.Task[_Won | _Failure]] = {}
        #: The holds whose hedges were sent with ``lost_race_fails`` (:meth:`hedge`).
        self._races_fail: set[_Hold] = set()
        #: Streams being relayed from each backend (their answer has begun): a rescue cuts
        #: them too, and they go on elsewhere. Each hold's ``since`` is when it last received
        #: anything: a stream whose engine stopped after its head is held there all the same.
        self._streaming: dict[str, set[_Hold]] = {}
        #: The loop time each backend last answered anything on the request path (a head, a
        #: stream's bytes): a request waiting there is silent only as long as its engine is.
        #: A saturated engine queues requests for seconds while it answers others; a stopped
        #: one answers none (docs/design.md, "Silence is evidence").
        self._heard: dict[str, float] = {}
        #: Set the tokens of each stream it relays event by event on its response
        #: (``StreamResponse.usage``): the router counts them per client key.
        self.count_usage = False
        #: Every attempt carries its engine's key (the push's ``key``), not only the router's
        #: own continuations: set when the router checks client keys, whose keys never go on
        #: to an engine (router/keys.py), so that clients never need to hold the engines' key.
        self.engine_keys_always = False
        #: Told of every failed attempt as it happens: (backend, cause). The router's evidence
        #: stream; whoever listens must not raise.
        self.on_failure: Callable[[str, str], None] | None = None
        #: Parsed target URLs, by backend + path (the allowlist keeps this small).
        self._targets: dict[str, Address] = {}
        #: Each engine's context length and server caps (:class:`EngineLimits`), and the
        #: reads of ``/v1/models`` under way (:meth:`_learn_context`).
        self.limits = EngineLimits()
        self._learning: dict[str, asyncio.Task[None]] = {}
        header = settings.session_header
        self._session_header = None if header is None else header.strip().lower().encode()
        #: The cache-aware policy's index (router/affinity.py); None: least in flight.
        self.affinity: Affinity | None = None
        #: The subscriptions to the engines' KV events (router/kv_events.py), opened with the
        #: forwarder; None: cache-aware routing off, or ``kv_events`` off.
        self.kv_events: KVEvents | None = None
        #: Each backend whose ``/kv_event_sources`` was read, by the incarnation it was read
        #: at (asked again only when that changes), and the reads under way.
        self._kv_asked: dict[str, str | None] = {}
        self._kv_asking: dict[str, asyncio.Task[None]] = {}
        self._kv_configured = settings.kv_event_sources()
        if settings.routing == "cache_aware":
            self.affinity = Affinity(AffinitySettings.of(settings))
            if settings.kv_events:
                # A gap no replay fills is served by the guess for the guess's own lifetime.
                self.affinity.precise = KVIndex(self.affinity.settings.token_block,
                                                resync_s=settings.cache_ttl_s)

    def pushed(self, coming_back: int) -> None:
        """A push arrived: the requests waiting for a backend look again."""
        self.coming_back = coming_back
        seen, self._push_seen = self._push_seen, asyncio.Event()
        seen.set()

    async def _wait_for_comeback(self, ex: _Exchange) -> bool:
        """No backend is left for ``ex``: wait for the next push while one is coming back,
        until ``comeback_wait_s`` from the first time it found none. True: look again."""
        if self.coming_back <= 0:
            return False
        now = time.monotonic()
        if ex.none_left_since is None:
            ex.none_left_since = now
            self.stats.comeback_waits += 1
        left = ex.none_left_since + self.settings.comeback_wait_s - now
        if left <= 0:
            return False
        try:
            async with asyncio.timeout(left):
                await self._push_seen.wait()
        except TimeoutError:
            return False
        # A push: the backends it serves are tried afresh, those this request tried before
        # too (an engine that refused it may be the one back, as a new process at its URL).
        ex.tried.clear()
        return True

    def sync_affinity(self) -> None:
        """A push arrived: the policy forgets backends that left, restarted or were refit, and
        the engines that publish KV events are listened to."""
        if self.affinity is not None:
            pool = self.pool
            facts = pool.all_facts()
            self.affinity.sync(pool.serving, {
                u: (f.incarnation, f.weight_version) for u, f in facts.items()})
            self._sync_kv_events()

    def _sync_kv_events(self) -> None:
        """Listen to the KV events of every serving backend that publishes them (asked at its
        ``/kv_event_sources`` once per incarnation); stop listening to those that left."""
        events = self.kv_events
        if events is None:
            return
        serving = set(self.pool.serving)
        events.keep(serving)
        for url in [u for u in self._kv_asked if u not in serving]:
            del self._kv_asked[url]
        configured = self._kv_configured
        for url in serving:
            named = configured.get(url.rstrip("/"))
            if named is not None:  # the configuration says where: nothing to ask
                events.watch(url, Source(*named))
                continue
            incarnation = self.pool.facts(url).incarnation
            if url in self._kv_asking or (url in self._kv_asked
                                          and self._kv_asked[url] == incarnation):
                continue
            self._kv_asked[url] = incarnation
            task = asyncio.create_task(self._read_kv_sources(url), name=f"kv-sources:{url}")
            self._kv_asking[url] = task
            task.add_done_callback(partial(self._kv_asked_done, url))

    def _kv_asked_done(self, backend: str, _: asyncio.Task[None]) -> None:
        self._kv_asking.pop(backend, None)

    async def _read_kv_sources(self, backend: str) -> None:
        """Where ``backend`` publishes its KV events (vLLM's ``GET /kv_event_sources``), and
        listen there; an engine that does not say is routed by the guess."""
        assert self._client is not None, "Forwarder.open() was not awaited"
        try:
            answer = await self._client.request(
                self._target(backend + "/kv_event_sources"), "GET",
                _with_key([], self.pool.facts(backend).key), b"")
            status = answer.status
            raw = await _read(answer)
            source = sources_of(json.loads(raw), backend) if status == 200 else None
        except (UpstreamError, TimeoutError, ValueError):
            self._kv_asked.pop(backend, None)  # unreachable now: the next push asks again
            return
        if source is not None and self.kv_events is not None and backend in self.pool.serving:
            log.info("KV events of %s: listening at %s", backend, source.endpoint)
            self.kv_events.watch(backend, source)

    def _query(self, body: bytes, session: str | None) -> Query | None:
        """What the cache-aware policy reads of a request; None for a body it cannot read
        (the engine answers that one with its own error)."""
        assert self.affinity is not None
        try:
            parsed = json.loads(body)
        except ValueError:
            return None
        return query_of(parsed, session, self.affinity.settings,
                        self.settings.cache_user_is_session)

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> None:
        s = self.settings
        # No limit on connections: the engines queue; the router never should.
        self._client = UpstreamClient(connect_timeout_s=s.connect_timeout_s,
                                      total_timeout_s=s.backend_timeout_s,
                                      keepalive_timeout_s=s.keepalive_timeout_s,
                                      max_head_bytes=s.max_head_bytes,
                                      max_headers=s.max_headers)
        if self.affinity is not None and self.affinity.precise is not None:
            self.kv_events = KVEvents(self.affinity.precise, clock=time.monotonic)
            self.sync_affinity()  # the backends it was given: theirs are listened to at once

    async def close(self) -> None:
        for task in [*self._learning.values(), *self._kv_asking.values()]:
            task.cancel()
        self._learning.clear()
        self._kv_asking.clear()
        if self.kv_events is not None:
            await self.kv_events.close()
            self.kv_events = None
        if self._client is not None:
            await self._client.close()
            self._client = None

    # ------------------------------------------------------------------ control

    def rescue(self, backend: str, *, streams: bool = True) -> int:
        """Cancel the requests on ``backend``: those waiting with nothing sent to their client
        are re-sent elsewhere at once; streams whose answer has begun go on elsewhere from
        where they are (or end with an error event where they cannot). ``streams`` False
        leaves the streams whose answer has begun to finish there (the trainer's sleep
        bracket: its engine still works until it is asked to sleep). Returns how many."""
        holds = set(self._waiting.pop(backend, {}))
        if streams:
            holds |= self._streaming.pop(backend, set())
        if not holds:
            return 0
        for hold in holds:
            hold.interrupt()  # the request moves on from its wait at once
        self.stats.rescues += len(holds)
        return len(holds)

    def weights_changing(self, backend: str, version: int) -> int:
        """``backend``'s engine is about to load ``version`` with the requests on it kept
        (vLLM's ``pause?mode=keep``: they go on under the new weights). Each request there now
        (waiting for its head, or streaming) may end with tokens of both: its answer names
        every version (:func:`_response_headers`, and a stream's last event). One that ends
        before the pause is named so too: the label may list a version that produced none of
        its tokens, never leave out one that did. Returns how many were marked."""
        holds = [*self._waiting.get(backend, {}), *self._streaming.get(backend, ())]
        marked = 0
        for hold in holds:
            if hold.crossed is not None and version not in hold.crossed[-1:]:
                hold.crossed.append(version)
                marked += 1
        return marked

    def hedge(self, backend: str, held_s: float, *, lost_race_fails: bool = False) -> int:
        """Send each request that has waited on ``backend`` for at least ``held_s`` with nothing
        sent to its client (and is not a stream, nor hedged already) to another backend as
        well; the first answer is the client's. Each hedge takes a retry-budget token while in
        flight unless ``backend`` is out of the serving set; a hedge for which no token or no
        other backend is left is not sent (a later call may). A stream the router continues,
        held there as long (waiting for its head, or with no event since), cannot have two
        engines write to its client: it is moved instead (:meth:`_move_streams`). Returns how
        many were sent or moved.

        ``lost_race_fails``: a held request that loses its race, or a stream moved, is a failed
        attempt of ``backend`` (the caller knows no step is in progress there: a lost core);
        otherwise it only leaves this router's list until the next push (a long step looks the
        same as a wedge until it ends)."""
        moved = self._move_streams(backend, held_s, lost_race_fails)
        waiting = self._waiting.get(backend)
        if not waiting:
            return moved
        pool = self.pool
        budget = pool.retry_budget
        free = backend not in pool.serving
        now = asyncio.get_running_loop().time()
        sent = 0
        for scope, (since, ex) in list(waiting.items()):
            if ex is None or now - since < held_s or scope in self._hedging:
                continue  # a stream (moved above), a hedge's own wait, or not held that long
            other = pool.pick([*ex.tried, backend], None, min_version=ex.min_version)
            if other is None:
                continue  # no other backend for this one (its weight version, say)
            if not free and not budget.try_acquire():
                break  # the fleet's retry budget is spent: the next call may find a token
            ex.tried.append(other)
            # In flight on ``other`` from now, so the next pick of this call sees it (several
            # held requests' hedges spread as requests do).
            pool.dispatched(other)
            task = asyncio.create_task(
                self._hedge(scope, backend, ex.request, ex.body, ex.headers, other),
                name=f"hedge:{other}")
            # Whatever ends it: a task cancelled before its first step (its original answered
            # in the same turn of the loop) runs none of its own code.
            task.add_done_callback(partial(_hedge_ended, pool, other))
            if not free:
                task.add_done_callback(lambda _: budget.release())
            self._hedging[scope] = task
            if lost_race_fails:
                self._races_fail.add(scope)
            sent += 1
        self.stats.hedges += sent
        if sent:
            log.info("hedged %d request(s) held on %s", sent, backend)
        return moved + sent

    def _move_streams(self, backend: str, held_s: float, lost_race_fails: bool) -> int:
        """Move the streams the router continues that ``backend`` has held for ``held_s`` with
        nothing received, where another backend could take them: each goes on elsewhere at
        once, from where it is (from the start if its client has nothing yet), as a rescue
        moves it. Where a waiting request's hedge
        would have won the race, the engine held the stream without a step while the fleet
        moved it: the attempt ends ``hedged``, a lost race (:meth:`forward`), which fails the
        engine only with ``lost_race_fails``; it moves the load rather than adding to it, so it
        takes no token of the retry budget."""
        now = asyncio.get_running_loop().time()
        waiting = self._waiting.get(backend, {})
        held = [hold for hold, (since, _) in waiting.items()
                if hold.stream is not None and now - since >= held_s
                and self._elsewhere(hold.stream, backend)]
        for hold in held:
            del waiting[hold]
        streaming = self._streaming.get(backend, set())
        relayed = [hold for hold in streaming
                   if now - hold.since >= held_s and hold.stream is not None
                   and self._elsewhere(hold.stream, backend)]
        streaming.difference_update(relayed)
        held += relayed
        for hold in held:
            hold.interrupt(Cause.HEDGED)
            if lost_race_fails:
                self._races_fail.add(hold)
        if held:
            self.stats.rescues += len(held)
            log.info("moved %d stream(s) held on %s with nothing received for %g s", len(held),
                     backend, held_s)
        return len(held)

    def _elsewhere(self, stream: _Stream, backend: str) -> bool:
        """Whether another backend could take ``stream`` off ``backend`` now: where none could,
        moved it would end (with an error event, or refused), so it waits on, as a request is
        not hedged where no other backend is left."""
        exclude = [*stream.tried, backend]
        if stream.began:
            return self.pool.pick_same_weights(stream.weight_version, exclude) is not None
        return self.pool.pick(exclude, min_version=stream.min_version) is not None

    def silent(self, after_s: float) -> dict[str, float]:
        """Backends holding a request while they have answered nothing for at least
        ``after_s``: ``{backend: seconds}``, the oldest request's wait or, where the engine
        answered another request since it began, the time since that answer. A stream counts
        from its send as a waiting request does, and from each event it receives: one whose
        engine stops after its head (or mid-answer) is held there, silent, like a request
        waiting for its head. An engine that answers others while requests queue there is
        saturated, not silent: only an engine that answers nothing at all is."""
        now = asyncio.get_running_loop().time()
        out: dict[str, float] = {}
        for backend in self._waiting.keys() | self._streaming.keys():
            sinces = [since for since, _ in self._waiting.get(backend, {}).values()]
            sinces += [hold.since for hold in self._streaming.get(backend, ())]
            if sinces:
                oldest = now - max(min(sinces), self._heard.get(backend, -math.inf))
                if oldest >= after_s:
                    out[backend] = oldest
        return out

    def forget_idle(self, keep: set[str]) -> None:
        """Drop bookkeeping for backends that are neither kept nor have anything waiting."""
        for table in (self._waiting, self._streaming):
            for url in [u for u, w in table.items() if not w and u not in keep]:
                del table[url]
        for url in [u for u in self._heard if u not in keep
                    and not self._waiting.get(u) and not self._streaming.get(u)]:
            del self._heard[url]

    # ------------------------------------------------------------------ the request path

    async def forward(self, request: Request) -> StreamResponse:
        """Answer one allowlisted request through the fleet: attempts until one answers or
        the request gives up (:mod:`~fleetwarden.router.retry` says which after each failure;
        this loop does what it says)."""
        started = time.perf_counter()
        self.stats.requests += 1
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        ex = self._exchange(request, body, started)
        if isinstance(ex, Response):
            return ex
        budget = self.pool.retry_budget
        budget.requests_in_flight += 1
        try:
            while True:
                stream = ex.stream
                backend: str | StreamResponse | None
                if stream is not None and stream.began:
                    backend = await self._continue_on(ex, stream)
                else:
                    backend = self._pick(ex)
                    if backend is None:
                        if await self._wait_for_comeback(ex):
                            continue
                        return self._refuse(ex.last, ex.min_version)
                    if ex.none_left_since is not None and isinstance(backend, str):
                        self.stats.comeback_served += 1
                        ex.none_left_since = None
                    ex.crossed.clear()  # sent again from the start: its tokens come afresh
                if not isinstance(backend, str):
                    return backend
                if ex.resend is not None and ex.resend is not AfterFailure.AT_ONCE:
                    self.stats.retries[ex.resend.value] += 1
                ex.tried.append(backend)
                answer = await self._attempt(ex, backend)
                if not isinstance(answer, _Failure):
                    ex.answered = True
                    return answer
                if answer.cause is Cause.ABORTED or (
                        answer.cause is Cause.STREAM_ERROR and stream is not None
                        and stream.splice.error is ABORTED_ERROR):
                    self._aborted(answer)
                ex.answered = ex.answered or (stream is not None and stream.began)
                step = self._after_failure(ex, answer)
                if not step.resends:
                    return await self._give_up(ex, answer, step)
        finally:
            if ex.held:
                self._settle_held(ex)
            budget.requests_in_flight -= 1
            if ex.retries is not None:
                ex.retries.release()

    async def _read_body(self, request: Request) -> bytes | Response:
        """The client's whole body, or the answer to a client that sent too much or stalled."""
        length = request.content_length
        if length is not None and length > self.settings.max_body_bytes:
            return self._too_large()
        try:
            if request.body_arrived:
                # The whole body has arrived (a small one comes with its headers): reading it
                # cannot stall, so no timer is set and cancelled for it.
                return await request.read()
            async with asyncio.timeout(self.settings.client_body_timeout_s):
                return await request.read()
        except BodyTooLarge:
            return self._too_large()
        except TimeoutError:
            # A client that sent its headers and stalled: no backend was picked yet, so it
            # held nothing but this handler, which it now gives back.
            self.stats.responded(408)
            return error_response(
                408, f"The request body did not arrive within "
                f"{self.settings.client_body_timeout_s:g} s.", "request_timeout")

    def _exchange(self, request: Request, body: bytes, started: float) -> _Exchange | Response:
        """What every attempt of ``request`` sends, read once; or the answer to a request the
        router refuses as it came (a malformed minimum weight version, JSON nested too deep)."""
        # One pass over the headers as they came: what is forwarded, and what the router reads.
        headers: RawHeaders = []
        connection = session_value = min_value = None
        session_header = self._session_header
        for name, value in request.raw_headers:
            lowered = name.lower()
            if lowered in _NOT_FORWARDED:
                if lowered == b"connection" and connection is None:
                    connection = value
                continue
            if lowered == session_header and session_value is None:
                session_value = value
            elif lowered == _MIN_VERSION and min_value is None:
                min_value = value
            headers.append((name, value))
        if connection is not None:  # headers it names are hop-by-hop too
            named = {t.strip().lower() for t in connection.split(b",")}
            headers = [(k, v) for k, v in headers if k.lower() not in named]
        session = (None if session_value is None
                   else session_value.decode("utf-8", "surrogateescape"))
        min_version = _min_version(min_value)
        if isinstance(min_version, Response):
            self.stats.responded(min_version.status)
            return min_version
        stream = None
        if self.settings.continue_streams:
            try:
                read = read_stream_request(request.path, body, request.headers,
                                           assemble_answers=self.settings.continue_answers)
            except RecursionError:  # JSON nested deeper than Python's parser goes
                self.stats.responded(400)
                return error_response(400, "The request body is JSON nested too deeply.",
                                      "invalid_request_error")
            if read is not None:
                stream = _Stream(Splice(read), min_version=min_version)
                headers.append(_CLOSE)  # never pooled (router/upstream.py)
        query = None if self.affinity is None else self._query(body, session)
        exchange = _Exchange(request, body, headers, started, session, min_version, stream,
                             query)
        if stream is not None:
            stream.tried = exchange.tried
            stream.crossed = exchange.crossed
        return exchange

    def _after_failure(self, ex: _Exchange, failure: _Failure) -> AfterFailure:
        """What follows a failed attempt (:mod:`~fleetwarden.router.retry`), with the failure
        counted where it counts."""
        stream = ex.stream
        began = stream is not None and stream.began
        step = settle(failure.cause, streamed=stream is not None, began=began,
                      finished=began and stream is not None and stream.splice.finished(),
                      same_5xx_again=failure.cause is Cause.SERVER_ERROR
                      and self._poison(ex, failure))
        if step is None:
            self._count(ex, failure, began)
            if ex.retries is None:  # the first failure that counts: most requests have none
                ex.retries = Retries(self.pool.retry_budget, self.settings.max_retries)
            step = ex.retries.resend(failure.cause, began=began, replaced=(
                self.health_managed and failure.backend not in self.pool.serving))
        elif step is AfterFailure.AT_ONCE and failure.cause is Cause.HEDGED:
            # A stream moved off an engine that held it without a step (:meth:`_move_streams`):
            # a lost race, that engine's failure only on a lost core; the stream goes on at
            # once, as a rescued one does.
            if failure.race_fails:
                self._count_failure(failure)
            else:
                self._lost_race(failure)
        ex.last, ex.resend = failure, step
        return step

    def _count(self, ex: _Exchange, failure: _Failure, began: bool) -> None:
        """A failure that counts against its engine: reported now or, a 5xx, held back until
        the request's end tells whether the request itself is the problem."""
        if not failure.counted:
            if failure.cause is Cause.SERVER_ERROR and not began:
                # Out of this router's list at once (the reflex), reported when the request
                # ends (:meth:`_settle_held`).
                self._reflex(failure)
                ex.held.append(failure)
            else:
                self._count_failure(failure)

    async def _give_up(self, ex: _Exchange, failure: _Failure, step: AfterFailure
                       ) -> StreamResponse:
        """The answer of a request that is re-sent no more (``step``)."""
        if step is AfterFailure.WHOLE:
            # Its final chunk was read: the generation is whole whatever became of [DONE], a
            # success of the engine, never continued past its end.
            assert ex.stream is not None
            self._whole(failure.backend, ex.stream.splice)
            return await self._end_whole(ex.request, ex.stream, failure.backend)
        if step is AfterFailure.POISON:
            # The same 5xx from every engine it may try: the request is the problem, not
            # them. None is counted, and their reflex drops are undone (at its end).
            self.stats.poison_requests += 1
            ex.held.append(failure)  # one of the same 5xx: the others are not alone
            return self._pass_through(failure)
        if step is AfterFailure.EXHAUSTED:
            # The router's own trouble: no engine is blamed, none is tried next.
            self.stats.local_exhaustion += 1
            log.warning("%s: %s", failure.backend, _DESCRIPTIONS[failure.cause])
            return self._exhausted()
        # Not re-sent (max_retries, or the fleet's retry budget is spent): the engine's own
        # 5xx goes back as it is; a transport failure gets the router's answer.
        if step is AfterFailure.END_STREAM:
            assert ex.stream is not None
            return await self._end_stream(ex.stream, failure, "retries spent")
        if step is AfterFailure.PASS_THROUGH:
            return self._pass_through(failure)  # the engine's answer, as it stands
        return self._refuse(failure, ex.min_version)

    async def _continue_on(self, ex: _Exchange, stream: _Stream) -> str | StreamResponse:
        """Bytes reached the client: the generation goes on elsewhere, from where it is, on
        the same weights; where it cannot, the stream ends with why."""
        backend = self.pool.pick_same_weights(stream.weight_version, ex.tried)
        while backend is None and await self._wait_for_comeback(ex):
            # None left, one coming: the stream waits for it as a new request would.
            backend = self.pool.pick_same_weights(stream.weight_version, ex.tried)
        if backend is None:
            return await self._end_stream(stream, ex.last,
                                          "no other backend with the same weights")
        if ex.none_left_since is not None:
            self.stats.comeback_served += 1
            ex.none_left_since = None
        # The limits of the engine that began it, learnt before (never read here, outside
        # every rescue and hedge); a chat with no limit on an engine whose context length is
        # not known yet is refused.
        limits, began_on = self.limits, stream.began_on
        no_limit = stream.splice.names_no_limit()
        plan = stream.splice.continuation(
            max_model_len=None if began_on is None else limits.context.get(began_on),
            upstream_fields=self._takes_fields(backend),
            output_cap=limits.output_cap(began_on, no_limit),
            next_output_cap=limits.output_cap(backend, False),
            cap_unknown=limits.cap_unknown(began_on, backend))
        if isinstance(plan, str):
            if stream.response is not None:
                return await self._end_stream(stream, ex.last, plan)
            # An answer being assembled that cannot go on exactly: nothing reached its
            # client, so it is sent again from the start instead.
            stream.splice = Splice(stream.splice.request)
            stream.continuation = None
        else:
            stream.continuation = plan
        if self.affinity is not None and ex.query is not None:
            self.affinity.moved(ex.query, backend, time.monotonic())
        return backend

    def _pick(self, ex: _Exchange) -> str | Response | None:
        """The backend of a first attempt or a re-send from the start, the refusal of a
        request no backend may take, or ``None`` when none is left to try (the caller waits
        for one coming back, or refuses)."""
        affinity, query, tried, min_version = self.affinity, ex.query, ex.tried, ex.min_version
        prefer = None
        if affinity is not None and query is not None and not tried:
            prefer = partial(affinity.choose, query, now=time.monotonic())
        picking = time.perf_counter()
        backend = self.pool.pick(tried, ex.session if not tried else None,
                                 min_version=min_version, prefer=prefer)
        self.stats.picked(time.perf_counter() - picking)
        if backend is None:
            if ex.last is None and min_version is not None and self.pool.serving:
                return self._refuse_version(min_version)
            if ex.held and self._poison(ex, ex.held[-1]):
                # Every engine left that could answer it gave the same 5xx (the others
                # refused it): poison, as in :meth:`_give_up`.
                self.stats.poison_requests += 1
                return self._pass_through(ex.held[-1])
            return None  # nobody left to try
        if ex.stream is not None:
            ex.stream.weight_version = self.pool.facts(backend).weight_version
            ex.stream.splice = Splice(ex.stream.splice.request)  # from the start
        if affinity is not None and query is not None:
            affinity.placed(query, backend, time.monotonic())
        return backend

    async def _attempt(self, ex: _Exchange, backend: str) -> StreamResponse | _Failure:
        """One try on one backend: its answer relayed, or why there is none. A request the
        router does not continue as a stream may be hedged (:meth:`hedge`)."""
        pool = self.pool
        request, body, stream = ex.request, ex.body, ex.stream
        key = backend + request.raw_path  # the request target exactly as the client sent it
        headers = ex.headers
        facts = pool.facts(backend)  # what the push said of it as the attempt leaves
        if stream is not None:
            body = stream.splice.request.body_for(self._takes_fields(backend))
            if stream.began and stream.continuation is not None:
                key = backend + stream.continuation.path
                body = stream.continuation.body
                # A continuation is the router's own request, not the client's: it carries
                # the engine's key where the push gave one (the client's otherwise).
                headers = _with_key(headers, facts.key)
        if self.engine_keys_always:
            headers = _with_key(headers, facts.key)
        target = self._target(key)
        pool.dispatched(backend)
        try:
            sent = time.perf_counter()
            answer, hedge = await self._wait_head(backend, request.method, target, body,
                                                  headers, facts,
                                                  None if stream is not None else ex,
                                                  stream=stream, crossed=ex.crossed)
            if hedge is not None:
                if not isinstance(answer, _Failure):
                    self._drop_hedge(hedge)  # this answer came first
                else:
                    return await self._after_hedge(request, hedge, answer, ex.started,
                                                   ex.crossed)
            if isinstance(answer, _Failure):
                return answer
            return await self._deliver(request, answer, backend, ex.started,
                                       time.perf_counter() - sent, stream, facts, ex.crossed)
        finally:
            pool.finished(backend)

    async def _wait_head(self, backend: str, method: str, target: Address, body: bytes,
                         headers: RawHeaders, facts: BackendFacts,
                         context: _Exchange | None, *, stream: _Stream | None = None,
                         crossed: list[int] | None = None,
                         ) -> tuple[Answer | _Failure,
                                    asyncio.Task[_Won | _Failure] | None]:
        """Send the request to ``backend`` and wait for the head of its answer, in
        ``backend``'s waiting list (a rescue, or the answer of its hedge, ends the wait at
        once). Returns the answer (a 5xx as a failure) and the hedge that was in flight for
        it when the wait ended, if any. ``stream``: the wait of a stream the router continues
        (moved, never hedged)."""
        assert self._client is not None, "Forwarder.open() was not awaited"
        waiting = self._waiting.get(backend)
        if waiting is None:
            waiting = self._waiting[backend] = {}
        hedge: asyncio.Task[_Won | _Failure] | None = None
        race_fails = False
        answer: Answer | _Failure
        hold = _Hold(stream=stream, crossed=crossed)
        waiting[hold] = (asyncio.get_running_loop().time(), context)
        try:
            try:
                upstream = await self._client.request(
                    target, method, headers, body, keep_alive=_CLOSE not in headers)
                self._heard[backend] = asyncio.get_running_loop().time()
                if upstream.status >= 500:
                    answer = await self._server_error(backend, upstream, facts)
                else:
                    answer = upstream  # an event stream's connection is never pooled
            finally:
                waiting.pop(hold, None)
                if self._hedging:
                    hedge = self._hedging.pop(hold, None)
                    race_fails = hold in self._races_fail
                    self._races_fail.discard(hold)
        except asyncio.CancelledError:
            if not hold.caught():  # the client left while both waited
                if hedge is not None:
                    self._drop_hedge(hedge)
                raise
            # Interrupted: the hedge's answer came first, a rescue, or a stream moved.
            if (hedge is not None and hedge.done() and not hedge.cancelled()
                    and isinstance(hedge.result(), _Won)):
                answer = _Failure(backend, Cause.HEDGED, race_fails=race_fails)
            else:
                answer = _Failure(backend, hold.why, race_fails=self._race_fails(hold))
        except TimeoutError as exc:  # the backend timeout
            answer = _Failure(backend, _classify(exc))
        except UpstreamError as exc:
            answer = _Failure(backend, _classify(exc))
        except BaseException:  # the client left while both waited
            if hedge is not None:
                self._drop_hedge(hedge)
            raise
        return answer, hedge

    async def _server_error(self, backend: str, upstream: Answer,
                            facts: BackendFacts) -> _Failure:
        """An engine's 5xx, its body read to ``max_error_body_bytes``: one over it is not waited
        on to its end (its connection is dropped), and what the client may be given of it is
        the router's word, naming the bound."""
        limit = self.settings.max_error_body_bytes
        try:
            body, cut = await upstream.read_at_most(limit)
        except BaseException:
            upstream.close()
            raise
        if not cut:
            return _Failure(backend, Cause.SERVER_ERROR, upstream.status, upstream.raw_headers,
                            body, facts)
        status = upstream.status
        return _Failure(backend, Cause.SERVER_ERROR, status,
                        [(b"Content-Type", b"application/json")],
                        error_body(status, f"Backend {backend} answered {status} with a body "
                                   f"over {limit} bytes (not relayed); it began: "
                                   f"{body[:300].decode(errors='replace')}", "backend_error"),
                        facts)

    async def _deliver(self, request: Request, upstream: Answer,
                       backend: str, started: float, backend_time: float,
                       stream: _Stream | None, facts: BackendFacts,
                       crossed: list[int]) -> StreamResponse | _Failure:
        """Relay an answer whose headers have come (nothing of it reached the client yet)."""
        try:
            if stream is not None:
                if upstream.status == 200 and upstream.content_type == "text/event-stream":
                    return await self._relay_stream(request, upstream, backend, started,
                                                    backend_time, stream, facts)
                if stream.began:  # the continuation was refused: say so, and end
                    answer = (await _read(upstream))[:300].decode(errors="replace")
                    return await self._end_stream(
                        stream, None, f"the next engine answered {upstream.status}: {answer}")
            length = upstream.content_length
            if length is not None and length <= _WHOLE_ANSWER_BYTES:
                # A small answer of known length: taken whole, then sent in one write. Nothing
                # has reached the client yet, so a break here can still be retried, and so can
                # a generation the engine aborted (a search of a few KB).
                whole = await _read(upstream)
                if (upstream.status == 200 and b'"abort"' in whole
                        and _ABORTED.search(whole) is not None):
                    return _Failure(backend, Cause.ABORTED, upstream.status, upstream.raw_headers,
                                    whole, facts)
                return await self._answer_whole(request, upstream, whole, backend, started,
                                                backend_time, facts, crossed)
        except (TimeoutError, UpstreamError) as exc:
            return _Failure(backend, _classify(exc))
        return await self._relay(request, upstream, backend, started, backend_time, facts,
                                 crossed)

    # ------------------------------------------------------------------ hedges

    async def _hedge(self, scope: _Hold, backend: str, request: Request,
                     body: bytes, headers: RawHeaders, other: str,
                     ) -> _Won | _Failure:
        """The hedge of the request waiting in ``scope`` on ``backend``: the same request on
        ``other``, up to its headers. The first of the two to answer wakes or drops the other
        (:meth:`_attempt`); a failure here is counted against ``other`` and leaves the original
        waiting."""
        facts = self.pool.facts(other)
        if self.engine_keys_always:
            headers = _with_key(headers, facts.key)
        sent = time.perf_counter()
        # In ``other``'s waiting list: its silence is seen, a rescue moves it on (it is never
        # hedged itself: the original is its hedge).
        answer, _ = await self._wait_head(other, request.method,
                                          self._target(other + request.raw_path), body,
                                          headers, facts, None, crossed=scope.crossed)
        if isinstance(answer, _Failure):
            if answer.cause is not Cause.RESCUED:
                self._count_failure(answer)
            return answer
        if self._hedging.get(scope) is asyncio.current_task():
            # the original still waits: wake it, this is the client's answer
            scope.interrupt()
        return _Won(other, answer, time.perf_counter() - sent, facts)

    async def _after_hedge(self, request: Request, hedge: asyncio.Task[_Won | _Failure],
                           failure: _Failure, started: float,
                           crossed: list[int]) -> StreamResponse | _Failure:
        """The original attempt ended without an answer while its hedge was in flight (or
        because the hedge's answer came): the hedge's answer is the client's, if it has one."""
        if failure.cause is Cause.HEDGED and not failure.race_fails:
            self._lost_race(failure)
            failure.counted = True
        elif failure.cause is not Cause.RESCUED:
            self._count_failure(failure)  # the original's own failure is evidence all the same
            failure.counted = True
        won = await hedge  # cancelled with this handler, if the client leaves
        if isinstance(won, _Failure):
            return failure
        self.stats.hedges_won += 1
        try:
            return await self._deliver(request, won.upstream, won.backend, started,
                                       won.backend_time, None, won.facts, crossed)
        finally:
            self.pool.finished(won.backend)

    def _drop_hedge(self, hedge: asyncio.Task[_Won | _Failure]) -> None:
        """The original answered first (or its client left): cancel the hedge, or close the
        answer it already has (its engine sees the disconnect and aborts)."""
        if not hedge.done():
            hedge.cancel()
            return
        if hedge.cancelled():
            return
        won = hedge.result()
        if isinstance(won, _Won):
            won.upstream.close()
            self.pool.finished(won.backend)

    def _target(self, key: str) -> Address:
        """Where ``key`` (backend + path) goes, parsed once and cached."""
        target = self._targets.get(key)
        if target is None:
            if len(self._targets) >= _MAX_CACHED_TARGETS:
                self._targets.clear()  # query strings or many restarts: start afresh
            target = self._targets[key] = Address.parse(key)
        return target

    async def _answer_whole(self, request: Request, upstream: Answer,
                            body: bytes, backend: str, started: float,
                            backend_time: float, facts: BackendFacts,
                            crossed: list[int]) -> StreamResponse:
        """Send a complete answer: headers and body in one write."""
        status = upstream.status
        spans = _span_versions(body) if request.path == GENERATE and status == 200 else None
        response = Response(status=status, reason=upstream.reason, body=body,
                                headers=_response_headers(upstream.raw_headers, _NOT_RELAYED_WHOLE,
                                                          facts, crossed, spans))
        if status < 400:
            self.pool.record_success(backend)  # the engine's answer is complete
        try:
            await response.prepare(request)
            self.stats.observe_added_latency(time.perf_counter() - started - backend_time)
            self.stats.responded(status)
            await response.write_eof()
        except ConnectionError:
            pass  # the client left: its loss, not the engine's
        return response

    async def _relay(self, request: Request, upstream: Answer,
                     backend: str, started: float, backend_time: float,
                     facts: BackendFacts, crossed: list[int]) -> StreamResponse:
        """Stream the engine's answer to the client chunk by chunk; count it when complete.
        Its headers go first: a weight load under it later is not named (only the streams the
        router continues end with the versions, :meth:`_relay_stream`)."""
        status = upstream.status
        response = StreamResponse(status=status, reason=upstream.reason,
                                      headers=_response_headers(upstream.raw_headers, _HOP_BY_HOP,
                                                                facts, crossed))
        complete = False
        try:
            try:
                await response.prepare(request)
            except ConnectionError:
                return response  # the client left before its answer began: nothing to count
            # What the router added before the first byte: all of the wait but the answering
            # engine's own time to headers (failed attempts and retries count as added).
            self.stats.observe_added_latency(time.perf_counter() - started - backend_time)
            self.stats.responded(status)
            while True:
                try:
                    chunk = await upstream.readany()
                except (UpstreamError, TimeoutError) as exc:
                    # The engine broke off mid-answer. Its status is already sent, so all that
                    # is left is to make the client see an incomplete response: close.
                    failure = _Failure(backend, _classify(exc))
                    self._count_failure(failure)
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if not chunk:
                    break
                try:
                    await response.write(chunk)
                except ConnectionError:
                    return response  # the client left: not the engine's doing, not counted
            complete = True
            if status < 400:
                self.pool.record_success(backend)
            with contextlib.suppress(ConnectionError):  # the client left after the last byte
                await response.write_eof()
            return response
        finally:
            if not complete:
                upstream.close()  # the engine sees the disconnect and aborts the generation

    async def _relay_stream(self, request: Request, upstream: Answer,
                            backend: str, started: float, backend_time: float,
                            stream: _Stream, facts: BackendFacts) -> StreamResponse | _Failure:
        """Relay a stream event by event through its splice. The client's response begins with
        the first event it is given, so an attempt that fails before that is re-sent from the
        start; one that fails after it is continued (by the caller)."""
        splice = stream.splice
        self._begin_relay(stream, backend)
        streaming = self._streaming.setdefault(backend, set())
        splitter = SseSplitter()
        complete = False
        loop = asyncio.get_running_loop()
        # Its head is no token: the attempt has waited on the engine since it was sent, as a
        # request waiting for its head has (:meth:`silent`).
        hold = _Hold(stream=stream, since=loop.time() - backend_time, crossed=stream.crossed)
        streaming.add(hold)
        try:
            while True:
                try:
                    data = await upstream.readany()
                except (UpstreamError, TimeoutError) as exc:
                    return _Failure(backend, _classify(exc))
                if not data:
                    return _Failure(backend, Cause.RESET)  # it ended without [DONE]
                self._heard[backend] = loop.time()
                # Until its events are written, it waits on its client, not on its engine: a
                # slow reader (the engine done, its answer in buffers) is never held there.
                hold.since = math.inf
                for event in splitter.feed(data):
                    outcome, out = splice.on_event(event)
                    if outcome is EventAction.ENGINE_ERROR:
                        return _Failure(backend, Cause.STREAM_ERROR)
                    if outcome is EventAction.SKIP:
                        continue
                    if splice.request.assemble:
                        if outcome is EventAction.CLIENT_ERROR:
                            # The request's fault (a 4xx error event): its answer is that
                            # error, and the engine did its part.
                            complete = True
                            self.pool.record_success(backend)
                            return await self._answer_assembled(
                                request, stream, upstream, started, backend_time, facts,
                                error=True)
                        if outcome is EventAction.DONE:
                            complete = not splice.ended_by_router()
                            self._whole(backend, splice)
                            return await self._answer_assembled(
                                request, stream, upstream, started, backend_time, facts)
                        continue
                    if outcome is EventAction.DONE:
                        out = _versions_label(stream, facts.weight_version) + out
                    response = await self._send(request, stream, out, upstream, started,
                                                backend_time, facts)
                    if response is None:  # the client left: not the engine's doing
                        assert stream.response is not None
                        return stream.response
                    if outcome is EventAction.DONE:
                        # A stop string the router matched ends it before its engine does:
                        # that engine is let go (it would go on to its limit), as vLLM aborts
                        # a generation its detokenizer stopped.
                        complete = not splice.ended_by_router()
                        self._whole(backend, splice)
                        if self.count_usage:
                            response.usage = _stream_usage(splice)
                        with contextlib.suppress(ConnectionError):
                            await response.write_eof()
                        return response
                hold.since = loop.time()  # waiting on the engine again
        except asyncio.CancelledError:
            if not hold.caught():
                raise  # the client left
            # rescued or moved: it goes on elsewhere
            return _Failure(backend, hold.why, race_fails=self._race_fails(hold))
        finally:
            streaming.discard(hold)
            if not complete:
                upstream.close()  # the engine sees the disconnect and aborts the generation

    def _begin_relay(self, stream: _Stream, backend: str) -> None:
        """An attempt of ``stream`` begins on ``backend``: its splice is told; a first attempt
        notes its engine (whose context a request naming no limit takes); a continuation is
        counted, with the tokens it generates again."""
        splice = stream.splice
        splice.begin_attempt(stream.continuation if stream.began else None)
        if not stream.began:
            stream.began_on = backend
            if splice.names_no_limit():
                self._learn_context(backend)
        if stream.began and stream.continuation is not None:
            self.stats.continuations[stream.continuation.mode.value] += 1
            self.stats.tokens_discarded += len(stream.continuation.replay)

    async def _send(self, request: Request, stream: _Stream, data: bytes,
                    upstream: Answer, started: float,
                    backend_time: float, facts: BackendFacts) -> StreamResponse | None:
        """Write one event to the client, beginning its response with the first; ``None`` if
        the client has left."""
        response = stream.response
        if response is None:
            # The events are the router's to frame: rewritten, continued from another engine or
            # ended with an error event, so an engine's Content-Length would cut them short.
            response = StreamResponse(status=upstream.status, reason=upstream.reason,
                                          headers=_response_headers(upstream.raw_headers,
                                                                    _NOT_RELAYED_WHOLE, facts,
                                                                    stream.crossed))
            stream.response = response
            try:
                await response.prepare(request)
            except ConnectionError:
                return None
            self.stats.observe_added_latency(time.perf_counter() - started - backend_time)
            self.stats.responded(upstream.status)
        try:
            await response.write(data)
        except ConnectionError:
            return None
        stream.splice.events_sent += 1
        return response

    async def _answer_assembled(self, request: Request, stream: _Stream,
                                upstream: Answer, started: float,
                                backend_time: float, facts: BackendFacts, *,
                                error: bool = False) -> StreamResponse:
        """The whole answer to a non-streamed request, assembled from the stream(s); with
        ``error``, the error its stream ended with."""
        headers = _response_headers(upstream.raw_headers, _NOT_RELAYED_WHOLE | {b"content-type"},
                                    facts, stream.crossed)
        status, body = (stream.splice.error_answer() if error
                        else (200, stream.splice.answer()))
        response = Response(status=status, body=body, headers=headers,
                            content_type="application/json")
        stream.response = response
        try:
            await response.prepare(request)
            self.stats.observe_added_latency(time.perf_counter() - started - backend_time)
            self.stats.responded(status)
            await response.write_eof()
        except ConnectionError:
            pass  # the client left: its loss, not the engine's
        return response

    def _takes_fields(self, backend: str) -> bool:
        """Whether ``backend``'s engine takes vLLM's own request fields: its profile's word in
        the controller's push, else the router's ``upstream_fields`` setting."""
        said = self.pool.facts(backend).upstream_fields
        return self.settings.upstream_fields if said is None else said

    def _whole(self, backend: str, splice: Splice) -> None:
        """A generation came whole from ``backend``: a success of the engine, and a
        ``"length"`` finish short of its limit tells that engine's server cap."""
        self.pool.record_success(backend)
        revealed = splice.revealed_cap(self.limits.context.get(backend))
        if revealed is not None:
            self.limits.learn_cap(backend, revealed)

    def forget_limits(self) -> None:
        """A push came: forget the limits of backends that left (one that comes back may have
        been started otherwise), and take the server caps it says (read from the commands
        that started the engines: before any ``"length"`` finish could reveal them), and the
        defaults of a chat that names no limit (its model's generation config, where the
        controller could read it) as the cap of such chats; where it says the cap is unknown,
        continuations there are refused until a finish reveals it."""
        self.limits.forget(set(self.pool.serving))
        for url in self.pool.serving:
            facts = self.pool.facts(url)
            if facts.output_cap_unknown is None:
                self.limits.unknown.pop(url, None)
            elif url not in self.limits.cap:  # not revealed by a finish yet
                self.limits.unknown[url] = facts.output_cap_unknown
            if facts.output_cap is not None:
                self.limits.cap[url] = facts.output_cap
            if facts.output_default is not None:
                self.limits.default_cap[url] = facts.output_default

    def _learn_context(self, backend: str) -> None:
        """Read ``backend``'s context length (``max_model_len`` in ``/v1/models``) in the
        background, once a chat sent without a limit begins there: its continuation keeps the
        context of the engine that began it, and a read on the continuation's own path would
        sit outside every rescue and hedge. Unknown when a cut comes: refused."""
        if backend in self.limits.context or backend in self._learning:
            return
        pushed = self.pool.facts(backend).models
        if pushed and pushed[0].max_model_len is not None:
            # The watchdog read it already and the push said it: nothing to ask.
            self.limits.context[backend] = pushed[0].max_model_len
            return
        task = asyncio.create_task(self._read_context(backend), name=f"context:{backend}")
        self._learning[backend] = task
        task.add_done_callback(partial(self._learnt, backend))

    def _learnt(self, backend: str, _: asyncio.Task[None]) -> None:
        self._learning.pop(backend, None)

    async def _read_context(self, backend: str) -> None:
        """``backend``'s context length, where its ``/v1/models`` says it (unknown otherwise:
        the next chat that begins there asks again)."""
        assert self._client is not None, "Forwarder.open() was not awaited"
        try:
            answer = await self._client.request(self._target(backend + "/v1/models"), "GET",
                                                _with_key([], self.pool.facts(backend).key),
                                                b"")
            value = json.loads(await _read(answer))["data"][0]["max_model_len"]
        except (UpstreamError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return
        if (isinstance(value, int) and not isinstance(value, bool) and value > 0
                and backend in self.pool.serving):
            self.limits.context[backend] = value

    async def _end_whole(self, request: Request, stream: _Stream,
                         backend: str) -> StreamResponse:
        """A generation whose final chunk came (from ``backend``) and whose connection went
        before ``[DONE]``: its client gets its end (the usage it asked for, where the router can
        count it), labelled as one that ended well is (the versions its tokens may come
        from)."""
        splice = stream.splice
        if stream.response is None:  # an answer being assembled: it is whole
            facts = replace(self.pool.facts(backend),
                            weight_version=stream.weight_version)
            response = Response(status=200, body=splice.answer(),
                                headers=_response_headers([], facts=facts,
                                                          crossed=stream.crossed),
                                content_type="application/json")
            stream.response = response
            self.stats.responded(200)
            with contextlib.suppress(ConnectionError):
                await response.prepare(request)
                await response.write_eof()
            return response
        return await self._end_stream(stream, None, "the usage the client asked for was lost "
                                      "with the connection")

    async def _end_stream(self, stream: _Stream, failure: _Failure | None,
                          reason: str) -> StreamResponse:
        """End a begun stream that cannot go on: an error event in the OpenAI shape naming the
        cause, then ``[DONE]``, as vLLM ends a stream that failed. A generation that was
        already whole (its finish came, its end was lost) just ends. Either way, first, the
        event naming the weight versions its tokens may come from, where a load crossed it:
        the label is owed however the stream ends, and a client library stops reading at the
        error event."""
        response = stream.response
        splice = stream.splice
        if response is None:  # an answer being assembled: nothing reached the client yet
            self.stats.stream_ended(reason)
            return self._refuse(failure)
        closing = splice.closing_usage() if splice.finished() else None
        label = _versions_label(stream, stream.weight_version)
        if closing is not None:
            data = label + closing + DONE
        elif splice.finished():
            # Whole, but its usage cannot be counted (no token ids): it ends as a whole answer
            # does, without the usage event, never with an error a client library would raise
            # after it had every token.
            data = label + DONE
        else:
            what = "The stream broke off"
            if failure is not None:
                what = f"Backend {failure.backend} {_DESCRIPTIONS[failure.cause]}"
                if failure.cause is Cause.STREAM_ERROR and isinstance(splice.error, dict):
                    what += f" ({splice.error.get('message')})"
            self.stats.stream_ended(reason)
            data = label + error_event(
                f"{what} after {splice.produced} tokens, and the generation could not be "
                f"continued: {reason}.", "stream_interrupted", 500,
                cause=None if failure is None else failure.cause.value,
                backend=None if failure is None else failure.backend, reason=reason) + DONE
        with contextlib.suppress(ConnectionError):
            await response.write(data)
            await response.write_eof()
        return response

    # ------------------------------------------------------------------ outcomes and answers

    def _aborted(self, failure: _Failure) -> None:
        """An attempt whose engine aborted its generation: counted, and a whole answer's
        tokens (its usage says them) as discarded: the request goes again from the start."""
        self.stats.aborted += 1
        if failure.body:
            with contextlib.suppress(ValueError, RecursionError, AttributeError, TypeError):
                tokens = json.loads(failure.body)["usage"]["completion_tokens"]
                if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
                    self.stats.tokens_discarded += tokens

    def _count_failure(self, failure: _Failure) -> None:
        self._report_failure(failure)
        self._reflex(failure)

    def _poison(self, ex: _Exchange, failure: _Failure) -> bool:
        """Whether ``failure`` (a 5xx) makes the request poison: the same status from every
        engine it may try (:func:`poison_quorum`). Those are the engines that answered it 5xx
        and those it has not tried yet; one that failed it otherwise (refused, reset) could
        not answer it at all, and has no say."""
        pool, held = self.pool, ex.held
        answered_5xx = {h.backend for h in held} | {failure.backend}
        same = {h.backend for h in held if h.status == failure.status} | {failure.backend}
        if len(same) < len(answered_5xx):
            return False  # another 5xx among them: not the same answer everywhere
        untried = {u for u in pool.serving
                   if u not in ex.tried and pool.qualifies(u, ex.min_version)}
        routable = answered_5xx | untried
        return len(same) >= poison_quorum(len(routable), self.settings.max_retries)

    def _settle_held(self, ex: _Exchange) -> None:
        """A request's held 5xx at its end: those :func:`blamed_5xx` names are reported; the
        others were perhaps the request's own, and their reflex drops are undone."""
        pool = self.pool
        answered = ex.answered or (ex.stream is not None and ex.stream.began)
        untried = sum(1 for u in pool.serving
                      if u not in ex.tried and pool.qualifies(u, ex.min_version))
        blamed = blamed_5xx([(h.backend, h.status) for h in ex.held], answered, untried)
        for h in ex.held:
            if h.backend in blamed:
                self._report_failure(h)
            elif self.health_managed:
                pool.undrop(h.backend)

    def _report_failure(self, failure: _Failure) -> None:
        """The failure into the tallies the controller drains, and its evidence stream."""
        self.pool.record_failure(failure.backend)
        self.stats.backend_failed(failure.backend, failure.cause.value)
        if self.on_failure is not None:
            self.on_failure(failure.backend, failure.cause.value)

    def _race_fails(self, hold: _Hold) -> bool:
        """Whether ``hold`` was moved by a hedge that said a lost race fails its engine (spent)."""
        if hold in self._races_fail:
            self._races_fail.discard(hold)
            return True
        return False

    def _lost_race(self, failure: _Failure) -> None:
        """The held attempt lost the race to its hedge: out of this router's list until the next
        push (no new request waits there meanwhile), but no failure of its engine. A hedge is
        sent on a second without a step; a healthy engine in one long step (a long prefill
        before its cadence learned one) looks the same until the step ends, and counted, its
        lost races ejected it from the fleet, to come back only on proof. A wedge is condemned
        by the stall limit, or by the canary that watches a hedged lost core."""
        self.stats.backend_failed(failure.backend, failure.cause.value)
        if len(self.pool.serving) > 1 or failure.backend not in self.pool.serving:
            # Never the last: a lost race is no failure of its engine, and an empty list would
            # answer every request 409 until the next push.
            self._reflex(failure)

    def _reflex(self, failure: _Failure) -> None:
        if self.health_managed and self.pool.drop(failure.backend):
            log.info("reflex drop: %s %s; out until the next push", failure.backend,
                     _DESCRIPTIONS[failure.cause])

    def _pass_through(self, failure: _Failure) -> Response:
        """The engine's own 5xx (or aborted 200), untouched, unless it is the one status never
        to send."""
        if failure.status == FORBIDDEN_STATUS:
            return self._refuse(failure)
        self.stats.responded(failure.status)
        assert failure.headers is not None
        return Response(status=failure.status, body=failure.body,
                            headers=_response_headers(failure.headers, _NOT_RELAYED_WHOLE,
                                                      failure.facts))

    def _refuse(self, failure: _Failure | None, min_version: int | None = None) -> Response:
        """The deliberate answer when the router cannot serve this request (one demanding
        ``min_version``: no backend is left when none holding such weights serves)."""
        pool = self.pool
        none_left = not any(pool.qualifies(u, min_version) for u in pool.serving)
        s = self.settings
        status = s.status_when_none_left if none_left else s.status_when_others_serve
        if failure is None:
            cause, backend = "no_backend", None
            message = "No backend is serving."
        else:
            cause, backend = failure.cause.value, failure.backend
            message = f"Backend {failure.backend} {_DESCRIPTIONS[failure.cause]}"
            if failure.cause is Cause.SERVER_ERROR:
                message += f" ({failure.status})"
            message += "; no backend is left." if none_left else "; other backends still serve."
        headers = None
        if self.retry_after is not None:
            headers = {"Retry-After": str(max(0, math.ceil(self.retry_after)))}
        self.stats.responded(status)
        return error_response(status, message,
                              "no_backend_left" if none_left else "backend_failed",
                              headers, cause=cause, backend=backend)

    def _refuse_version(self, min_version: int) -> Response:
        """No serving backend holds weights at ``min_version`` or later: for this request, no
        backend is left (``status_when_none_left``; never a 504 a client would retry blindly)."""
        held = sorted({v for u in self.pool.serving
                       if (v := self.pool.facts(u).weight_version) is not None})
        status = self.settings.status_when_none_left
        self.stats.responded(status)
        said = ", ".join(map(str, held)) if held else "none known"
        return error_response(
            status, f"No serving backend holds weights of version {min_version} or later "
            f"(serving versions: {said}).", "weight_version_unavailable",
            None, min_weight_version=min_version, serving_versions=held)

    def _exhausted(self) -> Response:
        self.stats.responded(503)
        return error_response(
            503, "The router is out of file descriptors or buffers; try again shortly.",
            "router_exhausted", {"Retry-After": "1"})

    def _too_large(self) -> Response:
        self.stats.responded(413)
        return error_response(
            413, f"Request body larger than {self.settings.max_body_bytes} bytes.",
            "request_too_large")


def _stream_usage(splice: Splice) -> tuple[int, int]:
    """A whole stream's (prompt, completion) tokens: its usage where the engine sent one (the
    whole generation's, across continuations), else the prompt's token ids and the tokens
    produced (the router asks vLLM for the ids)."""
    usage = splice.usage or {}
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int):
        prompt = len(splice.prompt_ids or ())
    if not isinstance(completion, int):
        completion = splice.produced
    return prompt, completion


def _hedge_ended(pool: Pool, backend: str, task: asyncio.Task[_Won | _Failure]) -> None:
    """A hedge's attempt on ``backend`` is no longer in flight, unless it won: then its
    answer is, until the client has it or it is dropped (:meth:`Forwarder._after_hedge`,
    :meth:`Forwarder._drop_hedge`)."""
    if task.cancelled() or task.exception() is not None or not isinstance(task.result(), _Won):
        pool.finished(backend)
