"""The relay: one answer an engine began, on its way to its client.

Owns: :class:`Relay` (an answer relayed whole, chunk by chunk, or event by event through its
stream's splice; a begun stream's end where it cannot go on; an engine's 5xx passed through),
:class:`Answering` (the one record every step of a relay reads), and the answer headers the
client gets (:func:`response_headers`: the push's facts, never an engine's word for them).
Must not: pick a backend or re-send: an attempt that fails here returns its
:class:`~fleetwarden.router.exchange.Failure`, and the attempt loop
(:class:`~fleetwarden.router.forward.Forwarder`) says what follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from fleetwarden.router.answers import DESCRIPTIONS, OwnAnswers
from fleetwarden.router.exchange import Failure, Hold, Stream, classify
from fleetwarden.router.pool import UNKNOWN_FACTS, BackendFacts, Pool
from fleetwarden.router.retry import Cause
from fleetwarden.router.serve import RawHeaders, Request, Response, StreamResponse
from fleetwarden.router.settings import (
    FORBIDDEN_STATUS,
    GENERATE,
    SHARD_HEADER,
    WEIGHT_VERSION_HEADER,
    WEIGHT_VERSIONS_HEADER,
)
from fleetwarden.router.splice import (
    DONE,
    EngineLimits,
    EventAction,
    Splice,
    SseSplitter,
    assembled_answer,
    error_answer,
    error_event,
)
from fleetwarden.router.stats import RouterStats
from fleetwarden.router.upstream import Answer, UpstreamError
from fleetwarden.router.waiting import WaitingRequests

__all__ = ["HOP_BY_HOP", "Answering", "Relay", "read_all", "response_headers"]

#: Hop-by-hop headers (RFC 9110 section 7.6.1) and those the router recomputes: never forwarded.
#: Lower case, as bytes: headers travel as they came on the wire (``RawHeaders``).
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
})
#: An answer relayed whole is re-framed: its length is recomputed.
_NOT_RELAYED_WHOLE = HOP_BY_HOP | {b"content-length"}
#: The router's word on which weights answered, never an engine's header of the same name.
_FACT_HEADERS = frozenset({WEIGHT_VERSION_HEADER.encode(), WEIGHT_VERSIONS_HEADER.encode(),
                           SHARD_HEADER.encode()})
_WEIGHT_VERSION = WEIGHT_VERSION_HEADER.encode()
_WEIGHT_VERSIONS = WEIGHT_VERSIONS_HEADER.encode()
_SHARD = SHARD_HEADER.encode()
#: Answers of known length up to this size are read whole and sent in one write: a
#: non-streamed completion arrives in one or two TCP segments anyway, and this saves a system
#: call and several awaits per request. Streams (no length) and larger bodies go chunk by chunk.
_WHOLE_ANSWER_BYTES = 256 * 1024
#: A choice the engine aborted, in a whole answer (compact JSON, as vLLM writes it, or spaced).
_ABORTED = re.compile(rb'"finish_reason":\s*"abort"')


@dataclass(slots=True)
class Answering:
    """One answer whose head came, on its way to its client: what every step of its relay
    reads."""

    request: Request
    upstream: Answer
    backend: str
    #: ``time.perf_counter()`` when the request arrived, and the answering engine's own time
    #: to the head: what the router added is the rest.
    started: float
    backend_time: float
    #: What the push said of the backend as the attempt left.
    facts: BackendFacts
    #: The weight versions loaded under it while it was there.
    crossed: list[int]
    #: The stream the router continues; None: an answer relayed as it is.
    stream: Stream | None = None


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


def _versions_label(stream: Stream, version: int | None) -> bytes:
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


def response_headers(upstream: RawHeaders, dropped: frozenset[bytes] = HOP_BY_HOP,
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


async def read_all(upstream: Answer) -> bytes:
    """The whole body; on any interruption the connection is closed, never pooled half-read."""
    try:
        return await upstream.read()
    except BaseException:
        upstream.close()
        raise


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


class Relay:
    """Relays the answers of one router's attempts (:class:`Answering`) to their clients."""

    def __init__(self, pool: Pool, stats: RouterStats, waiting: WaitingRequests,
                 answers: OwnAnswers, limits: EngineLimits, *,
                 count_failure: Callable[[Failure], None],
                 learn_context: Callable[[str], None]) -> None:
        self.pool = pool
        self.stats = stats
        self.waiting = waiting
        self.answers = answers
        self.limits = limits
        #: A failure of an engine found in the relay (it broke off mid-answer): counted there.
        self._count_failure = count_failure
        #: A chat sent with no limit began on this backend: its context length is read.
        self._learn_context = learn_context
        #: Set the tokens of each stream it relays event by event on its response
        #: (``StreamResponse.usage``): the router counts them per client key.
        self.count_usage = False

    async def deliver(self, a: Answering) -> StreamResponse | Failure:
        """Relay an answer whose headers have come (nothing of it reached the client yet)."""
        upstream, backend, stream = a.upstream, a.backend, a.stream
        try:
            if stream is not None:
                if upstream.status == 200 and upstream.content_type == "text/event-stream":
                    return await self._relay_stream(a, stream)
                if stream.began:  # the continuation was refused: say so, and end
                    answer = (await read_all(upstream))[:300].decode(errors="replace")
                    return await self.end_stream(
                        stream, None, f"the next engine answered {upstream.status}: {answer}")
            length = upstream.content_length
            if length is not None and length <= _WHOLE_ANSWER_BYTES:
                # A small answer of known length: taken whole, then sent in one write. Nothing
                # has reached the client yet, so a break here can still be retried, and so can
                # a generation the engine aborted (a search of a few KB).
                whole = await read_all(upstream)
                if (upstream.status == 200 and b'"abort"' in whole
                        and _ABORTED.search(whole) is not None):
                    return Failure(backend, Cause.ABORTED, upstream.status, upstream.raw_headers,
                                   whole, a.facts)
                return await self._answer_whole(a, whole)
        except (TimeoutError, UpstreamError) as exc:
            return Failure(backend, classify(exc))
        return await self._relay(a)

    async def _answer_whole(self, a: Answering, body: bytes) -> StreamResponse:
        """Send a complete answer: headers and body in one write."""
        request, upstream, backend = a.request, a.upstream, a.backend
        status = upstream.status
        spans = _span_versions(body) if request.path == GENERATE and status == 200 else None
        response = Response(status=status, reason=upstream.reason, body=body,
                            headers=response_headers(upstream.raw_headers, _NOT_RELAYED_WHOLE,
                                                     a.facts, a.crossed, spans))
        if status < 400:
            self.pool.record_success(backend)  # the engine's answer is complete
        return await self._send_whole(a, response)

    async def _send_whole(self, a: Answering, response: Response) -> Response:
        """Send an answer that is whole, headers and body in one write; counted as sent."""
        try:
            await response.prepare(a.request)
            self.stats.observe_added_latency(time.perf_counter() - a.started - a.backend_time)
            self.stats.responded(response.status)
            await response.write_eof()
        except ConnectionError:
            pass  # the client left: its loss, not the engine's
        return response

    async def _relay(self, a: Answering) -> StreamResponse:
        """Stream the engine's answer to the client chunk by chunk; count it when complete.
        Its headers go first: a weight load under it later is not named (only the streams the
        router continues end with the versions, :meth:`_relay_stream`)."""
        request, upstream, backend = a.request, a.upstream, a.backend
        status = upstream.status
        response = StreamResponse(status=status, reason=upstream.reason,
                                  headers=response_headers(upstream.raw_headers, HOP_BY_HOP,
                                                           a.facts, a.crossed))
        complete = False
        try:
            try:
                await response.prepare(request)
            except ConnectionError:
                return response  # the client left before its answer began: nothing to count
            # What the router added before the first byte: all of the wait but the answering
            # engine's own time to headers (failed attempts and retries count as added).
            self.stats.observe_added_latency(time.perf_counter() - a.started - a.backend_time)
            self.stats.responded(status)
            while True:
                try:
                    chunk = await upstream.readany()
                except (UpstreamError, TimeoutError) as exc:
                    # The engine broke off mid-answer. Its status is already sent, so all that
                    # is left is to make the client see an incomplete response: close.
                    failure = Failure(backend, classify(exc))
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

    async def _relay_stream(self, a: Answering, stream: Stream) -> StreamResponse | Failure:
        """Relay a stream event by event through its splice. The client's response begins with
        the first event it is given, so an attempt that fails before that is re-sent from the
        start; one that fails after it is continued (by the caller)."""
        upstream, backend, facts = a.upstream, a.backend, a.facts
        splice = stream.splice
        self._begin_relay(stream, backend)
        streaming = self.waiting.streams.setdefault(backend, set())
        heard = self.waiting.heard
        splitter = SseSplitter()
        complete = False
        loop = asyncio.get_running_loop()
        # Its head is no token: the attempt has waited on the engine since it was sent, as a
        # request waiting for its head has (:meth:`WaitingRequests.silent`).
        hold = Hold(stream=stream, since=loop.time() - a.backend_time, crossed=stream.crossed)
        streaming.add(hold)
        try:
            while True:
                try:
                    data = await upstream.readany()
                except (UpstreamError, TimeoutError) as exc:
                    return Failure(backend, classify(exc))
                if not data:
                    return Failure(backend, Cause.RESET)  # it ended without [DONE]
                heard[backend] = loop.time()
                # Until its events are written, it waits on its client, not on its engine: a
                # slow reader (the engine done, its answer in buffers) is never held there.
                hold.since = math.inf
                for event in splitter.feed(data):
                    outcome, out = splice.on_event(event)
                    if outcome is EventAction.ENGINE_ERROR:
                        return Failure(backend, Cause.STREAM_ERROR)
                    if outcome is EventAction.SKIP:
                        continue
                    if splice.request.assemble:
                        if outcome is EventAction.CLIENT_ERROR:
                            # The request's fault (a 4xx error event): its answer is that
                            # error, and the engine did its part.
                            complete = True
                            self.pool.record_success(backend)
                            return await self._answer_assembled(a, stream, error=True)
                        if outcome is EventAction.DONE:
                            complete = not splice.ended_by_router()
                            self.whole(backend, splice)
                            return await self._answer_assembled(a, stream)
                        continue
                    if outcome is EventAction.DONE:
                        out = _versions_label(stream, facts.weight_version) + out
                    response = await self._send(a, stream, out)
                    if response is None:  # the client left: not the engine's doing
                        assert stream.response is not None
                        return stream.response
                    if outcome is EventAction.DONE:
                        # A stop string the router matched ends it before its engine does:
                        # that engine is let go (it would go on to its limit), as vLLM aborts
                        # a generation its detokenizer stopped.
                        complete = not splice.ended_by_router()
                        self.whole(backend, splice)
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
            return Failure(backend, hold.why, race_fails=self.waiting.race_fails(hold))
        finally:
            streaming.discard(hold)
            if not complete:
                upstream.close()  # the engine sees the disconnect and aborts the generation

    def _begin_relay(self, stream: Stream, backend: str) -> None:
        """An attempt of ``stream`` begins on ``backend``: its splice is told; a first attempt
        notes its engine (whose context a request naming no limit takes); a continuation is
        counted, with the tokens it generates again."""
        splice = stream.splice
        splice.begin_attempt(stream.continuation if stream.began else None)
        if not stream.began:
            stream.began_on = backend
            if splice.request.names_no_limit(self.limits.completion_rule(backend)):
                self._learn_context(backend)
        if stream.began and stream.continuation is not None:
            self.stats.continuations[stream.continuation.mode.value] += 1
            self.stats.tokens_discarded += len(stream.continuation.replay)

    async def _send(self, a: Answering, stream: Stream, data: bytes) -> StreamResponse | None:
        """Write one event to the client, beginning its response with the first; ``None`` if
        the client has left."""
        upstream = a.upstream
        response = stream.response
        if response is None:
            # The events are the router's to frame: rewritten, continued from another engine or
            # ended with an error event, so an engine's Content-Length would cut them short.
            response = StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=response_headers(upstream.raw_headers,
                                                               _NOT_RELAYED_WHOLE, a.facts,
                                                               stream.crossed))
            stream.response = response
            try:
                await response.prepare(a.request)
            except ConnectionError:
                return None
            self.stats.observe_added_latency(time.perf_counter() - a.started - a.backend_time)
            self.stats.responded(upstream.status)
        try:
            await response.write(data)
        except ConnectionError:
            return None
        stream.splice.events_sent += 1
        return response

    async def _answer_assembled(self, a: Answering, stream: Stream, *,
                                error: bool = False) -> StreamResponse:
        """The whole answer to a non-streamed request, assembled from the stream(s); with
        ``error``, the error its stream ended with."""
        upstream = a.upstream
        headers = response_headers(upstream.raw_headers, _NOT_RELAYED_WHOLE | {b"content-type"},
                                   a.facts, stream.crossed)
        status, body = (error_answer(stream.splice) if error
                        else (200, assembled_answer(stream.splice)))
        response = Response(status=status, body=body, headers=headers,
                            content_type="application/json")
        stream.response = response
        return await self._send_whole(a, response)

    def whole(self, backend: str, splice: Splice) -> None:
        """A generation came whole from ``backend``: a success of the engine, and a
        ``"length"`` finish short of its limit tells that engine's server cap (any finish:
        the least it can be)."""
        self.pool.record_success(backend)
        rule = self.limits.completion_rule(backend)
        if (tokens := splice.produced_here()) is not None:
            self.limits.produced(backend, tokens, splice.request.names_no_limit(rule))
        revealed = splice.revealed_cap(self.limits.context.get(backend), rule)
        if revealed is not None:
            self.limits.learn_cap(backend, revealed)

    async def end_whole(self, request: Request, stream: Stream,
                         backend: str) -> StreamResponse:
        """A generation whose final chunk came (from ``backend``) and whose connection went
        before ``[DONE]``: its client gets its end (the usage it asked for, where the router can
        count it), labelled as one that ended well is (the versions its tokens may come
        from)."""
        splice = stream.splice
        if stream.response is None:  # an answer being assembled: it is whole
            facts = replace(self.pool.facts(backend),
                            weight_version=stream.weight_version)
            response = Response(status=200, body=assembled_answer(splice),
                                headers=response_headers([], facts=facts,
                                                          crossed=stream.crossed),
                                content_type="application/json")
            stream.response = response
            self.stats.responded(200)
            with contextlib.suppress(ConnectionError):
                await response.prepare(request)
                await response.write_eof()
            return response
        return await self.end_stream(stream, None, "the usage the client asked for was lost "
                                      "with the connection")

    async def end_stream(self, stream: Stream, failure: Failure | None,
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
            return self.answers.refuse(failure)
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
                what = f"Backend {failure.backend} {DESCRIPTIONS[failure.cause]}"
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

    def pass_through(self, failure: Failure) -> Response:
        """The engine's own 5xx (or aborted 200), untouched, unless it is the one status never
        to send."""
        if failure.status == FORBIDDEN_STATUS:
            return self.answers.refuse(failure)
        self.stats.responded(failure.status)
        assert failure.headers is not None
        return Response(status=failure.status, body=failure.body,
                            headers=response_headers(failure.headers, _NOT_RELAYED_WHOLE,
                                                      failure.facts))
