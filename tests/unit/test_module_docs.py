"""Every module says, in its first lines, what it owns and what it must not touch:
the room for a change is found by reading the first lines of the modules, not the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "fleetwarden"
MODULES = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py"))
#: How far into its docstring a module may say it (its opening paragraphs).
FIRST_LINES = 16


@pytest.mark.parametrize("module", MODULES)
def test_a_module_opens_with_what_it_owns_and_what_it_must_not_touch(module: str) -> None:
    doc = ast.get_docstring(ast.parse((PACKAGE / module).read_text()), clean=True)
    assert doc, f"{module} has no docstring"
    opening = "\n".join(doc.splitlines()[:FIRST_LINES])
    assert "Owns:" in opening and "Must not" in opening, (
        f"{module}: say in its docstring's first lines 'Owns: ...' (what it is the one home of)"
        " and 'Must not: ...' (what it leaves to other modules)")
