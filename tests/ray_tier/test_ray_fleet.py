"""The Ray launcher on a real two-node Ray cluster: engines are `fleetwarden sim`
processes inside Ray actors, placed on both nodes; the fleet's controller, ledger and router run
in this test's process, as they would on a head node.

Each scenario prints what it measured (how fast a death was seen, what the load saw).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from fleetwarden.fleet import Fleet
from fleetwarden.launchers import LaunchError
from fleetwarden.launchers.procs import group_members, process_info
from fleetwarden.launchers.ray import RayEngineHandle
from fleetwarden.ledger import Event, ShardState
from fleetwarden.testing.load import Load
from support.fleet import (
    fleet_config,
    record_transitions,
    running_fleet,
    served_ids,
    sim_stats,
    states,
    until,
)

from .cluster import SLOTS_PER_NODE, RayCluster, free_ports

pytestmark = pytest.mark.ray

H, D = ShardState.HEALTHY, ShardState.DEAD


def on_ray(cluster: RayCluster, engines: int, **health: Any) -> dict[str, dict[str, Any]]:
    """Sections for `running_fleet`: engines in Ray actors, one `engine_slot` each."""
    return {
        "fleet": {"engines": engines, "launcher": "ray", "ray_address": cluster.address,
                  "ray_resources": {"engine_slot": 1}, "startup_timeout_s": 90},
        "health": health,
    }


def engine(fleet: Fleet, i: int) -> RayEngineHandle:
    handle = fleet.supervisor.engines[i]
    assert isinstance(handle, RayEngineHandle)
    return handle


def alive(pid: int | None, start_ticks: int | None = None) -> bool:
    """``pid`` is a live process on this machine (every node runs here), and the same one."""
    info = None if pid is None else process_info(pid)
    return (info is not None and info.state not in "ZX"
            and (start_ticks is None or info.start_ticks == start_ticks))


def group_gone(handle: RayEngineHandle) -> bool:
    """Nothing of the engine's process group is left."""
    assert handle.engine_pid is not None
    return (not alive(handle.engine_pid, handle.engine_start_ticks)
            and not group_members(handle.engine_pid))


def gone(handle: RayEngineHandle) -> bool:
    """Nothing of the engine's process group is left, nor its keeper (which exits once it
    has said that the group is empty)."""
    return group_gone(handle) and not alive(handle.keeper_pid)


