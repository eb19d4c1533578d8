"""Time as an input: the one clock and the one event loop on it that the unit tier shares.

Unit tests never sleep (docs/development.md, "Test tiers"): a rule with a time in it is tested
by moving a clock across its threshold, one tick before and one after, never by waiting for
the threshold to pass. The core already takes its time as an input, in one of two ways:

* a ``clock=`` callable (the ledger, the supervisor, the controller, the refit coordinator,
  the watchdog): give it a :class:`Clock` and move ``now``;
* the event loop's own time (an ``asyncio.timeout`` around a launch, a backoff timer, a
  controller's loop): run the test on :class:`VirtualTimeLoop` (mark the test
  ``@pytest.mark.virtual_time``, see tests/unit/conftest.py) and let time pass with
  :func:`elapse`. The loop skips straight to its next timer whenever nothing is ready, so a
  test of a 60 s timeout takes microseconds, and never runs late on a loaded machine.

A test that needs real time (a real process, a socket's own timeouts, a thread) belongs in
tests/scenario/, where waiting is what is tested.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

#: One tick of a simulated clock: the step a boundary test takes either side of a threshold.
#: A millisecond is far below every threshold of the policies and far above float rounding
#: at the times the tests use.
TICK_S = 0.001


class Clock:
    """A clock that moves only when the test moves it: pass it as the core's ``clock=``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds``; return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock never goes back: advance({seconds})")
        self.now += seconds
        return self.now


class _SkippingSelector(selectors.DefaultSelector):
    """A selector that answers at once what is ready, and otherwise lets the loop's virtual
    time jump to the next timer instead of blocking until it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only I/O (or another thread) can wake the loop
            return super().select(None)
        assert self.loop is not None
        self.loop.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` moves only to its next timer, when nothing else is ready.

    For tests of the core's own logic, with doubles for every engine and router: a real
    socket or process answers in real time, which this loop would outrun.
    """

    def __init__(self) -> None:
        selector = _SkippingSelector()
        self.now = 0.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.now


async def elapse(seconds: float) -> None:
    """Let ``seconds`` of virtual time pass (every timer due meanwhile runs). Only on a
    :class:`VirtualTimeLoop`: on a real loop it would be a sleep, which a unit test never
    does."""
    loop = asyncio.get_running_loop()
    if not isinstance(loop, VirtualTimeLoop):
        raise AssertionError("elapse() runs on a VirtualTimeLoop only: mark the test "
                             "@pytest.mark.virtual_time (a unit test never sleeps)")
    await asyncio.sleep(seconds)
