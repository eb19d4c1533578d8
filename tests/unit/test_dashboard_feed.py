"""The dashboard's pure parts: the router's traffic series, and how the fleet hands events to
the pages that listen (a page that falls behind starts over; a stop always reaches it)."""

from __future__ import annotations

from pathlib import Path

from fleetwarden.admin.views import Traffic, TrafficPoint, traffic_point
from fleetwarden.config import parse_config
from fleetwarden.fleet import Fleet
from fleetwarden.router.stats import RouterStats


def point(at: float, requests: int = 0, errors: int = 0) -> TrafficPoint:
    return TrafficPoint(at=at, requests=requests, errors=errors, backend_failures=0,
                        retries=0, rescues=0)


def test_traffic_keeps_one_point_per_step() -> None:
    traffic = Traffic(step_s=5, window_s=3600)
    kept = [traffic.record(point(t)) for t in (0, 1, 4.9, 5, 7, 10.5)]
    assert kept == [True, False, False, True, False, True]
    assert [p["at"] for p in traffic.points()] == [0, 5, 10.5]


def test_traffic_forgets_points_past_the_window_but_one_to_start_the_first_rate() -> None:
    traffic = Traffic(step_s=10, window_s=60)
    for t in range(0, 200, 10):
        traffic.record(point(t, requests=t))
    ats = [p["at"] for p in traffic.points()]
    assert ats[0] < 190 - 60 <= ats[1]  # exactly one point before the window
    assert ats[-1] == 190
    assert traffic.latest == point(190, requests=190)


def test_errors_are_answers_that_say_the_fleet_could_not_serve() -> None:
    stats = RouterStats()
    for status, n in ((200, 90), (400, 3), (404, 2), (429, 4), (409, 5), (500, 6), (503, 1)):
        for _ in range(n):
            stats.responded(status)
    stats.requests = 111
    stats.backend_failed("http://a", "reset")
    stats.backend_failed("http://a", "refused")
    stats.retries["free"] = 2
    stats.retries["paid"] = 1
    stats.rescues = 4
    p = traffic_point(stats, 12.0, frozenset({500, 409}))
    # 4xx and 429 are the client's business (never a fleet failure); 409 is the router's own
    # "no shard left" here, 5xx always counts
    assert p == TrafficPoint(at=12.0, requests=111, errors=12, backend_failures=2, retries=3,
                             rescues=4)


def _fleet(tmp_path: Path) -> Fleet:
    return Fleet(parse_config({"journal": {"path": str(tmp_path / "j.sqlite")}}, "test"))


def test_a_listener_that_falls_behind_is_told_to_start_over(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    q = fleet.admin.events.listen()
    for n in range(q.maxsize + 1):
        fleet.admin.events.publish({"type": "snapshot", "data": n})
    assert q.qsize() == 1 and q.get_nowait() == {"type": "resync"}
    fleet.admin.events.publish({"type": "transition", "data": 1})
    assert q.get_nowait() == {"type": "transition", "data": 1}


def test_bye_reaches_even_a_listener_that_fell_behind(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    q = fleet.admin.events.listen()
    for n in range(q.maxsize):
        fleet.admin.events.publish({"type": "snapshot", "data": n})
    fleet.admin.events.publish({"type": "bye"})
    assert [q.get_nowait() for _ in range(q.qsize())] == [{"type": "resync"}, {"type": "bye"}]


def test_a_listener_that_left_gets_nothing(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    q = fleet.admin.events.listen()
    fleet.admin.events.unlisten(q)
    fleet.admin.events.publish({"type": "bye"})
    assert q.empty()


def test_an_event_with_a_nan_from_an_engine_is_still_json() -> None:
    import json

    from fleetwarden.admin.dashboard import _frame

    frame = _frame("snapshot", {"shards": [{"tokens_per_s": float("nan"), "n": 1.5}],
                                "x": (float("inf"), 2)})
    head, data = frame.decode().rstrip("\n").split("\n")
    assert head == "event: snapshot"
    assert json.loads(data.removeprefix("data: ")) == {
        "shards": [{"tokens_per_s": None, "n": 1.5}], "x": [None, 2]}


def test_the_admin_side_keeps_its_own_state_and_imports_no_fleet() -> None:
    """The admin API asks the fleet through FleetSurface; what only it uses (its token, events,
    traffic, metrics registry) is its own, and it never imports fleet.py."""
    import ast

    import fleetwarden.admin as admin_package
    from fleetwarden.admin.surface import FleetSurface

    assert not {"token", "admin_url", "events", "traffic", "registry",
                "metrics_text"} & (set(FleetSurface.__annotations__) | set(vars(FleetSurface)))
    for path in Path(admin_package.__file__).parent.glob("*.py"):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom)}
        imported |= {alias.name for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Import) for alias in node.names}
        assert "fleetwarden.fleet" not in imported, path.name


class _Unbuilt:
    """A fleet surface whose snapshot must not be built."""

    def snapshot(self) -> None:
        raise AssertionError("a snapshot was built with nobody listening")


def test_a_tick_with_nobody_listening_records_traffic_and_builds_nothing(tmp_path: Path) -> None:
    admin = _fleet(tmp_path).admin
    stats = RouterStats()
    stats.requests = 7
    admin.after_tick(_Unbuilt(), stats)  # type: ignore[arg-type]
    latest = admin.traffic.latest
    assert latest is not None and latest.requests == 7
    assert admin.events.recent == []


def test_an_act_is_announced_to_every_page(tmp_path: Path) -> None:
    admin = _fleet(tmp_path).admin
    q = admin.events.listen()
    admin.announce("refit", phase="begin", version=3)
    assert q.get_nowait() == {"type": "refit", "data": {"phase": "begin", "version": 3}}
