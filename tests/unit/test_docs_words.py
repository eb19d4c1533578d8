"""Words that lead somewhere: the code and the docs point only to what a reader can open.

No pointer to the seed's system spec (not in the repository: the rules are in docs/design.md)
and no issue number (a reader cannot open one: say the rule, and keep the story in
docs/history.md), in src/, tests/, bench/, examples/, README.md,
BENCHMARKS.md or docs/. Every relative link of README.md, BENCHMARKS.md and docs/ names a file
that exists. README.md is what a newcomer reads first: at most 250 lines, the reference in
docs/. docs/configuration.md holds the current ``fleetwarden config --example``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetwarden.config import example_toml

ROOT = Path(__file__).resolve().parents[2]
#: What a newcomer reads before anything else: longer, and the reference belongs in docs/.
README_MAX_LINES = 250
#: Written in two halves, so that this file does not match itself.
SYSTEM_SPEC = "SYSTEM" + ".md"
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues? #?[0-9]+|" + "#" + r"[0-9]+ of the issue")
TEXT_SUFFIXES = {".py", ".md", ".js", ".html", ".css", ".toml", ".txt", ".sh"}


def _texts() -> list[str]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    for folder in ("src", "tests", "bench", "examples", "docs"):
        files += (p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in TEXT_SUFFIXES and "fixtures" not in p.parts)
    return sorted(str(p.relative_to(ROOT)) for p in files)


def _markdown() -> list[str]:
    return ["README.md", "BENCHMARKS.md",
            *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _texts())
def test_no_pointer_to_a_spec_outside_the_repository_and_no_issue_number(path: str) -> None:
    found = []
    for n, line in enumerate((ROOT / path).read_text(errors="replace").splitlines(), 1):
        if SYSTEM_SPEC in line:
            found.append(f"{path}:{n}: points to {SYSTEM_SPEC} (name the docs/design.md section)")
        if (m := ISSUE_NUMBER.search(line)) and "github.com" not in line:
            found.append(f"{path}:{n}: {m.group(0)!r} (say the rule, not the issue)")
    assert not found, "\n".join(found)


def _anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not (m := re.match(r"#{1,6} (.+)", line)):
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("path", _markdown())
def test_every_relative_link_names_a_file_and_a_heading_that_exist(path: str) -> None:
    here = ROOT / path
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", here.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        file = here.parent / name if name else here
        found = file.exists() and (not anchor or file.suffix != ".md"
                                   or anchor in _anchors(file.read_text()))
        if not found:
            missing.append(target)
    assert not missing, f"{path} links to files or headings that do not exist: {missing}"


def test_the_readme_is_at_most_250_lines() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines: keep it to what a newcomer needs first "
        f"(at most {README_MAX_LINES}) and move the reference into docs/")


def test_the_configuration_reference_is_the_current_example() -> None:
    assert example_toml() in (ROOT / "docs" / "configuration.md").read_text(), (
        "docs/configuration.md must hold `fleetwarden config --example` as it prints now: "
        "paste its output into the block under 'Every key, its default and its reason'")
