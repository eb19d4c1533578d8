"""The router in processes of its own: `fleetwarden up` runs ``[router] workers`` of
them on one port; they outlive a SIGKILLed fleetwarden, serving on with the last serving set,
and its next run adopts them as it adopts engines. `fleetwarden up` runs as a real subprocess,
the load is the `openai` client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from fleetwarden.auth import load_or_create_token
from fleetwarden.config import RouterConfig
from fleetwarden.journal import Journal
from fleetwarden.launchers import LaunchError
from fleetwarden.launchers.local import kill_launched, live_launch_ids
from fleetwarden.launchers.procs import listening_processes, process_start_ticks
from fleetwarden.launchers.routers import RouterRecord, RouterWorkers
from fleetwarden.router.links import RemoteRouter
from fleetwarden.router.pool import BackendFacts
from fleetwarden.testing.load import Load
from fleetwarden.testing.up import UpProcess
from support import wait
from support.fleet import SIM
from support.sim import SimProcess, free_port

pytestmark = pytest.mark.scenario


def until(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> Awaitable[float]:
    """:func:`support.wait.until` with a longer default bound: router processes of their own
    start slowly on a loaded 2-core machine."""
    return wait.until(cond, timeout, what)


def journal_of(work: Path) -> Journal:
    return Journal(work / "fleetwarden.sqlite")


def running_routers(work: Path) -> dict[int, tuple[str, int]]:
    """worker -> (launch id, pid) of the router processes the journal says are running."""
    with journal_of(work) as j:
        return {d["worker"]: (d["launch_id"], d["pid"]) for d in j.running_routers()}


def everything_live(work: Path) -> set[str]:
    """Launch ids, engines and routers this journal ever recorded, a live process carries."""
    with journal_of(work) as j:
        return live_launch_ids(j.launch_ids() | j.router_launch_ids())


def end_everything(work: Path, *ups: UpProcess | None) -> set[str]:
    """SIGKILL to each fleetwarden, then to whatever engine or router of this journal is left
    (nothing this test started lives on); returns the launch ids that were still live."""
    for up in ups:
        if up is not None:
            up.kill9()
    left = everything_live(work)
    with journal_of(work) as j:
        kill_launched(j.launch_ids() | j.router_launch_ids())
    return left


def admin_metrics(up: UpProcess) -> str:
    token = up.client_token_file.read_text().strip()
    request = urllib.request.Request(up.admin + "/metrics",
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.read().decode())


def test_sigkill_of_fleetwarden_under_load_loses_no_request(tmp_path: Path) -> None:
    args = ("--engines", "2", "--engine-cmd", SIM, "--router-workers", "2")
    up = UpProcess(tmp_path, *args)
    again: UpProcess | None = None
    try:
        routers = running_routers(tmp_path)
        assert sorted(routers) == [0, 1]
        engines = {s["index"]: (s["pid"], s["base_url"]) for s in up.client.shards()}

        async def scenario() -> tuple[Load, UpProcess, int, int]:
            async with Load(up.router, concurrency=4, max_tokens=16) as load:
                await until(lambda: len(load.results) >= 20, what="load running")
                await asyncio.to_thread(up.kill9)  # requests are in flight at this moment
                at_kill = len(load.results)
                # No controller at all: the routers serve on with the last serving set.
                await until(lambda: len(load.results) >= at_kill + 40,
                            what="served while fleetwarden was down")
                restarted = await asyncio.to_thread(UpProcess, tmp_path, *args)
                at_restart = len(load.results)
                await until(lambda: len(load.results) >= at_restart + 40,
                            what="served after the restart")
            return load, restarted, at_kill, at_restart

        load, again, at_kill, at_restart = asyncio.run(scenario())
        print(f"\n{load.summary()}; {at_kill} answered before the SIGKILL, "
              f"{at_restart - at_kill} with no controller")
        assert load.failures == []  # every request answered, across the kill and the restart
        assert again.router == up.router  # the same port: the same processes
        assert running_routers(tmp_path) == routers  # routers adopted, none started
        shards = again.client.shards()
        assert {s["index"]: (s["pid"], s["base_url"]) for s in shards} == engines  # adopted
        assert [s["restart_attempts"] for s in shards] == [0, 0]  # no restart spent
        assert again.client.status()["restarts"]["completed"] == 0
        # The fleet's counters (the dashboard's rates) count both workers' requests, those
        # served while the controller was away included.
        with_canaries = len(load.results)
        asyncio.run(until(lambda: again.client.status()["router"]["requests"]  # type: ignore[union-attr]
                          >= with_canaries, 10, "every worker's requests counted"))
        # One scrape of the fleet's /metrics sees every worker's own series, labelled.
        scraped = admin_metrics(again)
        for worker in ("0", "1"):
            assert f'fleetwarden_router_requests_total{{worker="{worker}"}}' in scraped
        assert "nothing left running" in again.stop()
        assert running_routers(tmp_path) == {}
    finally:
        left = end_everything(tmp_path, up, again)
    assert left == set()


def test_a_router_worker_that_dies_is_replaced_on_the_same_port(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, "--engines", "1", "--engine-cmd", SIM, "--router-workers", "2")
    try:
        before = running_routers(tmp_path)
        os.kill(before[0][1], signal.SIGKILL)

        def worker_0_again() -> bool:
            # One read of the journal: between two, the dead worker's row can end before its
            # replacement's begins.
            now = running_routers(tmp_path)
            return set(now) == {0, 1} and now[0] != before[0]

        async def replaced() -> Load:
            await until(worker_0_again, 30, "worker 0 again")
            async with Load(up.router, concurrency=4, max_tokens=4, total=40) as load:
                await load.wait()
            return load

        load = asyncio.run(replaced())
        assert load.failures == []
        assert running_routers(tmp_path)[1] == before[1]  # the other one untouched
        assert "nothing left running" in up.stop()
    finally:
        left = end_everything(tmp_path, up)
    assert left == set()


async def test_a_recorded_router_that_is_not_ours_is_never_adopted_nor_signalled(
        tmp_path: Path) -> None:
    # A live process with the recorded PID, but another program: no launch id, another start.
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True)
    journal = Journal(tmp_path / "j.sqlite")
    token_file = tmp_path / "token"
    workers = RouterWorkers(RouterConfig(port=0, workers=1), load_or_create_token(token_file),
                            token_file, tmp_path / "logs", journal)
    try:
        ticks = process_start_ticks(stranger.pid)
        record = RouterRecord(worker=0, launch_id="r0-gone", url="http://127.0.0.1:9",
                              control_url="http://127.0.0.1:9", pid=stranger.pid,
                              pgid=stranger.pid, proc_start_ticks=ticks, log_path="",
                              launched_at=0.0)
        journal.router_launched(record.launch_id, 0, record.to_dict())
        await workers.start([])
        assert workers.adopted == 0 and workers.started == 1
        assert stranger.poll() is None  # never signalled
        assert [d["launch_id"] for d in journal.running_routers()] != ["r0-gone"]
    finally:
        await workers.stop()
        journal.close()
        stranger.kill()
        stranger.wait()


def test_a_reload_replaces_the_routers_under_load_with_no_request_failed(tmp_path: Path) -> None:
    up = UpProcess(tmp_path, "--engines", "2", "--engine-cmd", SIM, "--router-workers", "2")
    try:
        before = running_routers(tmp_path)

        async def scenario() -> tuple[Load, Load, int]:
            # Short requests back to back, and streams of ~3 s that the reload must not cut.
            async with Load(up.router, concurrency=4, max_tokens=8) as short, \
                    Load(up.router, concurrency=2, max_tokens=120, stream=True) as streams:
                await until(lambda: len(short.results) >= 20 and len(streams.results) >= 2,
                            what="load running")
                at_reload = len(short.results) + len(streams.results)
                os.kill(up.proc.pid, signal.SIGHUP)
                await until(lambda: not set(running_routers(tmp_path).values())
                            & set(before.values()), 120, "every router replaced")
                replaced = {launch for launch, _ in running_routers(tmp_path).values()}
                assert len(replaced) == 2
                n = len(streams.results)
                await until(lambda: len(streams.results) >= n + 4, what="streams after")
            return short, streams, at_reload

        short, streams, at_reload = asyncio.run(scenario())
        print(f"\nshort {short.summary()}\nstreams {streams.summary()}\n"
              f"{at_reload} answered before the reload")
        wall = time.time() - time.monotonic()
        for failed in short.failures + streams.failures:  # beside the routers' logs below
            print(time.strftime("%H:%M:%S", time.localtime(wall + failed.started)),
                  f"{(wall + failed.started) % 1:.3f}", failed)
        for path in sorted(tmp_path.rglob("router-*.log")):
            print(f"--- {path.name}\n{path.read_text()[-3000:]}")
        assert short.failures == [] and streams.failures == []
        assert live_launch_ids({launch for launch, _ in before.values()}) == set()  # gone
        # Each new router listened on its predecessor's own socket (router/handover.py).
        for worker, (old_launch, _) in before.items():
            [old_log] = tmp_path.rglob(f"router-{worker}-{old_launch}.log")
            assert "handed to a replacement" in old_log.read_text()
        for path in tmp_path.rglob("router-*.log"):
            assert "could not take the listeners" not in path.read_text()
        assert "nothing left running" in up.stop()
    finally:
        left = end_everything(tmp_path, up)
    assert left == set()


def test_reloads_overlapping_each_other_and_the_stop_leave_nothing_running(
        tmp_path: Path) -> None:
    """Two SIGHUPs back to back, then SIGTERM while the reloads are under way: the reloads
    run one after the other, the stop waits for the one in progress, and every router process
    any of them started is stopped (measured before: 4 router processes outlived the stop of
    a fleet reloaded every half second)."""
    up = UpProcess(tmp_path, "--engines", "1", "--engine-cmd", SIM, "--router-workers", "2")
    try:
        os.kill(up.proc.pid, signal.SIGHUP)
        os.kill(up.proc.pid, signal.SIGHUP)  # before the first has started its new routers
        time.sleep(0.3)  # the first reload's new routers are starting
        out = up.stop()
        assert "nothing left running" in out
        with journal_of(tmp_path) as j:
            launched = j.router_launch_ids()
        assert len(launched) >= 2  # the fleet's own routers, and a reload's at least
        assert everything_live(tmp_path) == set()
    finally:
        left = end_everything(tmp_path, up)
    assert left == set()


@contextlib.asynccontextmanager
async def one_worker(tmp_path: Path, backend: str | None = None
                     ) -> AsyncIterator[tuple[RouterWorkers, Journal, Path]]:
    """One router process behind RouterWorkers, in the test's loop; stopped (and checked gone)
    at the end, whatever the test did."""
    journal = Journal(tmp_path / "j.sqlite")
    token_file = tmp_path / "token"
    workers = RouterWorkers(RouterConfig(port=0, workers=1), load_or_create_token(token_file),
                            token_file, tmp_path / "logs", journal)
    try:
        await workers.start([backend or BACKEND])
        yield workers, journal, token_file
    finally:
        token_file.chmod(0o600)
        try:
            await workers.stop()
        finally:
            launched = journal.router_launch_ids()
            left = live_launch_ids(launched)
            kill_launched(launched)  # nothing this test started lives on, even when it fails
            journal.close()
    assert left == set(), f"router processes left running after the stop: {left}"


#: A backend no request goes to: these tests read what the workers were told, not traffic.
BACKEND = "http://127.0.0.1:9"


async def test_a_reload_whose_new_worker_fails_to_start_is_rolled_back(tmp_path: Path) -> None:
    """Before: the old worker was left serving with a frozen serving set (no slot drove it: a
    shard retired after the reload still got its requests), and it outlived the stop."""
    async with one_worker(tmp_path) as (workers, journal, token_file):
        [old] = journal.running_routers()
        token_file.chmod(0o644)  # the new worker refuses a token file others can read
        with pytest.raises(LaunchError):  # said, to the SIGHUP handler that logs it
            await workers.reload()
        token_file.chmod(0o600)
        assert [d["launch_id"] for d in journal.running_routers()] == [old["launch_id"]]
        # Still driven: what the controller pushes next reaches the old worker.
        other = "http://127.0.0.1:10"
        await workers.links[0].set_serving_backends([other], {other: BackendFacts(0, 2)})
        status = await workers.links[0].status()
        assert status["serving"] == [other]
        # ... and a later reload, with nothing broken, replaces it.
        await workers.reload()
        assert (await workers.links[0].status())["serving"] == [other]

        async def old_gone() -> bool:
            return old["launch_id"] not in {d["launch_id"] for d in journal.running_routers()}
        await until_async(old_gone, 30, "the old worker drained and stopped")
        assert len(journal.running_routers()) == 1


async def test_a_stop_while_a_replaced_worker_drains_stops_it_too(tmp_path: Path) -> None:
    """A reload's old worker drains what it holds (here a connection that has sent nothing),
    and the fleet stops meanwhile: the old worker is stopped with the rest. Before, the stop
    awaited the cancelled reaps, whose cleanup dropped the old worker from the list it then
    stopped, and it outlived the stop (the fleet model, after a clean restart)."""
    idle: asyncio.StreamWriter | None = None
    try:
        async with one_worker(tmp_path) as (workers, journal, _):
            [old] = journal.running_routers()
            host, port = workers.url.removeprefix("http://").rsplit(":", 1)
            _, idle = await asyncio.open_connection(host, int(port))  # the old worker's
            await workers.reload()
            assert old["launch_id"] in live_launch_ids({old["launch_id"]})  # still draining
        # one_worker's end asserts that no router process outlived the stop, the connection
        # still open.
    finally:
        if idle is not None:
            idle.close()


async def test_a_reload_pushes_to_the_old_worker_until_it_has_gone(tmp_path: Path) -> None:
    """Both generations accept on the same sockets until the reload closes the old one's
    listeners, and the old one serves its open connections after that. Before, the old worker
    got no push once its replacement answered: in the fleet model, two shards that turned
    HEALTHY during a reload were never routed by a worker still taking requests."""
    async with one_worker(tmp_path) as (workers, journal, token_file):
        [old] = journal.running_routers()
        handing_over, go_on = asyncio.Event(), asyncio.Event()
        stop_accepting = workers._stop_accepting

        async def held(p: Any) -> None:  # the new worker answers; the old one still accepts
            handing_over.set()
            await go_on.wait()
            await stop_accepting(p)

        workers._stop_accepting = held  # type: ignore[method-assign]
        reload = asyncio.create_task(workers.reload())
        other = "http://127.0.0.1:10"
        try:
            await asyncio.wait_for(handing_over.wait(), 60)
            await workers.links[0].set_serving_backends([BACKEND, other],
                                                        {other: BackendFacts(0, 3)})
            token = token_file.read_text().strip()
            async with RemoteRouter(old["control_url"], token) as remote:
                status = await remote.status()
                assert status["accepting"]
                assert status["serving"] == [BACKEND, other]  # the push reached it too
                go_on.set()
                await reload
                # Draining (it stopped accepting) but still serving its open connections:
                # still pushed, until it exits.
                await workers.links[0].set_serving_backends([other], {other: BackendFacts(0, 4)})
                drained = None
                with contextlib.suppress(aiohttp.ClientConnectionError):  # unless it exited
                    drained = (await remote.status())["serving"]
                assert drained in (None, [other])
            assert (await workers.links[0].status())["serving"] == [other]  # the new one
        finally:
            go_on.set()
            with contextlib.suppress(Exception):
                await reload


def exited(pid: int) -> bool:
    """The process is gone or a zombie: the kernel closed every socket it held."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def held_here(url: str) -> bool:
    """This process (where RouterWorkers runs) holds a socket listening on the URL's port."""
    port = int(url.rsplit(":", 1)[1])
    return os.getpid() in {p.pid for p in listening_processes(port)}


