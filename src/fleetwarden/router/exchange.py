"""One client request's way through the backends: the records its attempts share.

Owns: :class:`Attempt` (one try on one backend), :class:`Exchange` (a request across its
attempts), :class:`Stream` (a streamed answer the router continues), :class:`Hold` (one wait
that the fleet may interrupt), what an attempt ends as (:class:`Failure`, or a hedge's
:class:`Won`), and :func:`with_key` and :data:`CLOSE` (the headers of a request the router
makes on its own account, and of one whose connection is never pooled).
Must not: send or decide anything: :mod:`fleetwarden.router.forward` runs the attempt loop,
:mod:`fleetwarden.router.attempts` each attempt, :mod:`fleetwarden.router.waiting` keeps the
waits the fleet's commands act on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleetwarden.router.affinity import Query
from fleetwarden.router.continuation import Continuation
from fleetwarden.router.pool import UNKNOWN_FACTS, BackendFacts
from fleetwarden.router.retry import AfterFailure, Cause, Retries
from fleetwarden.router.serve import RawHeaders, Request, StreamResponse
from fleetwarden.router.splice import Splice
from fleetwarden.router.upstream import (
    Address,
    Answer,
    ConnectFailed,
    ConnectTimeout,
    LocalExhaustion,
)

__all__ = ["CLOSE", "Attempt", "Exchange", "Failure", "Hold", "Stream", "Won", "classify",
           "with_key"]

#: The header of a request whose connection is never pooled (a stream the router continues:
#: router/upstream.py); an attempt that carries it asks for no keep-alive.
CLOSE = (b"Connection", b"close")


def classify(exc: BaseException) -> Cause:
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
class Failure:
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
class Won:
    """A hedge's answer that arrived first: its headers are in, nothing reached the client."""

    backend: str
    upstream: Answer
    backend_time: float
    facts: BackendFacts


@dataclass(slots=True)
class Attempt:
    """One try of a request on one backend, as it leaves: where it goes and what it sends."""

    backend: str
    method: str
    target: Address
    body: bytes
    headers: RawHeaders
    #: What the push said of the backend as the attempt left.
    facts: BackendFacts
    #: Its request, where a hedge may race it; None: a stream the router continues (moved,
    #: never hedged) or a hedge's own wait.
    hedgeable: Exchange | None = None
    #: The stream the router continues whose attempt this is.
    stream: Stream | None = None
    #: Where a weight load on its backend is noted (its request's ``crossed``).
    crossed: list[int] | None = None


@dataclass(slots=True, eq=False)
class Exchange:
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
    stream: Stream | None
    #: What the cache-aware policy reads of it (None without that policy, or unreadable).
    query: Query | None
    tried: list[str] = field(default_factory=list)
    #: The last failed attempt, and the step it led to.
    last: Failure | None = None
    resend: AfterFailure | None = None
    #: Its paid retries, from its first failure that counts against an engine.
    retries: Retries | None = None
    #: The 5xx not yet reported against their backends: whether the request is poison (the
    #: same 5xx from every engine it may try) is known only when it ends, and a request that
    #: fails everywhere must eject no engine it touched. Reported when it ends, as
    #: :func:`blamed_5xx` says; the reflex drops of the others are undone.
    held: list[Failure] = field(default_factory=list)
    #: An engine answered the request (a whole answer, or a stream's first bytes).
    answered: bool = False
    #: When it first found no backend left while one was coming back (the start of its
    #: wait, ``comeback_wait_s`` at most); None: it has not, or a backend took it since.
    none_left_since: float | None = None
    #: The weight versions loaded into its engine while it was there
    #: (``WaitingRequests.weights_changing``): its tokens may come from each, after the
    #: version it began on.
    crossed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Stream:
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
    #: could go next (:meth:`~fleetwarden.router.waiting.WaitingRequests._elsewhere`).
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


class Hold:
    """A request's wait on a backend that the controller may interrupt (a rescue) or its hedge
    may end (its answer came first): the wait's task is cancelled, and the wait, catching that,
    asks :meth:`caught` whether it was this interrupt (then it moves on) or its client leaving
    (then it ends). What ``asyncio.timeout(None)`` with ``reschedule(now)`` did, without its
    ``async with`` (5 µs a request, measured under uvloop); the same cancel-count rule, so a
    client that leaves at the same moment still ends its handler."""

    __slots__ = ("_cancelling", "_interrupted", "_task", "crossed", "since", "stream", "why")

    def __init__(self, *, stream: Stream | None = None, since: float = 0.0,
                 crossed: list[int] | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self._interrupted = False
        #: The stream the router continues whose wait this is: moved, never hedged.
        self.stream = stream
        #: For a stream relayed (``WaitingRequests.streams``): the loop time since which it
        #: has waited on its engine with nothing received (what ``WaitingRequests.silent``
        #: reports; infinity while it is written to its client: then it waits on nobody's
        #: engine).
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


def with_key(headers: RawHeaders, key: str | None) -> RawHeaders:
    """``headers`` with ``Authorization: Bearer key`` in place of any the client sent, for a
    request the router makes on its own account; as they are without a key."""
    if key is None:
        return headers
    kept = [(k, v) for k, v in headers if k.lower() != b"authorization"]
    return [*kept, (b"Authorization", b"Bearer " + key.encode("latin-1", "replace"))]
