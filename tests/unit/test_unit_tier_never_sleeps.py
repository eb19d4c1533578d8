"""The unit tier never sleeps: time is an input (docs/development.md, "Test tiers").

A rule with a time in it is tested by moving a clock across its threshold
(tests/support/clock.py): a :class:`~support.clock.Clock` given as the core's ``clock=``, or
the virtual-time loop and its ``elapse()``. A sleep makes a test slow on every run and wrong
on a loaded machine; a test that needs real time (a real process, a socket's own timeouts)
belongs in tests/scenario/. ``asyncio.sleep(0)`` (one turn of the loop) is no wait.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parent
SLEEPS = {("time", "sleep"), ("asyncio", "sleep")}


def _is_zero(call: ast.Call) -> bool:
    args = [*call.args, *(k.value for k in call.keywords if k.arg == "delay")]
    return (len(args) == 1 and isinstance(args[0], ast.Constant)
            and args[0].value == 0 and not isinstance(args[0].value, bool))


def sleeps_in(source: str) -> list[str]:
    """Every sleep in ``source`` but ``asyncio.sleep(0)``: ``line: what``. Follows the
    imports (``import time as t``, ``from asyncio import sleep as nap``)."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # local name -> "time" / "asyncio"
    functions: dict[str, str] = {}  # local name -> "time.sleep" / "asyncio.sleep"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("time", "asyncio"):
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "asyncio"):
            for alias in node.names:
                if alias.name == "sleep":
                    functions[alias.asname or alias.name] = f"{node.module}.sleep"

    def sleep_named(node: ast.AST) -> str | None:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and (modules.get(node.value.id), node.attr) in SLEEPS):
            return f"{modules[node.value.id]}.sleep"
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            return functions.get(node.id)
        return None

    allowed: set[int] = set()  # the function node of each asyncio.sleep(0)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and sleep_named(node.func) == "asyncio.sleep" \
                and _is_zero(node):
            allowed.add(id(node.func))
    for node in ast.walk(tree):
        name = sleep_named(node)
        if name is not None and id(node) not in allowed:
            found.append(f"{node.lineno}: {name}")  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize(("source", "found"), [
    ("import time\ntime.sleep(0.1)", ["2: time.sleep"]),
    ("import time\ntime.sleep(0)", ["2: time.sleep"]),  # a thread's yield is still a sleep
    ("import asyncio\nasync def f():\n    await asyncio.sleep(0.2)", ["3: asyncio.sleep"]),
    ("import asyncio as aio\nasync def f(s):\n    await aio.sleep(s)", ["3: asyncio.sleep"]),
    ("from asyncio import sleep as nap\nasync def f():\n    await nap(1)", ["3: asyncio.sleep"]),
    ("from time import sleep\nrun(sleep)", ["2: time.sleep"]),  # handed on, not called
    ("import asyncio\nasync def f():\n    await asyncio.sleep(0)", []),
    ("import asyncio\nasync def f():\n    await asyncio.sleep(delay=0)", []),
    ("import asyncio\nasync def f():\n    await asyncio.sleep(0.0)", []),
    ("import asyncio\nasync def f():\n    await asyncio.sleep(False)", ["3: asyncio.sleep"]),
    ("from support.clock import elapse\nasync def f():\n    await elapse(3600)", []),
])
def test_the_check_finds_every_sleep_and_lets_one_turn_of_the_loop_pass(
        source: str, found: list[str]) -> None:
    assert sleeps_in(source) == found


def test_no_file_under_tests_unit_sleeps() -> None:
    sleeping = {str(path.relative_to(UNIT.parent.parent)): found
                for path in sorted(UNIT.rglob("*.py"))
                if (found := sleeps_in(path.read_text()))}
    assert not sleeping, (
        "unit tests never sleep: move a Clock (or the virtual-time loop's elapse()) across "
        "the threshold instead (tests/support/clock.py), or move a test that needs real time "
        f"to tests/scenario/: {sleeping}")
