"""The trace-replay report, regenerated from the runs' rows: one Markdown table of scenario by
router, and a picture per scenario (request latency over the trace, the fault marked, one line
per router), committed under ``bench/`` so that a change shows as a diff.

    python bench/replay.py --routers ... --faults ... --write     # run, then write the report
    python bench/replay_report.py                                  # the report again, no run
    python bench/replay_report.py --add rows.json                  # a --json run's rows added
    python bench/replay_report.py --real                           # the real-vLLM report again

``bench/replay.py --write`` (or ``--add`` with what its ``--json`` wrote) keeps every run's
row (with each request's send time, latency and outcome) in :data:`RUNS`, merged with those
already there (a later run of the same scenario and router replaces the earlier one), and
writes :data:`REPORT` and one ``replay-<fault>.png`` per scenario under :data:`PICTURES`.
Runs on real vLLM engines (``--engines vllm``: their rows say so) have files of their own,
:data:`REAL`, so that neither report replaces the other's rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
#: The rows every report is made from, the report, and where its pictures go.
RUNS = BENCH / "replay-runs.json"
REPORT = BENCH / "replay-report.md"
PICTURES = BENCH / "replay"
#: The same three for runs on real vLLM engines.
REAL = (BENCH / "replay-real-runs.json", BENCH / "replay-real-report.md", BENCH / "replay-real")
#: The order of the table and of the pictures: no fault first, then the engine's faults, then
#: fleetwarden's own, then the mixed run.
ORDER = ("none", "crash", "wedge", "sigstop", "tcp-reset", "blackhole", "slow-drain",
         "rolling-restart", "reload", "router-kill", "fleetwarden-kill", "mixed")
#: The mixed run's faults in the order ``bench/replay.py`` injects them, ``fault_gap_s`` apart
#: (``testing.replay.Mixed``).
MIXED_PARTS = ("crash", "wedge", "tcp-reset")
#: Requests per point of a picture's line: the median latency of this many, in send order.
WINDOW = 5


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` with ``new`` added; a row of the same scenario and router replaces its own."""
    by_key = {(r["fault"], r["router"]): r for r in old}
    by_key.update({(r["fault"], r["router"]): r for r in new})
    return sorted(by_key.values(), key=lambda r: (
        ORDER.index(r["fault"]) if r["fault"] in ORDER else len(ORDER), r["fault"],
        r["router"] != "fleetwarden", r["router"]))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _eject(r: dict[str, Any]) -> str:
    """Time to eject as the faulted engine saw it: its last generation request after the
    fault (and how many came after it)."""
    if r.get("bad_after") is None or r["fault"] in ("sigstop", "slow-drain"):
        return "-"  # bench/replay.py: _LOG_UNREAD
    if not r["bad_after"]:
        return "at once (0)"
    return f"+{r['bad_last_s']:.1f} s ({r['bad_after']})"


def table(rows: list[dict[str, Any]], load: bool = False) -> str:
    """The rows as a Markdown table; ``load``: with the load average each run ended at (a
    shared machine's)."""
    lines = ["| scenario | router | within the SLO | failed | slow | lost after the fault "
             "| time to eject (requests after) | false ejections | cache hits before / during "
             "/ after | post-check |" + (" load (1 min) |" if load else ""),
             "|---|---|---:|---:|---:|---:|---|---:|---|---|" + ("---:|" if load else "")]
    for r in rows:
        if r.get("not_run"):
            lines.append(f"| {r['fault']} | {r['router']} | not run: {r['not_run']} "
                         "| | | | | | | |" + (" |" if load else ""))
            continue
        good = r["within_slo"] / r["requests"] if r["requests"] else None
        slow = r["answered"] - r["within_slo"]
        hits = (f"{_pct(r['hit_rate_before'])} / {_pct(r.get('hit_rate_during'))} / "
                f"{_pct(r['hit_rate_after'])}" if r["fault"] != "none"
                else f"{_pct(r['hit_rate'])} (whole run)")
        false_ej = "not read" if r["healthy_ejected"] is None else str(r["healthy_ejected"])
        lines.append(
            f"| {r['fault']} | {r['router']} | {_pct(good)} | {r['lost']} | {slow} "
            f"| {r['lost_after_fault'] if r['fault'] != 'none' else '-'} | {_eject(r)} "
            f"| {false_ej} | {hits} | {r['post_check'] or '-'} |"
            + (f" {r.get('load_avg', 0.0):.2f} |" if load else ""))
    return "\n".join(lines)