def bindable(url: str) -> bool:
    """A socket without SO_REUSEPORT may bind the URL's port now."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as s:
        try:
            s.bind((host, int(port)))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def refused(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


async def test_connections_that_come_while_a_dead_worker_is_replaced_wait_for_it(
        tmp_path: Path) -> None:
    """Before: the dead worker's listening socket closed with it, and the port refused every
    connection until the replacement bound its own (9 of 120 requests of a replayed trace,
    in a gap of 2.4 s). Now fleetwarden holds a copy of the socket and the replacement takes
    it: a request sent when no worker is alive waits in its queue and is answered."""
    sim = SimProcess("--steps-per-s", "40")
    try:
        async with one_worker(tmp_path, sim.url) as (workers, journal, _):
            [old] = journal.running_routers()
            os.kill(old["pid"], signal.SIGKILL)
            await until(lambda: exited(old["pid"]), 10, "the worker dead")
            sent = time.time()
            async with aiohttp.ClientSession() as http, http.post(
                    workers.url + "/v1/completions",
                    json={"model": "tiny", "prompt": "hello", "max_tokens": 4},
                    timeout=aiohttp.ClientTimeout(total=60)) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["usage"]["completion_tokens"] == 4
            [new] = journal.running_routers()
            assert new["launch_id"] != old["launch_id"]
            assert new["launched_at"] > sent  # the request came while no worker lived
        # The copy was closed before the workers stopped: nothing queues on the port.
        assert not held_here(workers.url)
    finally:
        sim.kill()


async def test_a_dead_worker_that_cannot_be_started_again_leaves_the_port_refusing(
        tmp_path: Path) -> None:
    """The copy of a dead worker's socket is dropped once its replacement fails to start: the
    port refuses (a client learns at once) instead of queueing connections no one accepts."""
    async with one_worker(tmp_path) as (workers, journal, token_file):
        [old] = journal.running_routers()
        assert held_here(workers.url)  # the copy, which the failed start must drop
        token_file.chmod(0o644)  # a new worker refuses a token file others can read
        os.kill(old["pid"], signal.SIGKILL)
        await until(lambda: exited(old["pid"]), 10, "the worker dead")
        # With the copy kept after the failed start, the kernel would complete every handshake.
        await until(lambda: not held_here(workers.url), 30, "the copy dropped")
        assert refused(workers.url)
        # No worker listens and no copy is kept, yet the port picked for port 0 is still the
        # fleet's: another server, or an outgoing connection's local port, taking it now would
        # fail the next worker's start (before: a plain bind here succeeded).
        assert not bindable(workers.url)
        token_file.chmod(0o600)  # the next try starts one: the stop finds it
        await until(lambda: not refused(workers.url), 30, "a worker listening again")


async def test_with_several_workers_no_copy_of_their_sockets_is_kept(tmp_path: Path) -> None:
    """While one of several workers is replaced, the kernel hands new connections to the others
    at once; a kept copy of the dead one's socket would hold its share until the replacement."""
    journal = Journal(tmp_path / "j.sqlite")
    token_file = tmp_path / "token"
    workers = RouterWorkers(RouterConfig(port=0, workers=2), load_or_create_token(token_file),
                            token_file, tmp_path / "logs", journal)
    try:
        await workers.start([BACKEND])
        assert len(journal.running_routers()) == 2
        assert not held_here(workers.url)
    finally:
        try:
            await workers.stop()
        finally:
            kill_launched(journal.router_launch_ids())
            journal.close()


