"""Waiting in tests, and a port to listen on: the one copy of each the tests share.

A wait polls a condition under a deadline: the deadline is a liveness bound (generous: a
loaded 2-core machine is slow, and a condition that holds returns at once anyway), never a
timing claim, and a wait never sleeps a fixed time that a slow machine could outrun.
``until`` is for a test's event loop, ``wait_until`` for code that has none. Both return the
seconds the wait took. bench/ has its own ``free_port`` in ``bench/_peers.py`` (benchmarks do
not import the tests).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
import time
from collections.abc import Awaitable, Callable

#: How long a wait may last unless its caller says otherwise (a bound, not a wait).
TIMEOUT_S = 30.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound, then closed at once: another process may take
    it before it is used)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


async def until(condition: Callable[[], bool | Awaitable[bool]], timeout: float = TIMEOUT_S,
                what: str = "", every_s: float = 0.05) -> float:
    """Poll ``condition`` (plain or a coroutine function) every ``every_s`` until it holds;
    return the seconds it took. Fails the test after ``timeout`` seconds, naming ``what``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return loop.time() - start
        if loop.time() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what or condition}")
        await asyncio.sleep(every_s)


def wait_until(condition: Callable[[], bool], timeout: float = TIMEOUT_S, what: str = "",
               every_s: float = 0.02,
               ignoring: tuple[type[Exception], ...] = ()) -> float:
    """``until`` without an event loop (``time.sleep`` between polls). A condition that raises
    one of ``ignoring`` counts as not holding yet (an API still starting)."""
    start = time.monotonic()
    while True:
        try:
            if condition():
                return time.monotonic() - start
        except ignoring:
            pass
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what or condition}")
        time.sleep(every_s)
