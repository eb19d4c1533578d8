"""The demo's timeline: the acts' labels never cover one another, however close the acts
come (src/fleetwarden/timeline.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from fleetwarden.timeline import FULL_ROWS, draw

#: The demo's acts, as it labels them.
ACTS = ["wedge under load (shard 0, vllm)", "crash (shard 1, vllm)",
        "trickle (shard 0, vllm)", "idle wedge (shard 1, vllm)", "saturated but healthy"]


def story(spacing_s: float) -> tuple[list[tuple[float, list[str | None]]], float,
                                     list[tuple[float, str]]]:
    """Two shards over 60 s, the acts ``spacing_s`` apart from 20 s on."""
    marks = [(20.0 + k * spacing_s, label) for k, label in enumerate(ACTS)]
    states: list[tuple[float, list[str | None]]] = [
        (0.0, ["HEALTHY", "HEALTHY"]), (21.0, ["DEAD", "HEALTHY"]),
        (22.0, ["RESTARTING", "HEALTHY"]), (30.0, ["HEALTHY", "HEALTHY"])]
    return states, 60.0, marks


@pytest.mark.parametrize("spacing_s", [1.0, 0.2, 10.0])
def test_no_two_act_labels_meet(spacing_s: float, tmp_path: Path) -> None:
    states, end, marks = story(spacing_s)
    fig, placed = draw(states, end, marks, [], 0.0)
    fig.canvas.draw()  # the final layout, as saved
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = [p.artist.get_window_extent(renderer) for p in placed]
    assert len(boxes) == len(ACTS)
    for (a, pa), (b, pb) in itertools.combinations(zip(boxes, placed, strict=True), 2):
        assert not a.overlaps(b), f"{pa.text!r} row {pa.row} meets {pb.text!r} row {pb.row}"
    for box, p in zip(boxes, placed, strict=True):  # inside the picture, whole
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width, p.text
        assert box.y0 >= 0 and box.y1 <= fig.bbox.height, p.text
    title = fig.axes[0].title.get_window_extent(renderer)
    assert not any(box.overlaps(title) for box in boxes)
    shown = [p.text for p in placed]
    print(f"\n{spacing_s:g} s apart: {shown}, rows {[p.row for p in placed]}")
    if spacing_s >= 10:
        assert shown == ACTS  # room enough: every label whole
    for k, (p, label) in enumerate(zip(placed, ACTS, strict=True), start=1):
        # whole, or the act's name, or (past the rows of words) its number, in the key
        assert p.text in (label, label.split(" (")[0], str(k)), p.text
        assert p.row < FULL_ROWS or p.text == str(k), (p.text, p.row)
    assert placed[0].text == ACTS[0]  # the first act always reads whole
    fig.savefig(tmp_path / "timeline.png", dpi=110)  # it saves as drawn