def picture(fault: str, rows: list[dict[str, Any]], path: Path) -> None:
    """Latency over the trace: each answered request a dot, one line per router (the median
    of each :data:`WINDOW` requests in send order), failed requests as crosses at the top,
    the fault a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    colours = ["#2a9d8f", "#e76f51", "#8d6cab", "#f4a261", "#6c757d", "#b5a0cc", "#1d3557"]
    top = 1.0
    for r in rows:
        top = max([top, *(lat for _, lat, ok in r["series"] if ok)])
    for i, r in enumerate(rows):
        series = sorted(r["series"])
        ok = [(t, lat) for t, lat, good in series if good]
        xs, ys = [], []
        for k in range(0, len(ok), WINDOW):
            chunk = ok[k:k + WINDOW]
            xs.append(sum(t for t, _ in chunk) / len(chunk))
            ys.append(sorted(lat for _, lat in chunk)[len(chunk) // 2])
        colour = colours[i % len(colours)]
        ax.plot([t for t, _ in ok], [lat for _, lat in ok], ".", color=colour, ms=2.5,
                alpha=0.45)
        ax.plot(xs, ys, color=colour, lw=1.4, label=f"{r['router']} ({r['lost']} failed)")
        failed = [t for t, _, good in series if not good]
        ax.plot(failed, [top * 1.15] * len(failed), "x", color=colour, ms=5)
    fault_at = next((r["fault_at_s"] for r in rows if r.get("fault_at_s") is not None), None)
    gap = next((r["fault_gap_s"] for r in rows if r.get("fault_gap_s")), None)
    parts = MIXED_PARTS if fault == "mixed" and gap else (fault,)
    for k, part in enumerate(parts):
        if fault_at is None:
            break
        at = float(fault_at) + k * float(gap or 0.0)
        ax.axvline(at, color="#c1121f", ls="--", lw=1)
        ax.text(at, 0.03, f" {part}", color="#c1121f", fontsize=8,
                transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10,
                                                                20, 60]))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("seconds into the trace (request sent)", fontsize=8)
    ax.set_ylabel("latency s (line: median of 5)", fontsize=8)
    ax.set_title(f"Trace replay, {fault}: latency over time (x: failed)", fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(data: dict[str, Any], report: Path = REPORT, pictures: Path = PICTURES,
          real: bool = False) -> None:
    """The report and the pictures from ``data`` (``{"rows": [...], "runs": [...]}``);
    ``real``: runs on real vLLM engines."""
    rows = data["rows"]
    faults = [f for f in dict.fromkeys(r["fault"] for r in rows)]
    links = []
    for fault in faults:
        ran = [r for r in rows if r["fault"] == fault and not r.get("not_run") and r["series"]]
        if ran:
            path = pictures / f"replay-{fault}.png"
            picture(fault, ran, path)
            links.append(f"[{fault}]({path.relative_to(report.parent)})")
    runs = "\n".join(f"- {run}" for run in data.get("runs", []))
    source = (REAL if real else (RUNS,))[0].name
    report.write_text(
        "# Trace replay with faults, beside the peers"
        + (", on real vLLM engines" if real else "") + "\n\n"
        f"Generated by `bench/replay_report.py` from `bench/{source}` (written by "
        "`python bench/replay.py ... --write`); do not edit by hand. What each column means: "
        "the docstring of `bench/replay.py`. Time to eject: the faulted engine's own log, its "
        "last generation request after the fault (and how many came after it); \"-\" where no "
        "one engine's log could say (a crash takes it along; a stopped engine logs what came "
        "only once continued; a draining one refuses all; several engines; a fault of "
        "fleetwarden's own). Slow: answered whole, outside the SLO. False ejections: healthy "
        "engines the router's own account ejected.\n\n"
        + ("Real engines keep no log of the requests that reached them: time to eject is "
           "\"-\" throughout. Load: the machine's 1-minute load average as each run ended "
           "(2 cores, shared).\n\n" if real else "")
        + f"Runs (machine, load, the command):\n\n{runs}\n\n{table(rows, load=real)}\n\n"
        f"Pictures (latency over time, the fault marked, one line per router): "
        f"{', '.join(links)}.\n")


def add(run: dict[str, Any]) -> None:
    """A run of ``bench/replay.py`` (what its ``--json`` writes: its command, its summary, its
    rows) merged into :data:`RUNS` (:data:`REAL` for one on real vLLM engines), and its
    report written again."""
    real = run.get("engines") == "vllm"
    runs, report, pictures = REAL if real else (RUNS, REPORT, PICTURES)
    data = json.loads(runs.read_text()) if runs.exists() else {"rows": [], "runs": []}
    if ({(r["fault"], r["router"]) for r in data["rows"]}
            <= {(r["fault"], r["router"]) for r in run["rows"]}):
        data = {"rows": [], "runs": []}  # every row replaced: the earlier runs say nothing here
    data["rows"] = merge(data["rows"], run["rows"])
    data["runs"].append(f"{run.get('summary') or run.get('about', '')}: `{run['command']}`")
    runs.write_text(json.dumps(data, indent=1) + "\n")
    write(data, report, pictures, real)
    print(f"wrote {report} and its pictures under {pictures}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--add"] and len(argv) > 1:
        for name in argv[1:]:
            add(json.loads(Path(name).read_text()))
        return 0
    if argv not in ([], ["--real"]):
        raise SystemExit("usage: python bench/replay_report.py [--real] [--add ROWS.json ...]")
    real = argv == ["--real"]
    runs, report, pictures = REAL if real else (RUNS, REPORT, PICTURES)
    write(json.loads(runs.read_text()), report, pictures, real)
    print(f"wrote {report} and its pictures under {pictures}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
