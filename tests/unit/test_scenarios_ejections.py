"""`Ejections`, what the real tiers' "0 false ejections" is read from: a fleet's history as
the admin API pages it, each shard taken out that the test did not fault."""

from __future__ import annotations

from typing import Any, cast

import pytest

from fleetwarden.testing.scenarios import Ejections, no_false_ejections
from fleetwarden.testing.up import UpProcess


class _Client:
    """The admin API's ``transitions(since)``: after sequence number ``since``, a page of at
    most ``page`` of them, oldest first."""

    def __init__(self, history: list[dict[str, Any]], page: int = 2) -> None:
        self.history, self.page = history, page

    def transitions(self, since: int = 0) -> list[dict[str, Any]]:
        return [t for t in self.history if t["seq"] > since][: self.page]


class _Up:
    def __init__(self, client: _Client) -> None:
        self.client = client


def _t(seq: int, shard: int, frm: str, to: str, event: str) -> dict[str, Any]:
    return {"seq": seq, "shard": shard, "from": frm, "to": to, "event": event,
            "cause": f"cause {seq}", "wall": float(seq)}


def test_only_what_happens_after_it_starts_counts_across_pages() -> None:
    client = _Client([_t(1, 0, "HEALTHY", "DEAD", "condemned"),
                      _t(2, 0, "DEAD", "RESTARTING", "restart begun"),
                      _t(3, 0, "RESTARTING", "HEALTHY", "loaded")])
    ejections = Ejections(cast(UpProcess, _Up(client)))
    assert ejections.since == 3 and ejections.false() == []  # the history before: not counted
    client.history += [_t(4, 1, "HEALTHY", "SUSPECT", "failure"),  # a blip: not taken out
                       _t(5, 1, "SUSPECT", "SUSPECT", "ejected"),
                       _t(6, 1, "SUSPECT", "DEAD", "condemned"),
                       _t(7, 0, "HEALTHY", "RETIRED", "retired"),
                       _t(8, 0, "HEALTHY", "SLEEPING", "asleep")]
    assert ejections.false() == ["shard 1: SUSPECT -> SUSPECT (cause 5)",
                                 "shard 1: SUSPECT -> DEAD (cause 6)",
                                 "shard 0: HEALTHY -> RETIRED (cause 7)"]
    ejections.faulted.add(1)  # faulted on purpose: its condemnation is the test's
    assert ejections.false() == ["shard 0: HEALTHY -> RETIRED (cause 7)"]


def test_a_test_fails_on_an_engine_taken_out_that_it_did_not_fault() -> None:
    client = _Client([])
    up = cast(UpProcess, _Up(client))
    with no_false_ejections(up) as faulted:
        faulted.add(0)
        client.history.append(_t(1, 0, "HEALTHY", "DEAD", "condemned"))
    with pytest.raises(AssertionError, match=r"shard 1: HEALTHY -> DEAD \(cause 2\)"), \
            no_false_ejections(up) as faulted:
        faulted.add(0)
        client.history.append(_t(2, 1, "HEALTHY", "DEAD", "condemned"))
