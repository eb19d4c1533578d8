"""The trace generator: seeded, in Mooncake's format, with the published shape it claims."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from fleetwarden.testing.traces import (
    CONTEXT_HEADROOM,
    TraceShape,
    fit_context,
    generate,
    prompt_text,
    read_jsonl,
    reuse_ratio,
    write_jsonl,
)


def test_the_shape_refuses_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="burst_shape"):
        TraceShape(burst_shape=0)
    with pytest.raises(ValueError, match="prefix_blocks"):
        TraceShape(prefix_blocks=(3, 2))
    with pytest.raises(ValueError, match="shared_prefix_p"):
        TraceShape(shared_prefix_p=1.5)


def test_a_seed_gives_one_trace() -> None:
    shape = TraceShape(requests=50)
    assert generate(shape, 1) == generate(shape, 1) != generate(shape, 2)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_default_trace_has_the_shape_it_documents(seed: int) -> None:
    shape = TraceShape()
    records = generate(shape, seed)
    assert len(records) == shape.requests
    times = [r.timestamp for r in records]
    assert times == sorted(times) and times[0] >= 0
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(times)]
    rate = len(records) / (times[-1] / 1000)
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    inputs = [r.input_length for r in records]
    outputs = [r.output_length for r in records]
    ratio = reuse_ratio(records)
    sessions = {r.session_id for r in records}
    print(f"\nseed {seed}: rate {rate:.2f}/s, inter-arrival CV {cv:.2f}, input mean "
          f"{statistics.mean(inputs):.0f}, output mean {statistics.mean(outputs):.1f}, "
          f"reuse {ratio:.2f}, {len(sessions)} sessions")
    # Bursty (BurstGPT: burstier than Poisson, whose CV is 1) at about the asked rate.
    assert cv > 1.0
    assert 0.6 * shape.rate_per_s < rate < 1.4 * shape.rate_per_s
    # Lengths about the scaled Mooncake means, within their bounds.
    assert 0.7 * shape.input_mean < statistics.mean(inputs) < 1.4 * shape.input_mean
    assert 0.7 * shape.output_mean < statistics.mean(outputs) < 1.3 * shape.output_mean
    assert max(inputs) <= shape.input_max and max(outputs) <= shape.output_max
    # About half the blocks found again (Mooncake's published figure), and real sessions.
    assert 0.4 < ratio < 0.7
    assert len(sessions) < len(records) * 0.7


def test_hash_ids_cover_the_prompt_and_later_turns_extend_the_conversation() -> None:
    shape = TraceShape(requests=120)
    records = generate(shape, 4)
    bt = shape.block_tokens
    for r in records:
        # Mooncake's rule: one id per block, the last one possibly partial.
        assert (len(r.hash_ids) - 1) * bt < r.input_length <= len(r.hash_ids) * bt, r
    last: dict[str, tuple[int, ...]] = {}
    extended = later = 0
    for r in records:
        if r.turn > 0 and r.session_id in last:
            later += 1
            full = last[r.session_id]  # the previous turn's full blocks re-sent first
            extended += r.hash_ids[: len(full)] == full
        last[r.session_id] = r.hash_ids[: r.input_length // bt]
    assert later > 10 and extended >= 0.8 * later, (extended, later)


def test_shared_ids_are_shared_text_and_a_file_round_trips(tmp_path: Path) -> None:
    shape = TraceShape(requests=60)
    records = generate(shape, 7)
    a, b = next((a, b) for i, a in enumerate(records) for b in records[i + 1:]
                if a.hash_ids[0] == b.hash_ids[0])
    common = 0
    while common < min(len(a.hash_ids), len(b.hash_ids)) and \
            a.hash_ids[common] == b.hash_ids[common]:
        common += 1
    ta, tb = prompt_text(a, shape.block_tokens), prompt_text(b, shape.block_tokens)
    assert len(ta) == a.input_length and len(tb) == b.input_length
    shared = min(common * shape.block_tokens, a.input_length, b.input_length)
    assert ta[:shared] == tb[:shared]
    path = tmp_path / "trace.jsonl"
    write_jsonl(records, path)
    assert read_jsonl(path) == records
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 0, "input_length": "x"}\n')
    with pytest.raises(ValueError, match="input_length"):
        read_jsonl(tmp_path / "bad.jsonl")


@pytest.mark.parametrize("max_model_len", [512, 2048])
def test_a_trace_fitted_to_a_context_fits_it_and_keeps_its_reuse(max_model_len: int) -> None:
    shape = fit_context(TraceShape(requests=300), max_model_len)
    budget = max_model_len * CONTEXT_HEADROOM
    assert shape.input_max + shape.output_max <= budget
    records = generate(shape, 1)
    assert max(r.input_length + r.output_length for r in records) <= budget
    # one factor for every length: the proportions, and so the prefix reuse, stay
    assert shape.input_mean / shape.output_mean == pytest.approx(
        TraceShape().input_mean / TraceShape().output_mean)
    assert reuse_ratio(records) > 0.3


def test_a_trace_that_fits_already_is_left_as_it_is() -> None:
    shape = TraceShape()
    assert fit_context(shape, 16384) is shape


def test_fitting_refuses_a_context_too_small_naming_it() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        fit_context(TraceShape(), 1)
    with pytest.raises(ValueError, match="headroom"):
        fit_context(TraceShape(), 512, headroom=0)
