"""The demo's timeline picture: shard states as bands, every request's latency, the acts marked.

Owns: drawing it (:func:`draw`) and placing the acts' labels (:func:`place_labels`) so that
none covers another, however close the acts come.
Must not: read a fleet or a clock: it draws the story it is given (``demo.py`` hands it the
states it sampled, its marks and its requests).

Labels are placed by their measured width (the renderer's extent of each text, in pixels),
not by a guess in seconds: one that would run into the label before it in its row goes up a
row; past :data:`FULL_ROWS` rows a label is shortened to the act's name (what comes before
``" ("``), then to its number, which a key under the picture spells out; rows are added only
as a number needs them, so no two labels ever share pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Annotation

__all__ = ["COLOURS", "FULL_ROWS", "Placed", "draw", "place_labels"]

COLOURS = {"HEALTHY": "#2e9e44", "SUSPECT": "#e6b800", "STALE": "#2bb3c0", "DEAD": "#d62728",
           "RESTARTING": "#9467bd", "RETIRED": "#7f7f7f"}
#: Rows of whole labels above the bands: three acts within a label's width of each other
#: still read in full; a fourth is shortened rather than pushing the picture's top away.
FULL_ROWS = 3
#: The labels' font size (points): the picture's smallest legible text, as its legends.
LABEL_POINTS = 8
_GAP_PX = 6.0  # between two labels in a row
_ROW_POINTS = LABEL_POINTS * 1.6  # one row of labels, with its leading
_LIFT_POINTS = 3.0  # between the bands' top and the first row


@dataclass(frozen=True, slots=True)
class Placed:
    """One act's label as drawn: its text, its row above the bands (0: the lowest), and the
    artist (whose extent a test measures)."""

    at: float
    text: str
    row: int
    artist: Annotation


def _shorter(label: str, number: int) -> list[str]:
    """The label's forms, longest first: whole, the act's name, its number."""
    name = label.split(" (", 1)[0]
    return list(dict.fromkeys([label, name, str(number)]))


def place_labels(ax: Axes, marks: Sequence[tuple[float, str]]) -> list[Placed]:
    """Label each mark (seconds, text) above ``ax`` at its time, in rows, so that no label's
    box meets another's (see the module's rule). Call it once the axes' width is final: the
    placement is measured in pixels."""
    from matplotlib.transforms import blended_transform_factory

    fig = ax.figure
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    above = blended_transform_factory(ax.transData, ax.transAxes)
    right_edge = fig.bbox.width - 2.0
    ends: list[float] = []  # per row: the right edge (px) of its last label
    placed: list[Placed] = []
    for number, (t, label) in enumerate(sorted(marks, key=lambda m: m[0]), start=1):
        forms = _shorter(label, number)
        choice: tuple[str, int, bool] | None = None
        for k, text in enumerate(forms):
            last_form = k == len(forms) - 1
            rows = len(ends) + 1 if last_form else FULL_ROWS  # a number may open a row
            for row in range(rows):
                flip = _extent(ax, above, t, text, row, renderer).x1 > right_edge
                # near the right edge: written leftwards, ending at the mark
                box = _extent(ax, above, t, text, row, renderer, flip=flip)
                if row >= len(ends) or box.x0 > ends[row] + _GAP_PX:
                    choice = (text, row, flip)
                    break
            if choice is not None:
                break
        assert choice is not None  # the number always finds a row: a new one at worst
        text, row, flip = choice
        artist = _label(ax, above, t, text, row, flip=flip)
        box = artist.get_window_extent(renderer)
        if row == len(ends):
            ends.append(box.x1)
        else:
            ends[row] = box.x1
        placed.append(Placed(t, text, row, artist))
    return placed


def _extent(ax: Axes, above: Any, t: float, text: str, row: int, renderer: Any, *,
            flip: bool = False) -> Any:
    """The pixel box the label would take (measured, then taken away again)."""
    artist = _label(ax, above, t, text, row, flip=flip)
    box = artist.get_window_extent(renderer)
    artist.remove()
    return box


def _label(ax: Axes, above: Any, t: float, text: str, row: int, *,
           flip: bool = False) -> Annotation:
    return ax.annotate(text, (t, 1.0), xycoords=above,
                       xytext=(-2 if flip else 2, _LIFT_POINTS + row * _ROW_POINTS),
                       textcoords="offset points", fontsize=LABEL_POINTS,
                       ha="right" if flip else "left", va="bottom", annotation_clip=False)


def draw(states: Sequence[tuple[float, Sequence[str | None]]], end: float,
         marks: Sequence[tuple[float, str]], results: Sequence[Any], t0: float,
         path: Path | None = None) -> tuple[Figure, list[Placed]]:
    """The timeline of a story: ``states`` (seconds, each shard's state) sampled until
    ``end``; ``marks`` (seconds, the act's label); ``results`` (each request's ``started``
    on the monotonic clock whose story began at ``t0``, its ``latency_s`` and ``ok``).
    Saved to ``path`` when given (the figure is then closed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [1.2, 1]})
    shards = len(states[-1][1]) if states else 0
    samples = [*states, (end, [None] * shards)]
    for i in range(shards):
        start, current = 0.0, None
        for t, row in samples:
            state = row[i]
            if state != current:
                if current is not None:
                    top.broken_barh([(start, t - start)], (i - 0.4, 0.8),
                                    color=COLOURS.get(current, "#cccccc"))
                start, current = t, state
    top.set_yticks(range(shards), [f"shard {i}" for i in range(shards)])
    top.invert_yaxis()
    top.set_xlim(0, max(end, 1.0))
    top.legend(handles=[Patch(color=c, label=s) for s, c in COLOURS.items()
                        if s != "RETIRED"], loc="upper right", ncol=5, fontsize=LABEL_POINTS)
    ok = [(r.started - t0, r.latency_s) for r in results if r.ok]
    bad = [(r.started - t0, r.latency_s) for r in results if not r.ok]
    if ok:
        bottom.scatter(*zip(*ok, strict=True), s=4, color="#1f77b4", label="answered 200")
    if bad:
        bottom.scatter(*zip(*bad, strict=True), s=12, color="#d62728", marker="x",
                       label="failed")
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("seconds since start")
    bottom.set_title("requests (each dot one request, at its start)")
    if ok or bad:
        bottom.legend(loc="upper right", fontsize=LABEL_POINTS)
    for t, _ in marks:
        for ax in (top, bottom):
            ax.axvline(t, color="black", linestyle="--", linewidth=0.8)
    # The layout first (the axes' width is then final), the labels measured into it, then
    # room above the bands for as many rows as they took, and the title above them.
    top.set_title("shard states", loc="left", pad=_LIFT_POINTS + _ROW_POINTS)
    fig.tight_layout()
    placed = place_labels(top, marks)
    rows = max((p.row for p in placed), default=0) + 1
    top.set_title("shard states", loc="left", pad=_LIFT_POINTS + rows * _ROW_POINTS + 2)
    numbered = [(p, label) for p, (_, label) in zip(placed, sorted(marks, key=lambda m: m[0]),
                                                    strict=True) if p.text != label]
    if numbered:
        key = "   ".join(f"{p.text}: {label}" for p, label in numbered)
        fig.text(0.01, 0.005, key, fontsize=LABEL_POINTS, ha="left", va="bottom")
    extra_in = (rows - 1) * _ROW_POINTS / 72  # the rows above the first, in inches
    height = fig.get_figheight()
    fig.set_figheight(height + extra_in)  # taller, so that the bands keep their height
    top_frac = fig.subplotpars.top * height / (height + extra_in)
    fig.subplots_adjust(top=top_frac, bottom=fig.subplotpars.bottom * height
                        / (height + extra_in) + (0.02 if numbered else 0.0))
    if path is not None:
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return fig, placed
