"""Reading vLLM's /metrics, read as a specification (docs/design.md section 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from fleetwarden.engine_metrics import JUDGED, MAX_BODY_BYTES, Sample, Unreadable, parse, reduce

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"
CAPTURES = sorted(p.name for p in FIXTURES.glob("metrics-*.txt"))


def capture(name: str) -> str:
    return (FIXTURES / name).read_text()


def whole_body_sums(text: str) -> dict[str, float]:
    """The slow, obvious reading: parse every family of the body, sum the judged samples."""
    wanted = {f.sample for f in JUDGED.values()}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def test_a_real_vllm_body_reads_as_a_sample() -> None:
    sample = parse(capture("metrics-busy-1.txt"))
    assert sample == Sample(running=4, waiting=0, steps=13722, generation_tokens=29718,
                            prompt_tokens=354, preemptions=0, finished_requests=82,
                            start_time=1.7959730235e9, sleep_level=0,
                            prefix_cache_queries=354, prefix_cache_hits=0)
    assert sample.prefix_cache_hit_rate == 0.0  # the capture's vLLM ran without reuse
    assert sample.incarnation == "1795973023.5"
    assert not sample.idle


@pytest.mark.parametrize("name", CAPTURES)
def test_reducing_the_body_first_changes_nothing_the_judge_reads(name: str) -> None:
    text = capture(name)
    sample = parse(text)
    assert isinstance(sample, Sample)
    expected = whole_body_sums(text)
    for family in JUDGED.values():
        if family.field == "sleep_level":  # read per label, never summed: every capture awake
            assert sample.sleep_level == 0
            continue
        assert getattr(sample, family.field) == expected[family.sample], family.sample


def test_the_reduced_body_is_a_few_lines_of_the_judged_families() -> None:
    text = capture("metrics-busy-1.txt")
    reduced = reduce(text)
    assert len(text.splitlines()) > 600
    # 11 TYPE lines, 17 samples (5 finished reasons, 3 sleep states)
    assert len(reduced.splitlines()) == 28
    assert len(reduced) < len(text) // 30  # 1.5 KB of 52 KB
    assert "_bucket" not in reduced and "_created" not in reduced and "# HELP" not in reduced


def test_every_family_is_summed_over_its_engine_label() -> None:
    """A data-parallel vLLM has one series per engine; the judge sees the whole server."""
    lines = []
    for line in capture("metrics-busy-1.txt").splitlines():
        lines.append(line)
        if line.startswith("vllm:") and 'engine="0"' in line:
            lines.append(line.replace('engine="0"', 'engine="1"'))
    sample = parse("\n".join(lines) + "\n")
    assert isinstance(sample, Sample)
    assert (sample.running, sample.steps, sample.generation_tokens) == (8, 27444, 59436)
    assert sample.finished_requests == 164  # every finished_reason, every engine
    assert sample.start_time == 1.7959730235e9  # one process: not summed


def test_samples_are_matched_by_their_exact_names_never_by_prefix() -> None:
    body = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 2.0
vllm:num_requests_running_by_lora{engine="0"} 99.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 1.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 500.0
vllm:iteration_tokens_total_count{engine="0"} 7.0
vllm:iteration_tokens_total_sum{engine="0"} 500.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0"} 40.0
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0"} 1.7e9
"""
    assert parse(body) == Sample(running=2, waiting=1, steps=7, generation_tokens=40)


def test_optional_families_default_to_zero_and_a_missing_start_time_is_none() -> None:
    sample = parse(reduce(capture("metrics-idle.txt")).replace("process_start_time", "x"))
    assert isinstance(sample, Sample) and sample.start_time is None and sample.incarnation is None
    body = "\n".join(line for line in capture("metrics-idle.txt").splitlines()
                     if "preemptions" not in line)
    assert parse(body) == Sample(running=0, waiting=0, steps=82, generation_tokens=82,
                                 prompt_tokens=42, preemptions=0, finished_requests=8,
                                 start_time=1.7959730235e9, sleep_level=0,
                                 prefix_cache_queries=42)


def test_a_body_without_the_engine_families_is_unreadable_and_says_which() -> None:
    body = "\n".join(line for line in capture("metrics-idle.txt").splitlines()
                     if "iteration_tokens" not in line)
    result = parse(body)
    assert result == Unreadable("lacks vllm:iteration_tokens_total_count")
    assert isinstance(parse(""), Unreadable)


def test_a_judged_family_of_another_type_is_unreadable() -> None:
    body = reduce(capture("metrics-idle.txt")).replace(
        "# TYPE vllm:num_requests_waiting gauge", "# TYPE vllm:num_requests_waiting summary")
    assert parse(body) == Unreadable("vllm:num_requests_waiting is a summary, not a gauge")


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1.0"])
def test_a_value_no_engine_could_report_is_unreadable(value: str) -> None:
    body = reduce(capture("metrics-idle.txt")).replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {value}')
    result = parse(body)
    assert isinstance(result, Unreadable) and "vllm:num_requests_running" in result.reason


def test_a_malformed_line_is_unreadable_not_an_exception() -> None:
    body = reduce(capture("metrics-idle.txt")).replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_running{engine="0",model_name=tiny} 0.0')
    result = parse(body)
    assert isinstance(result, Unreadable) and result.reason.startswith("unparseable")


def test_an_oversized_body_is_refused_unread() -> None:
    body = capture("metrics-idle.txt")
    huge = body + "#" * MAX_BODY_BYTES
    assert parse(huge) == Unreadable(
        f"body of {len(huge)} bytes is over the {MAX_BODY_BYTES}-byte limit")
    assert isinstance(parse(body, max_bytes=len(body)), Sample)
    assert isinstance(parse(body, max_bytes=len(body) - 1), Unreadable)


def test_crlf_line_endings_read_the_same() -> None:
    text = capture("metrics-busy-2.txt")
    assert parse(text.replace("\n", "\r\n")) == parse(text)


def test_the_openmetrics_parser_would_reject_vllm_output() -> None:
    """Why the plain text parser: vLLM says ``version=1.0.0`` but is not OpenMetrics."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om

    with pytest.raises(ValueError):
        list(om(capture("metrics-busy-1.txt")))


# ------------------------------------------------------------------ never raises

REAL = capture("metrics-busy-1.txt")
REAL_LINES = REAL.splitlines(keepends=True)


@given(st.text(max_size=3000))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_any_text_is_a_sample_or_unreadable(text: str) -> None:
    assert isinstance(parse(text), Sample | Unreadable)


@given(st.binary(max_size=3000))
def test_any_bytes_are_a_sample_or_unreadable(body: bytes) -> None:
    assert isinstance(parse(body), Sample | Unreadable)


@given(st.integers(min_value=0, max_value=len(REAL)))
@settings(max_examples=300)
def test_a_truncated_real_body_is_a_sample_or_unreadable(cut: int) -> None:
    result = parse(REAL[:cut])
    assert isinstance(result, Sample | Unreadable)
    if cut < REAL.index("vllm:num_requests_running{"):
        assert isinstance(result, Unreadable)


@given(st.lists(st.sampled_from(REAL_LINES), max_size=200),
       st.lists(st.tuples(st.integers(0, 199), st.integers(0, 200), st.characters()),
                max_size=20))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_real_lines_shuffled_and_mutated_are_a_sample_or_unreadable(
    lines: list[str], edits: list[tuple[int, int, str]]
) -> None:
    for i, at, ch in edits:
        if lines:
            line = lines[i % len(lines)]
            lines[i % len(lines)] = line[:at] + ch + line[at + 1:]
    assert isinstance(parse("".join(lines)), Sample | Unreadable)
