"""The docs by topic, once: docs/design.md says the rules, docs/history.md what came before them,
BENCHMARKS.md the figures of record.

docs/design.md is the four paths and then one section per component, as rules: at most 1,000
lines, and no story in it (no measured figure, no date, no "before"): a rule's history goes to
docs/history.md, its figures to BENCHMARKS.md. Every section the code and the docs cite by number
or by name is there. BENCHMARKS.md opens with its headline table, one row per topic, and then
has one section per topic, undated, each with its table of runs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
BENCHMARKS = ROOT / "BENCHMARKS.md"
#: What a reader takes in as one specification: past it, the rules drown in their own detail.
DESIGN_MAX_LINES = 1000
#: BENCHMARKS.md's first screen: the headline table must begin within it.
FIRST_SCREEN_LINES = 30
HEADLINE = "| topic | figure of record | command | date, machine |"
RUNS = "| date | run | command |"
#: What a story looks like, and so what design.md may not hold: each pattern, and why not.
STORY = {
    "measured": (r"\bmeasured\b", "a measured figure goes to BENCHMARKS.md or docs/history.md"),
    "a date": (r"\b20\d\d-\d\d-\d\d\b", "a dated entry goes to docs/history.md"),
    "a percentile": (r"\bp(50|90|95|99)\b", "latency figures go to BENCHMARKS.md"),
    "a time after a fault": (r"\+\d+(\.\d+)? s\b", "a run's timeline goes to BENCHMARKS.md"),
    "a duration in ms or µs": (r"\d ?(ms|µs)\b", "a cost measured goes to BENCHMARKS.md"),
    "a count of runs": (r"\d (of|in) [\d,]+ (runs|requests|operations)\b",
                        "how often a run saw it is the run's story: docs/history.md"),
    "a before": (r"\bBefore[,:]|\(Before\b|\bbefore this (change|rule)\b",
                 "what a rule replaced goes to docs/history.md"),
}
#: Where the code and the docs cite design.md.
CITING = ("src", "tests", "bench", "examples", "docs")
SECTION_CITE = re.compile(r"design\.md`?,?\s+(?:section\s+)?(\d+(?:\.\d+)?)\b")
NAME_CITE = re.compile(r"design\.md`?,?\s+(?:section\s+)?(?:\d+(?:\.\d+)?,\s+)?\"([^\"]+)\"")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_the_design_is_at_most_1000_lines() -> None:
    n = len(_lines(DESIGN))
    assert n <= DESIGN_MAX_LINES, (
        f"docs/design.md has {n} lines (at most {DESIGN_MAX_LINES}): say each rule in a line or "
        "two, and move its story to docs/history.md")


@pytest.mark.parametrize("kind", sorted(STORY))
def test_the_design_holds_rules_not_their_story(kind: str) -> None:
    pattern, why = STORY[kind]
    found = [f"docs/design.md:{n}: {line.strip()[:90]}"
             for n, line in enumerate(_lines(DESIGN), 1) if re.search(pattern, line)]
    assert not found, f"{kind} in docs/design.md ({why}):\n" + "\n".join(found)


def _citing_texts() -> str:
    files = [ROOT / "README.md", BENCHMARKS]
    for folder in CITING:
        files += (p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in {".py", ".md"} and p != DESIGN
                  and "fixtures" not in p.parts)
    # one line per file: a citation may wrap across a comment's lines
    return "\n".join(" ".join(re.sub(r"^\s*(#:?|//)\s?", "", line) for line in
                              p.read_text(errors="replace").splitlines()) for p in files)


def test_every_section_the_code_cites_is_in_the_design() -> None:
    design = DESIGN.read_text()
    numbers = set(re.findall(r"(?m)^#{2,3} (\d+(?:\.\d+)?)[. ]", design))
    flat = " ".join(design.split())
    texts = _citing_texts()
    missing = sorted({n for n in SECTION_CITE.findall(texts) if n not in numbers})
    assert not missing, f"design.md sections cited but not there: {missing}"
    names = sorted({" ".join(n.split()) for n in NAME_CITE.findall(texts)}
                   - {n for n in NAME_CITE.findall(texts) if " ".join(n.split()) in flat})
    assert not names, f"design.md parts cited by name but not found in it: {names}"


def _topics(text: str) -> list[str]:
    return re.findall(r"(?m)^## (.+)$", text)


def test_the_benchmarks_open_with_the_headline_table_one_row_per_topic() -> None:
    lines = _lines(BENCHMARKS)
    assert HEADLINE in lines[:FIRST_SCREEN_LINES], (
        f"BENCHMARKS.md's first screen must be its headline table, headed {HEADLINE!r}")
    start = lines.index(HEADLINE)
    assert not any(line.startswith("## ") for line in lines[:start]), (
        "nothing but the title and a few lines before the headline table")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    linked = [m.group(1) for row in rows if (m := re.match(r"\| \[([^\]]+)\]\(#", row))]
    assert linked == _topics(BENCHMARKS.read_text()), (
        "the headline table has one row per topic, in the order of the topics' sections, each "
        "linking to its section")


def test_each_benchmark_topic_is_one_undated_section_with_its_runs() -> None:
    text = BENCHMARKS.read_text()
    topics = _topics(text)
    assert len(topics) == len(set(topics)), "each topic is one section"
    dated = [t for t in topics if re.search(r"\b20\d\d-\d\d", t)]
    assert not dated, f"a topic is not a date: its runs are rows of its table: {dated}"
    for topic, body in zip(topics, re.split(r"(?m)^## .+$", text)[1:], strict=True):
        assert RUNS in body, f"{topic!r} has no table of runs ({RUNS})"
        runs = body.split(RUNS, 1)[1].split("\n")[2:]
        runs = [r for r in runs if r.startswith("|")]
        assert runs, f"{topic!r}: its table of runs is empty"
        for row in runs:
            date, run, command = (c.strip() for c in row.strip("|").split(" | ", 2))
            assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), f"{topic!r}: {row[:80]}: a date"
            assert re.match(r"\[.+\]\(docs/history\.md#", run), (
                f"{topic!r}: {row[:80]}: the run links to its record in docs/history.md")
            assert command.startswith("`"), (
                f"{topic!r}: {row[:80]}: the command that produced it")
