"""The real llama.cpp tier: a cached prebuilt ``llama-server``, the tiny GGUF, and engines.

Every engine runs in a process group of its own and is stopped as a group, then checked gone,
by its fixture, also when the test fails. A failed install or model write is an error of the
tier, never a skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetwarden.testing.llamacpp_env import (
    ensure_llamacpp_server,
    ensure_tiny_gguf,
    start_llamacpp_engine,
)
from fleetwarden.testing.vllm_engine import LocalEngine


@pytest.fixture(scope="session")
def llama_server() -> Path:
    return ensure_llamacpp_server()[0]


@pytest.fixture(scope="session")
def tiny_gguf(llama_server: Path) -> Path:
    return ensure_tiny_gguf()


@pytest.fixture(scope="module")
def engine(llama_server: Path, tiny_gguf: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    """One real llama-server for the module's tests, up and answering /health; stopped as a
    group however the tests end."""
    eng = start_llamacpp_engine(llama_server, tiny_gguf, tmp_path_factory.mktemp("llama"))
    try:
        eng.wait_ready(timeout_s=30)
        yield eng
    finally:
        stop = eng.stop()
        assert stop.clean, f"engine group {eng.pgid} left {stop.left}"
