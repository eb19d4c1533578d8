"""Processes seen from /proc, for the tests that start real ones (tests/scenario)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is neither a zombie nor dead (``/proc/PID/stat`` state)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
