"""The simulator's other engines' dialects: each takes every call the engine core
and the server make, the sleep included, which llama.cpp and SGLang export nothing for."""

from __future__ import annotations

import pytest

from fleetwarden.engine_metrics import Sample, parse
from fleetwarden.engines import profile
from fleetwarden.sim.dialects import DIALECTS


@pytest.mark.parametrize("engine", sorted(DIALECTS))
def test_a_dialect_sleeps_without_a_sleep_family_and_still_reads_by_its_profile(
        engine: str) -> None:
    families = DIALECTS[engine]("tiny", max_model_len=512, kv_capacity_tokens=2048)
    families.on_queues(2, 1, 64)
    families.on_sleep(1)  # the server's /sleep: vLLM's gauge only; nothing here to set
    families.on_queues(0, 0, 0)
    families.on_sleep(0)
    body = families.exposition()
    assert b"sleep" not in body
    sample = parse(body, profile=profile(engine),
                   start_header=families.headers().get(profile(engine).start_header or ""))
    assert isinstance(sample, Sample) and sample.idle and sample.sleep_level is None  # unknown
