"""tests/conftest.py hands the long files out first: each one it names must still exist, or a
renamed long file would fall back to its collection place unseen."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_every_long_file_named_for_the_order_exists_once() -> None:
    spec = importlib.util.spec_from_file_location("tests_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names: tuple[str, ...] = module.LONG_FILES
    assert len(set(names)) == len(names)
    assert [n for n in names if not (ROOT / n).is_file()] == []
