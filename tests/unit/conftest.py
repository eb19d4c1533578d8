"""The unit tier's event loops: a test marked ``virtual_time`` runs on the loop of
tests/support/clock.py, whose time moves only to its next timer (unit tests never sleep)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from support.clock import VirtualTimeLoop


def pytest_asyncio_loop_factories(
        config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], object]]:
    if item.get_closest_marker("virtual_time") is None:
        return {"asyncio": asyncio.new_event_loop}  # the default loop (a hook must name one)
    return {"virtual_time": VirtualTimeLoop}
