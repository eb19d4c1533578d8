"""Test helpers in one place: the wait for a condition and the free port are written once.

``until`` was once written seven times and ``free_port`` six, each with its own bounds and
names. The one copy for the tests is ``tests/support/wait.py``; bench/ has its own
``free_port`` in ``bench/_peers.py`` (benchmarks do not import the tests). A module that needs
another default may wrap them (listed below), never write the loop again.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The names a copy would have.
HELPERS = {"until", "_until", "wait_until", "wait_for", "_wait_for", "free_port", "_free_port"}
#: Where each may be defined: the one copy, and thin wrappers that only call it.
ALLOWED = {
    ("tests/support/wait.py", "until"),
    ("tests/support/wait.py", "wait_until"),
    ("tests/support/wait.py", "free_port"),
    ("bench/_peers.py", "free_port"),
    # fleetwarden.testing cannot import the tests: it calls the launcher's free_port.
    ("src/fleetwarden/testing/vllm_engine.py", "free_port"),
    # a longer default bound, passed on to support.wait.until
    ("tests/scenario/test_router_processes.py", "until"),
}


def test_until_and_free_port_are_written_once() -> None:
    folders = [ROOT / "tests", ROOT / "bench", ROOT / "src" / "fleetwarden" / "testing"]
    copies = []
    for path in sorted(p for folder in folders for p in folder.rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                    and node.name in HELPERS and (where, node.name) not in ALLOWED):
                copies.append(f"{where}:{node.lineno} {node.name}")
    assert not copies, (
        "import these from tests/support/wait.py (bench/: bench/_peers.py) instead of "
        f"writing them again: {copies}")
