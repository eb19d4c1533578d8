"""The pure core is pure: what the Makefile's CORE lists does no I/O and reads no clock.

"Pure" here means: no module that does I/O or concurrency is imported at run time (type-only
imports under ``if TYPE_CHECKING:`` do not run), no clock or sleep is called, no file is
opened, and every fleetwarden module imported is itself pure. A clock may be *named* as a
default (``clock=time.monotonic``): the caller's to replace, and never called here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from support.source import runtime_nodes

SRC = Path(__file__).resolve().parents[2] / "src"
MAKEFILE = SRC.parent / "Makefile"

#: Imports that mean I/O, concurrency or the environment.
FORBIDDEN = frozenset({
    "asyncio", "aiohttp", "socket", "os", "subprocess", "sqlite3", "pathlib", "io", "shutil",
    "tempfile", "threading", "multiprocessing", "signal", "select", "selectors", "urllib",
    "http", "requests", "uvloop", "ray", "logging", "datetime", "sys",
})
#: Calls that read a clock, wait, or open a file.
CLOCK_CALLS = frozenset({"time", "monotonic", "perf_counter", "time_ns", "monotonic_ns",
                         "perf_counter_ns", "sleep", "now", "utcnow", "today"})


def core_modules() -> list[str]:
    """The CORE list of the Makefile, as module names."""
    text = MAKEFILE.read_text()
    block = re.search(r"^CORE := (.*?)(?=^\S)", text, re.S | re.M)
    assert block is not None, "the Makefile has no CORE list"
    paths = re.findall(r"src/(fleetwarden/\S+)\.py", block.group(1))
    assert paths, "the CORE list is empty"
    return [p.replace("/", ".") for p in paths]


def imports(nodes: list[ast.AST]) -> set[str]:
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def problems(module: str, pure: set[str]) -> list[str]:
    path = SRC / (module.replace(".", "/") + ".py")
    nodes = runtime_nodes(ast.parse(path.read_text()))
    found = []
    for name in sorted(imports(nodes)):
        top = name.split(".")[0]
        if top in FORBIDDEN:
            found.append(f"imports {name}")
        if top == "fleetwarden" and name not in pure and name != "fleetwarden":
            found.append(f"imports {name}, which is not in the pure core")
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("open", "input", "print"):
            found.append(f"calls {f.id}() on line {node.lineno}")
        if isinstance(f, ast.Attribute) and f.attr in CLOCK_CALLS and \
                isinstance(f.value, ast.Name) and f.value.id in ("time", "datetime", "date"):
            found.append(f"reads the clock: {ast.unparse(f)}() on line {node.lineno}")
    return found


CORE = core_modules()


@pytest.mark.parametrize("module", CORE)
def test_a_core_module_does_no_io_and_reads_no_clock(module: str) -> None:
    assert problems(module, set(CORE)) == []


def test_the_check_itself_catches_io_and_clocks() -> None:
    """The shell fails it, so the rule can fail: a module that reads the clock or opens
    sockets is not pure, and neither is one that leans on such a module."""
    for shell in ("fleetwarden.journal", "fleetwarden.config", "fleetwarden.watchdog",
                  "fleetwarden.controller"):
        assert problems(shell, set(CORE)), shell
    assert "fleetwarden.journal" not in CORE and "fleetwarden.config" not in CORE


def test_the_routing_policies_are_in_the_core() -> None:
    """The cache-aware policy is pure like the pool it advises (the shell passes the time in)."""
    assert {"fleetwarden.router.pool", "fleetwarden.router.affinity"} <= set(CORE)
