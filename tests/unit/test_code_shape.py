"""The code's shape: a function a reader takes in at once, a class that does one job, and
modules that import one another in one direction only.

No function over :data:`MAX_FUNCTION_LINES` lines except the data tables named in
:data:`DATA_TABLES` (a long function is several jobs; split it by job). No class over
:data:`MAX_CLASS_LINES` lines except the data tables named in :data:`DATA_CLASSES`; those
still over it (:data:`CLASSES_TO_SPLIT`) may not grow, and leave the list as they are split.
No import circle among the package's modules, counting imports inside functions (they would
hide one) and leaving out those under ``if TYPE_CHECKING:`` (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

from support.source import runtime_nodes

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_FUNCTION_LINES = 80
#: Functions that are a table of data, not steps: (module path, function name).
DATA_TABLES = frozenset({("fleetwarden/sim/families.py", "__init__")})
#: A class over this many lines holds several jobs (state that its methods share for no
#: reason but that they sit together): split it by job.
MAX_CLASS_LINES = 400
#: Classes that are a table of data, not steps: (module path, class name).
DATA_CLASSES: frozenset[tuple[str, str]] = frozenset()
#: The classes still over :data:`MAX_CLASS_LINES`, each with the most lines it may have: a
#: ceiling at its size when the guard came, so that none grows while it waits to be split.
CLASSES_TO_SPLIT: dict[tuple[str, str], int] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / "fleetwarden").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(tree: ast.Module, known: set[str]) -> set[str]:
    """The package's modules ``tree`` imports at run time (``from a import b``: ``a.b`` when
    that is a module)."""
    out: set[str] = set()
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in known else node.module)
    return out


def test_no_function_is_longer_than_a_reader_takes_in_at_once() -> None:
    long = []
    for path in sorted((SRC / "fleetwarden").rglob("*.py")):
        where = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and (where, node.name) not in DATA_TABLES:
                    long.append(f"{where}:{node.lineno} {node.name}() is {lines} lines")
    assert long == []


def test_no_class_is_longer_than_one_job() -> None:
    long, shrunk, seen = [], [], set()
    for path in sorted((SRC / "fleetwarden").rglob("*.py")):
        where = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (where, node.name) not in DATA_CLASSES:
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                seen.add((where, node.name))
                ceiling = CLASSES_TO_SPLIT.get((where, node.name), MAX_CLASS_LINES)
                if lines > ceiling:
                    long.append(f"{where}:{node.lineno} {node.name} is {lines} lines "
                                f"(at most {ceiling})")
                elif ceiling > MAX_CLASS_LINES and lines <= MAX_CLASS_LINES:
                    shrunk.append(f"{where} {node.name}: split, out of CLASSES_TO_SPLIT")
    assert long == []
    assert shrunk == []  # the list holds only classes still over the line
    assert set(CLASSES_TO_SPLIT) - seen == set()  # and only classes that exist


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle a depth-first walk of ``graph`` finds, as "a -> b -> a"."""
    circles: list[str] = []
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph.get(module, set())):
            if state.get(other) == 1:
                on_path = [*path, module]
                circles.append(" -> ".join([*on_path[on_path.index(other):], other]))
            elif other not in state:
                walk(other, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
    return circles


def test_no_module_of_the_package_imports_one_that_imports_it_back() -> None:
    modules = _modules()
    graph = {name: _imports(ast.parse(path.read_text()), set(modules)) - {name}
             for name, path in modules.items()}
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle_however_long() -> None:
    """The rule can fail: modules that import one another round a loop are a circle."""
    a = ast.parse("from fleetwarden.b import x\n")
    b = ast.parse("import fleetwarden.c\n")
    c = ast.parse("from fleetwarden import a\n")
    known = {"fleetwarden", "fleetwarden.a", "fleetwarden.b", "fleetwarden.c"}
    graph = {"fleetwarden.a": _imports(a, known), "fleetwarden.b": _imports(b, known),
             "fleetwarden.c": _imports(c, known)}
    assert _circles(graph) == ["fleetwarden.a -> fleetwarden.b -> fleetwarden.c -> fleetwarden.a"]
    del graph["fleetwarden.c"]
    assert _circles(graph) == []
