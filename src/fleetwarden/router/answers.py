"""The router's own answers: what a client is told when the router, not an engine, answers.

Owns: :class:`OwnAnswers` (no backend can serve the request, none holds the weights it asks
for, the router's own exhaustion, a body over the limit), :func:`error_response` (the OpenAI
error shape) and :data:`DESCRIPTIONS` (how each cause of a failed attempt reads in them).
Must not: decide anything: :class:`~fleetwarden.router.forward.Forwarder` says when; this says
what, with the status the settings give (never a 504: clients retry it without bound).
"""

from __future__ import annotations

import math

from fleetwarden.router.exchange import Failure
from fleetwarden.router.pool import Pool
from fleetwarden.router.retry import Cause
from fleetwarden.router.serve import Response, error_body
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.stats import RouterStats

__all__ = ["DESCRIPTIONS", "OwnAnswers", "error_response"]

#: How each cause of a failed attempt reads after "Backend URL".
DESCRIPTIONS = {
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


def error_response(status: int, message: str, error_type: str,
                   headers: dict[str, str] | None = None, **extra: object) -> Response:
    """A JSON error in the OpenAI shape (``{"error": {...}}``), with extra fields if given."""
    return Response(status=status, body=error_body(status, message, error_type, **extra),
                    content_type="application/json", headers=headers)


class OwnAnswers:
    """The deliberate answers of one router, counted in its stats as they are made."""

    def __init__(self, pool: Pool, settings: RouterSettings, stats: RouterStats) -> None:
        self.pool = pool
        self.settings = settings
        self.stats = stats
        #: Seconds a client should wait before retrying, when the caller expects a backend back.
        self.retry_after: float | None = None

    def refuse(self, failure: Failure | None, min_version: int | None = None) -> Response:
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
            message = f"Backend {failure.backend} {DESCRIPTIONS[failure.cause]}"
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

    def refuse_version(self, min_version: int) -> Response:
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

    def exhausted(self) -> Response:
        self.stats.responded(503)
        return error_response(
            503, "The router is out of file descriptors or buffers; try again shortly.",
            "router_exhausted", {"Retry-After": "1"})

    def too_large(self) -> Response:
        self.stats.responded(413)
        return error_response(
            413, f"Request body larger than {self.settings.max_body_bytes} bytes.",
            "request_too_large")
