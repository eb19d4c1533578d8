"""One question asked of an engine over HTTP: does it answer ``/health``?

Owns: :func:`health_status` (the status code, or why there was none, never an exception) and
:func:`describe` (a network error in a few words). The watchdog, the launchers' readiness
waits, the attach launcher and the restore's adoption all ask through these.

Must not: judge. What a status means for a shard is the judge's and the ledger's business;
how long to wait, and how often, is the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

__all__ = ["describe", "health_status"]


async def health_status(session: aiohttp.ClientSession, url: str, *,
                        read_timeout: aiohttp.ClientTimeout | None = None,
                        headers: Mapping[str, str] | None = None) -> int | str:
    """``GET url`` (an engine's health path): its status code, or why there was none, within
    ``read_timeout`` (the session's timeout when ``None``); ``headers``: the engine's key, if
    it wants one (``credentials.Secret.bearer``).

    Only the first chunk of the body is read: ``/health`` is empty, and a large body (a
    proxy's page) is never worth reading."""
    try:
        # the session's own timeout unless the caller names one
        request = (session.get(url, headers=headers) if read_timeout is None
                   else session.get(url, timeout=read_timeout, headers=headers))
        async with request as resp:
            await resp.content.readany()
            return resp.status
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        return describe(e)


def describe(e: BaseException) -> str:
    """A network error in a few words: ``timed out``, ``cannot connect: ...``, or its type."""
    if isinstance(e, TimeoutError):
        return "timed out"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect: {e.os_error.strerror or e.os_error}"
    return f"{type(e).__name__}: {e}".rstrip(": ")
