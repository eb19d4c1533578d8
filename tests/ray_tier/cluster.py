"""A real two-node Ray cluster on this machine, for the Ray launcher's tests.

Two ``ray start --block`` processes, each the leader of a process group of its own: the head
node (GCS, raylet, helpers) and a second node whose IP is 127.0.0.2 (any 127.x address is this
machine's loopback), so each node's engines have URLs of their own. Every port is picked free,
so the cluster shares the machine with whatever else runs Ray. Each node offers
``engine_slot``: the resource the fleet's engines ask for, two per node.

Stopping is scoped to what this cluster started, never ``ray stop`` (which stops every Ray
process of the machine): SIGTERM to each ``ray start --block`` (it stops its node's processes),
then its process group is emptied and checked, and any Ray worker process left whose command
line names this cluster's session folder is killed.

Timings are compressed as the fleet's are in tests: the GCS declares a node dead after about
4 s of failed health checks (Ray's default: 5 checks 3 s apart, after a 5 s start delay).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray

from fleetwarden.launchers.procs import (
    ProcessInfo,
    find_group_member,
    process_info,
    terminate_group,
)

#: Ray's command line, from the environment the tests run in.
RAY = str(Path(sys.executable).with_name("ray"))
#: Engine slots per node: the resource the tests' engines ask for.
SLOTS_PER_NODE = 2
#: A node started with `ray start` answers within seconds; a loaded 2-core machine is slower.
START_TIMEOUT_S = 60.0

ENV = {
    "RAY_AUTH_MODE": "disabled",  # otherwise Ray writes a token under the home folder
    "RAY_USAGE_STATS_ENABLED": "0",
    # A lost node is declared dead after ~4 s instead of ~20 s (read by the GCS, on the head).
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "4",
}


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class RayNode:
    name: str
    ip: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    node_id: str = ""

    def raylet(self) -> ProcessInfo | None:
        return find_group_member(self.proc.pid, "raylet")

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


@dataclass
class RayCluster:
    root: Path  # logs of `ray start`
    #: Ray's session folder; short, because it holds Unix sockets (108 bytes at most).
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="fwray-")))
    gcs_port: int = 0
    nodes: list[RayNode] = field(default_factory=list)
    #: Every `ray start` process this cluster ran, to stop each one's group at the end.
    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def head(self) -> RayNode:
        return self.nodes[0]

    @property
    def second(self) -> RayNode:
        return self.nodes[-1]

    def _start(self, name: str, args: list[str]) -> RayNode:
        ports = free_ports(7)
        log_path = self.root / f"{name}-{len(self.started)}.log"
        argv = [RAY, "start", "--block", "--disable-usage-stats", "--num-cpus", "1",
                "--resources", json.dumps({"engine_slot": SLOTS_PER_NODE}),
                "--node-manager-port", str(ports[0]), "--object-manager-port", str(ports[1]),
                "--dashboard-agent-listen-port", str(ports[2]),
                "--dashboard-agent-grpc-port", str(ports[3]),
                "--metrics-export-port", str(ports[4]), "--runtime-env-agent-port", str(ports[5]),
                "--min-worker-port", "0", "--max-worker-port", "0",
                "--object-store-memory", str(100 * 1024 * 1024), *args]
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **ENV})
        self.started.append(proc)
        ip = next((args[i + 1] for i, a in enumerate(args) if a == "--node-ip-address"), "")
        return RayNode(name, ip, proc, log_path)

    def start_head(self) -> RayNode:
        self.gcs_port, dashboard = free_ports(2)
        node = self._start("head", [
            "--head", "--port", str(self.gcs_port), "--temp-dir", str(self.temp_dir),
            "--include-dashboard", "false", "--dashboard-port", str(dashboard)])
        self.nodes.append(node)
        self._wait_for_node(node, set())
        return node

    def start_second(self) -> RayNode:
        before = {n.node_id for n in self.nodes}  # a lost node may still be listed alive
        node = self._start("second", ["--address", self.address,
                                      "--node-ip-address", "127.0.0.2"])
        if len(self.nodes) > 1:
            self.nodes[-1] = node
        else:
            self.nodes.append(node)
        self._wait_for_node(node, before)
        return node

    def _wait_for_node(self, node: RayNode, not_ids: set[str]) -> None:
        """Until the GCS lists ``node`` alive (its raylet has registered), asked through a
        short Ray connection of this process, closed again: the fleet opens its own."""
        deadline = time.monotonic() + START_TIMEOUT_S

        def check_running() -> None:
            if not node.running:
                raise RuntimeError(f"ray start for {node.name} exited: "
                                   f"{node.log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{node.name} not up within {START_TIMEOUT_S} s: "
                                   f"{node.log_path.read_text()[-3000:]}")

        while True:  # ray.init would wait a minute for a GCS that is not there
            check_running()
            try:
                socket.create_connection(("127.0.0.1", self.gcs_port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        ray.init(address=self.address, log_to_driver=False)
        try:
            while True:
                for n in ray.nodes():
                    is_head = "node:__internal_head__" in n["Resources"]
                    if n["Alive"] and n["NodeID"] not in not_ids and (
                            n["NodeManagerAddress"] == node.ip if node.ip else is_head):
                        node.ip, node.node_id = n["NodeManagerAddress"], n["NodeID"]
                        return
                check_running()
                time.sleep(0.2)
        finally:
            ray.shutdown()

    def kill_raylet(self, node: RayNode) -> int:
        """Lose ``node`` as a crash loses it: SIGKILL to its raylet (its `ray start` then stops
        the node's other processes)."""
        raylet = node.raylet()
        assert raylet is not None, f"{node.name} has no raylet"
        os.kill(raylet.pid, signal.SIGKILL)
        return raylet.pid

    def stop(self) -> list[str]:
        """Stop every process this cluster started; return what could not be stopped."""
        problems = []
        for proc in reversed(self.started):  # the second node before the head
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
            stopped = terminate_group(proc.pid, grace_s=5, kill_wait_s=5)
            if stopped.left:
                problems.append(f"ray start {proc.pid}: {[p.title for p in stopped.left]}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        # Ray workers run in process groups of their own; each exits when its raylet is gone.
        # Any left names this cluster's session folder on its command line.
        for pid in _pids_naming(str(self.temp_dir)):
            info = process_info(pid)
            if info is not None:
                problems.append(f"left behind: {info.pid} {info.title[:120]}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return problems


def _pids_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        info = process_info(int(entry.name))
        if info is not None and info.state not in "ZX" and text in " ".join(info.cmdline):
            found.append(info.pid)
    return found