async def until_async(cond: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


async def replaced_with(workers: RouterWorkers, journal: Journal, old_launch: str,
                        trial: list[str], version: int) -> None:
    """Wait until a new process holds worker 0's slot and says it serves BACKEND with these
    facts and this trial set."""
    async def holds() -> bool:
        running = journal.running_routers()
        if [d["launch_id"] for d in running] == [old_launch] or not running:
            return False
        try:
            status = await workers.links[0].status()
        except Exception:
            return False
        return (status["serving"] == [BACKEND] and status["trial"] == trial
                and status["facts"][BACKEND]["weight_version"] == version)
    await until_async(holds, 30, "a replacement serving with the last push's facts")


async def test_a_worker_started_again_gets_the_last_facts_and_trial_set(tmp_path: Path) -> None:
    """Before: a replacement had the serving set on its command line and nothing else (no
    weight versions, no shard on trial) until the controller's next change."""
    async with one_worker(tmp_path) as (workers, journal, _):
        link = workers.links[0]
        await link.set_serving_backends([BACKEND], {BACKEND: BackendFacts(0, 7)})
        await link.set_trial_backends([BACKEND])
        [old] = journal.running_routers()
        os.kill(old["pid"], signal.SIGKILL)
        await replaced_with(workers, journal, old["launch_id"], [BACKEND], 7)


async def test_a_worker_dies_while_the_journal_cannot_be_written_and_is_started_again(
        tmp_path: Path) -> None:
    """Before: the watcher wrote the worker's stop on the loop with no error handling; on a
    failing disk it raised, and the worker was never started again."""
    async with one_worker(tmp_path) as (workers, journal, _):
        await workers.links[0].set_serving_backends([BACKEND], {BACKEND: BackendFacts(0, 1)})
        [old] = journal.running_routers()
        # Every connection that may write a router row now fails as a full disk would.
        readonly = f"file:{journal.path}?mode=ro"
        journal._read = sqlite3.connect(readonly, uri=True, check_same_thread=False)
        journal._engines_conn = sqlite3.connect(readonly, uri=True, check_same_thread=False)
        os.kill(old["pid"], signal.SIGKILL)

        async def replaced() -> bool:
            try:
                status = await workers.links[0].status()
            except Exception:
                return False
            return status["facts"].get(BACKEND, {}).get("weight_version") == 1 and (
                workers.started == 2)
        await until_async(replaced, 30, "worker 0 started again")
        assert journal.dropped >= 1 and journal.failure is not None  # said, not swallowed
        # The disk is back: the stops get recorded, and the journal closes cleanly.
        journal._read.close()
        journal._engines_conn.close()
        journal._read, journal._engines_conn = journal._open_checked(), None
        journal._writer_error = None


def test_a_second_fleet_on_a_port_a_running_fleet_holds_refuses_to_start(tmp_path: Path) -> None:
    """Before: the second fleet's router workers bound the port beside the first one's
    (SO_REUSEPORT) and took about half of its requests for their own engines."""
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    port = str(free_port())
    first = UpProcess(first_dir, "--engines", "1", "--engine-cmd", SIM, "--router-workers", "1",
                      "--port", port)
    second: UpProcess | None = None
    try:
        holder = running_routers(first_dir)[0][1]
        with pytest.raises(RuntimeError) as refused:
            second = UpProcess(second_dir, "--engines", "1", "--engine-cmd", SIM,
                               "--router-workers", "1", "--port", port)
        said = str(refused.value)
        assert f"router port {port}" in said and f"pid {holder}:" in said, said
        assert "fleetwarden route" in said  # the holder is named by its command line
        with journal_of(second_dir) as j:  # the second fleet left nothing running
            assert live_launch_ids(j.launch_ids() | j.router_launch_ids()) == set()
        assert "nothing left running" in first.stop()
    finally:
        left = end_everything(first_dir, first, second) | end_everything(second_dir)
    assert left == set()


async def test_after_a_kill_in_the_middle_of_a_reload_the_newer_worker_is_adopted(
        tmp_path: Path) -> None:
    """Two workers recorded as running in one slot (fleetwarden killed between a reload's start
    of the new worker and the old one's exit): the newer one, which holds the listeners, is
    adopted and the older stopped. Before, the older was adopted (a draining worker, its
    listeners already closed) and the newer stopped: connections were refused for 30 s."""
    token_file = tmp_path / "token"
    token = load_or_create_token(token_file)
    older_j, newer_j = Journal(tmp_path / "older.sqlite"), Journal(tmp_path / "newer.sqlite")
    older = RouterWorkers(RouterConfig(port=0, workers=1), token, token_file,
                          tmp_path / "logs", older_j)
    newer = RouterWorkers(RouterConfig(port=0, workers=1), token, token_file,
                          tmp_path / "logs", newer_j)
    restarted: RouterWorkers | None = None
    try:
        await older.start([BACKEND])
        await newer.start([BACKEND])
        [old_rec] = older_j.running_routers()
        [new_rec] = newer_j.running_routers()
        # The next run's journal records both in slot 0, the newer launched later.
        record = {k: old_rec[k] for k in RouterRecord.__dataclass_fields__}
        newer_j.router_launched(old_rec["launch_id"], 0, record)
        with sqlite3.connect(newer_j.path) as conn:
            conn.execute("UPDATE routers SET launched_wall = 0 WHERE launch_id = ?",
                         (old_rec["launch_id"],))
        restarted = RouterWorkers(RouterConfig(port=0, workers=1), token, token_file,
                                  tmp_path / "logs", newer_j)
        await restarted.start([BACKEND])
        assert restarted.adopted == 1 and restarted.started == 0
        assert restarted.url == new_rec["url"]  # the newer one's port
        assert [d["launch_id"] for d in newer_j.running_routers()] == [new_rec["launch_id"]]
        assert live_launch_ids({old_rec["launch_id"]}) == set()  # the older one stopped
    finally:
        older._closing = newer._closing = True  # their processes are the restarted run's now
        for w in (restarted, older, newer):
            if w is not None:
                with contextlib.suppress(Exception):
                    await w.stop()
        launched = older_j.router_launch_ids() | newer_j.router_launch_ids()
        kill_launched(launched)
        older_j.close()
        newer_j.close()


async def test_after_a_kill_in_the_middle_of_a_reload_the_old_worker_finishes_what_it_holds(
        tmp_path: Path) -> None:
    """fleetwarden SIGKILLed while a reload's old worker still held a request: the next run
    adopts the new worker and finishes the reload for the old one (stop accepting, drain up to
    drain_s, rescues reach it). Before, it stopped the old one as an unknown leftover (SIGTERM:
    up to shutdown_grace_s, then SIGKILL) and the request was cut ("Server disconnected": the
    fleet model's long run, a SIGKILL right after a storm of SIGHUPs)."""
    sim = SimProcess("--steps-per-s", "10")  # 80 tokens: 8 s, past shutdown_grace_s
    token_file = tmp_path / "token"
    token = load_or_create_token(token_file)
    journal = Journal(tmp_path / "j.sqlite")
    config = RouterConfig(port=0, workers=1, shutdown_grace_s=1.0, drain_s=30.0)
    killed = RouterWorkers(config, token, token_file, tmp_path / "logs", journal)
    restarted: RouterWorkers | None = None
    reload: asyncio.Task[None] | None = None
    try:
        await killed.start([sim.url])
        [old] = journal.running_routers()

        async def post(http: aiohttp.ClientSession) -> tuple[int, str]:
            body = {"model": "tiny", "prompt": "a long answer", "max_tokens": 80}
            async with http.post(killed.url + "/v1/completions", json=body) as response:
                return response.status, await response.text()

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            request = asyncio.create_task(post(http))

            async def held() -> bool:
                return sum((await killed.links[0].status())["in_flight"].values()) > 0
            await until_async(held, 30, "the old worker holds the request")
            # A reload, interrupted by the kill after its new worker answered.
            handing_over = asyncio.Event()

            async def never(p: Any) -> None:
                handing_over.set()
                await asyncio.Event().wait()

            killed._stop_accepting = never  # type: ignore[method-assign]
            reload = asyncio.create_task(killed.reload())
            await asyncio.wait_for(handing_over.wait(), 60)
            killed._closing = True  # SIGKILLed: this run's objects never act again
            reload.cancel()
            restarted = RouterWorkers(config, token, token_file, tmp_path / "logs", journal)
            await restarted.start([sim.url])
            assert restarted.adopted == 1 and restarted.started == 0
            status, text = await request
            assert status == 200, text

        async def old_gone() -> bool:
            return old["launch_id"] not in {d["launch_id"] for d in journal.running_routers()}
        await until_async(old_gone, 30, "the old worker drained, exited and was journaled")
    finally:
        if reload is not None:
            reload.cancel()
            with contextlib.suppress(BaseException):
                await reload
        if restarted is not None:
            with contextlib.suppress(Exception):
                await restarted.stop()
        for link in killed.links:  # the killed run's control sessions
            await link.disconnect()
        kill_launched(journal.router_launch_ids())
        journal.close()
        sim.kill()


async def test_a_reload_rolled_back_replaces_an_old_worker_that_died_during_it(
    tmp_path: Path,
) -> None:
    """Before: the roll-back put the dead worker back in its slot, where nothing replaced it
    (its exit, during the reload, was no failure): the slot served nothing until a stop."""
    async with one_worker(tmp_path) as (workers, journal, _):
        [old] = journal.running_routers()
        launch = workers._launch

        dying = workers._procs[0].proc
        assert dying is not None

        async def no_new_worker(worker: int, take_from: Sequence[str] = ()) -> None:
            if old["launch_id"] in take_from:  # the reload's: fails once the old one died
                await until(lambda: dying.returncode is not None, 10, "the old worker died")
                raise LaunchError("the reload's new worker could not start")
            await launch(worker, take_from)

        workers._launch = no_new_worker  # type: ignore[method-assign]
        os.kill(old["pid"], signal.SIGKILL)  # dies as the reload begins
        with pytest.raises(LaunchError, match="rolled back"):
            await workers.reload()
        [now] = journal.running_routers()
        assert now["launch_id"] != old["launch_id"]
        assert (await workers.links[0].status())["serving"] == [BACKEND]


async def test_a_worker_whose_pid_never_reached_the_journal_is_stopped_by_the_next_run(
        tmp_path: Path) -> None:
    """fleetwarden killed between a router worker's spawn and the commit of its PID left the
    worker serving, named by no journal row. Its launch's intent is journaled before the
    spawn: the next run finds its processes by launch id and stops them, and only them."""
    intent = {"launch_id": "r0-no-pid-yet", "worker": 0, "pid": None}
    env = {**os.environ, "FLEETWARDEN_LAUNCH_ID": intent["launch_id"]}
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env=env, start_new_session=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**env, "FLEETWARDEN_LAUNCH_ID": "r0-another"},
                                 start_new_session=True)
    try:
        with Journal(tmp_path / "j.sqlite") as journal:
            journal.router_launched("r0-no-pid-yet", 0, intent)
            journal.flush()
            workers = RouterWorkers(RouterConfig(port=0, workers=1, shutdown_grace_s=1.0),
                                    "t" * 20, tmp_path / "token", tmp_path, journal)
            await workers._adopt_or_stop()
            journal.flush()
            assert journal.running_routers() == []  # the journal says it stopped
        assert orphan.wait(timeout=10) is not None
        assert bystander.poll() is None  # another launch id: never signalled
    finally:
        for p in (orphan, bystander):
            p.kill()
            p.wait()