def launch_id_of(pid: int) -> str:
    """The FLEETWARDEN_LAUNCH_ID in a process's environment (who started it, and when)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in environ
             if e.startswith(b"FLEETWARDEN_LAUNCH_ID=")]
    return found[0] if found else ""


async def test_ray_engines_spread_across_nodes_and_serve(
        tmp_path: Path, cluster: RayCluster) -> None:
    engines = 2 * SLOTS_PER_NODE  # every slot of both nodes: two engines on each
    async with running_fleet(tmp_path, **on_ray(cluster, engines)) as fleet:
        await until(lambda: states(fleet) == [H] * engines, timeout=60, what="all serving")
        handles = [engine(fleet, i) for i in range(engines)]
        by_node: dict[str, list[int]] = {}
        for h in handles:
            by_node.setdefault(h.node_id, []).append(h.shard)
        assert sorted(by_node) == sorted(n.node_id for n in cluster.nodes), by_node
        assert all(len(shards) == SLOTS_PER_NODE for shards in by_node.values()), by_node
        for h in handles:
            # the URL is the node's IP and a port there; the incarnation is this launch
            assert h.url.startswith(f"http://{h.node_ip}:"), (h.url, h.node_ip)
            assert alive(h.engine_pid, h.engine_start_ticks)
            assert h.engine_pid is not None and launch_id_of(h.engine_pid) == h.launch_id
            assert fleet.ledger.shard(h.shard).incarnation == h.launch_id
        assert {h.node_ip for h in handles} == {n.ip for n in cluster.nodes}

        async with Load(fleet.router_url, concurrency=4, max_tokens=8, total=40) as load:
            await load.wait()
        assert load.failures == [], load.failures[:3]
        for h in handles:
            assert served_ids(await sim_stats(h.url)), f"shard {h.shard} served nothing"
        print(f"\nspread: {by_node}, {load.summary()}")


async def test_a_killed_ray_actor_is_condemned_and_restarted(
        tmp_path: Path, cluster: RayCluster) -> None:
    async with running_fleet(tmp_path, **on_ray(cluster, 2)) as fleet:
        await until(lambda: states(fleet) == [H, H], timeout=60, what="both serving")
        seen = record_transitions(fleet)
        old = engine(fleet, 0)
        async with Load(fleet.router_url, concurrency=4, max_tokens=16) as load:
            await until(lambda: len(load.results) >= 10, what="load flowing")
            await until(lambda: fleet.router.in_flight().get(old.url, 0) >= 1,
                        what="requests in flight on shard 0")
            killed_at = time.time()
            await asyncio.to_thread(ray.kill, old.actor)
            await until(lambda: fleet.ledger.state(0) is not H, what="shard 0 condemned")
            await until(lambda: fleet.ledger.state(0) is H, timeout=90, what="shard 0 back")
            back = time.monotonic()
            await until(lambda: len(load.since(back)) >= 10, what="load after the restart")
        death = next(t for t in seen if t.shard == 0 and t.to_state is D)
        assert "Ray actor died" in death.cause and "ray.kill" in death.cause, death.cause
        await until(lambda: gone(old), what="the killed actor's engine group gone")
        new = engine(fleet, 0)
        assert new.launch_id != old.launch_id and alive(new.engine_pid, new.engine_start_ticks)
        r = fleet.ledger.shard(0)
        assert r.restart_attempts == 1 and r.base_url == new.url != old.url
        assert fleet.ledger.shard(1).restart_attempts == 0
        assert load.failures == [], load.failures[:3]
        assert served_ids(await sim_stats(new.url))
        print(f"\nkilled actor: condemned {death.at - killed_at:.2f} s after ray.kill "
              f"({death.cause}); {load.summary()}, retries {fleet.router.stats.retries}")


async def test_losing_a_ray_node_moves_its_engines_to_the_surviving_node(
        tmp_path: Path, cluster: RayCluster) -> None:
    # Probes would condemn the lost engine too (3 failed reads); a high threshold keeps probe
    # streaks out of it, so the verdict is Ray's node death, which this test is about, unless
    # the router's refused requests, confirmed at once by a focused read, come first. The
    # router drops the lost engine at its first failed request and retries those elsewhere.
    sections = on_ray(cluster, 2, unhealthy_threshold=1000)
    async with running_fleet(tmp_path, **sections) as fleet:
        await until(lambda: states(fleet) == [H, H], timeout=60, what="both serving")
        handles = [engine(fleet, i) for i in range(2)]
        on_second = [h for h in handles if h.node_id == cluster.second.node_id]
        on_head = [h for h in handles if h.node_id == cluster.head.node_id]
        assert len(on_second) == 1 and len(on_head) == 1, [h.where for h in handles]
        lost, kept = on_second[0], on_head[0]
        seen = record_transitions(fleet)
        async with Load(fleet.router_url, concurrency=4, max_tokens=24) as load:
            await until(lambda: len(load.results) >= 10, what="load flowing")
            await until(lambda: fleet.router.in_flight().get(lost.url, 0) >= 1,
                        what="requests in flight on the second node")
            lost_at = time.time()
            cluster.kill_raylet(cluster.second)
            await until(lambda: fleet.ledger.state(lost.shard) is not H, timeout=60,
                        what="the lost node's shard condemned")
            await until(lambda: fleet.ledger.state(lost.shard) is H, timeout=90,
                        what="its shard back on the head node")
            back = time.monotonic()
            await until(lambda: len(load.since(back)) >= 10, what="load after the move")
        death = next(t for t in seen if t.shard == lost.shard and t.to_state is D)
        # Ray's node death, or (when the router's refused requests win the race) those failures
        # confirmed at once by a focused read that cannot connect either: the node is gone.
        assert ("Ray actor died" in death.cause and "node has died" in death.cause) or (
            death.event is Event.CONFIRMED and "cannot connect" in death.cause), death.cause
        moved = engine(fleet, lost.shard)
        assert moved.node_id == cluster.head.node_id and moved.url != lost.url
        assert engine(fleet, kept.shard) is kept  # the head node's engine was left alone
        assert fleet.ledger.shard(kept.shard).restart_attempts == 0
        await until(lambda: gone(lost), what="the lost node's engine group gone")
        assert load.failures == [], load.failures[:3]
        assert served_ids(await sim_stats(moved.url))
        print(f"\nnode lost: condemned {death.at - lost_at:.2f} s after its raylet died "
              f"({death.cause}); {load.summary()}, retries {fleet.router.stats.retries}")


async def test_stopping_fleetwarden_releases_every_ray_actor(
        tmp_path: Path, cluster: RayCluster) -> None:
    # This process holds its own Ray connection, as a trainer that uses Ray does: the fleet
    # uses it, and leaves it open when it stops.
    await asyncio.to_thread(ray.init, address=cluster.address, log_to_driver=False)
    try:
        slots = ray.cluster_resources()["engine_slot"]
        async with running_fleet(tmp_path, **on_ray(cluster, 2)) as fleet:
            await until(lambda: states(fleet) == [H, H], timeout=60, what="both serving")
            handles = [engine(fleet, i) for i in range(2)]
            names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
            assert {f"fleetwarden-{h.launch_id}" for h in handles} <= names
            await until(lambda: ray.available_resources().get("engine_slot", 0) == slots - 2,
                        what="two engine slots held")
            assert all(alive(h.engine_pid, h.engine_start_ticks) for h in handles)
        assert ray.is_initialized()  # the caller's connection, not the fleet's to close
        left = [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("fleetwarden-")]
        assert left == []
        assert all(group_gone(h) for h in handles)  # stop verified it before returning
        await until(lambda: all(gone(h) for h in handles), what="the keepers gone")
        await until(lambda: ray.available_resources().get("engine_slot", 0) == slots,
                    what="every engine slot free again")
    finally:
        await asyncio.to_thread(ray.shutdown)


def test_fleetwarden_up_on_ray_stops_its_engines_and_exits_cleanly_on_sigterm(
        tmp_path: Path, cluster: RayCluster) -> None:
    # Each engine takes 4 s to stop (its shell waits before it exits). A Ray driver's C++ code
    # answers SIGTERM with a 3 s alarm that aborts the process; `up` must disarm it and finish
    # its graceful stop.
    slow_stop = ("sh -c \"trap 'sleep 4; exit 0' TERM; {python} -m fleetwarden sim --host {host}"
                 " --port {port} & wait\"")
    q = json.dumps  # a JSON string is a TOML string
    config = tmp_path / "fleet.toml"
    config.write_text(
        f"[fleet]\nengines = 2\nlauncher = \"ray\"\nray_address = {q(cluster.address)}\n"
        f"ray_resources = {{ engine_slot = 1 }}\nengine_cmd = {q(slow_stop)}\n"
        f"log_dir = {q(str(tmp_path / 'logs'))}\n"
        f"[router]\nport = 0\n[admin]\nport = 0\ntoken_file = {q(str(tmp_path / 'token'))}\n"
        f"[journal]\npath = {q(str(tmp_path / 'fleet.sqlite'))}\n")
    up = subprocess.Popen([sys.executable, "-m", "fleetwarden", "up", "--config", str(config),
                           "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True, cwd=tmp_path)
    try:
        assert up.stdout is not None
        lines = []
        for line in up.stdout:  # until it serves (or exits: the loop ends)
            lines.append(line)
            if line.startswith("Ctrl-C stops the fleet"):
                break
        assert up.poll() is None, "".join(lines)
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
    text = "".join(lines) + out
    assert up.returncode == 0, text[-3000:]
    assert "stopped; nothing left running." in text
    assert text.count("stopped on node") == 2, text[-3000:]


async def test_a_ray_address_where_nothing_listens_fails_the_start_at_once(
        tmp_path: Path) -> None:
    port = free_ports(1)[0]  # nothing listens there
    fleet = Fleet(fleet_config(tmp_path, fleet={"launcher": "ray",
                                                "ray_address": f"127.0.0.1:{port}"}))
    with pytest.raises(LaunchError, match=f"cannot join the Ray cluster at '127.0.0.1:{port}'"):
        async with fleet:
            pass
    assert not ray.is_initialized()


async def test_an_engine_that_cannot_start_on_its_node_is_a_failed_launch_with_the_cause(
        tmp_path: Path, cluster: RayCluster) -> None:
    sections = on_ray(cluster, 1)
    sections["fleet"]["engine_cmd"] = "/nonexistent/engine --port {port}"
    async with running_fleet(tmp_path, **sections) as fleet:
        await until(lambda: "cannot start" in fleet.ledger.shard(0).last_error,
                    what="the first start's failure recorded")
        error = fleet.ledger.shard(0).last_error
        assert "/nonexistent/engine" in error and "see " in error, error
        assert fleet.ledger.state(0) is not H
    await asyncio.to_thread(ray.init, address=cluster.address, log_to_driver=False)
    try:  # the failed launches released their actors
        await until(lambda: ray.available_resources().get("engine_slot", 0)
                    == ray.cluster_resources()["engine_slot"], what="every engine slot free")
    finally:
        await asyncio.to_thread(ray.shutdown)
