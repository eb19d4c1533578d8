"""Reading the package's source as code: what runs when a module is imported.

The tests that hold the code to its shape (purity of the core, no import circle) read modules
with :mod:`ast`, never by importing them.
"""

from __future__ import annotations

import ast


def runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (they never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if id(n) not in skip]
