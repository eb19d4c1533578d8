"""A client's request as it arrives: its body read, and what every attempt sends read once.

Owns: :class:`Intake`: the client's body (its size and arrival bounded), the headers forwarded
(hop-by-hop and recomputed ones dropped), the session and minimum weight version read from
them, whether the router continues its stream, and what the cache-aware policy reads of it:
one :class:`~fleetwarden.router.exchange.Exchange` per request; the answer to a request
refused as it came (a body too large or stalled, a malformed minimum version, JSON nested too
deep).
Must not: pick a backend or send anything: the attempt loop
(:class:`~fleetwarden.router.forward.Forwarder`) takes the exchange from here.
"""

from __future__ import annotations

import asyncio
import json

from fleetwarden.router.affinity import Affinity, Query, query_of
from fleetwarden.router.answers import OwnAnswers, error_response
from fleetwarden.router.continuation import read_stream_request
from fleetwarden.router.exchange import CLOSE, Exchange, Stream
from fleetwarden.router.relay import HOP_BY_HOP
from fleetwarden.router.serve import BodyTooLarge, RawHeaders, Request, Response
from fleetwarden.router.settings import MIN_VERSION_HEADER, RouterSettings
from fleetwarden.router.splice import Splice
from fleetwarden.router.stats import RouterStats

__all__ = ["Intake"]

#: The body is buffered and re-sent, so its length is recomputed and there is nothing left to
#: expect; the Host is the backend's.
_NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
_MIN_VERSION = MIN_VERSION_HEADER.encode()
#: Digits of a minimum weight version read (a 64-bit counter has 20).
_MAX_VERSION_DIGITS = 20


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


class Intake:
    """Reads each client request once, into the exchange its attempts share."""

    def __init__(self, settings: RouterSettings, stats: RouterStats, answers: OwnAnswers,
                 affinity: Affinity | None) -> None:
        self.settings = settings
        self.stats = stats
        self.answers = answers
        #: The cache-aware policy's index, whose reading of a request rides on its exchange
        #: (None: least in flight, nothing read).
        self.affinity = affinity
        header = settings.session_header
        self._session_header = None if header is None else header.strip().lower().encode()

    async def read_body(self, request: Request) -> bytes | Response:
        """The client's whole body, or the answer to a client that sent too much or stalled."""
        length = request.content_length
        if length is not None and length > self.settings.max_body_bytes:
            return self.answers.too_large()
        try:
            if request.body_arrived:
                # The whole body has arrived (a small one comes with its headers): reading it
                # cannot stall, so no timer is set and cancelled for it.
                return await request.read()
            async with asyncio.timeout(self.settings.client_body_timeout_s):
                return await request.read()
        except BodyTooLarge:
            return self.answers.too_large()
        except TimeoutError:
            # A client that sent its headers and stalled: no backend was picked yet, so it
            # held nothing but this handler, which it now gives back.
            self.stats.responded(408)
            return error_response(
                408, f"The request body did not arrive within "
                f"{self.settings.client_body_timeout_s:g} s.", "request_timeout")

    def exchange(self, request: Request, body: bytes, started: float) -> Exchange | Response:
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
                stream = Stream(Splice(read), min_version=min_version)
                headers.append(CLOSE)  # never pooled (router/upstream.py)
        query = None if self.affinity is None else self._query(body, session)
        exchange = Exchange(request, body, headers, started, session, min_version, stream,
                             query)
        if stream is not None:
            stream.tried = exchange.tried
            stream.crossed = exchange.crossed
        return exchange


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

