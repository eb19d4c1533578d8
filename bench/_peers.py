"""Peer routers for side-by-side benchmarks, and the processes they run in.

Shared by ``router_overhead.py`` and ``failover.py``. Every peer runs as a separate process in
a session of its own, so that stopping it stops everything it started (nginx's workers, a Rust
router's threads) and nothing else. A peer that cannot be installed or started here raises
:class:`PeerUnavailable` with the cause: the benchmarks report it as "not run: cause", never
leave it out silently.

- pip peers (sglang-router, vllm-router) each get a virtual environment of their own under
  ``~/.cache/fleetwarden/bench-venvs/``, created on first use.
- nginx comes from Debian's package (``apt-get install -y nginx`` when it is missing and we
  are root) and runs in the foreground with a config under a temporary folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "SGLANG_ROUTER",
    "VENVS",
    "VLLM_ROUTER",
    "PeerUnavailable",
    "ensure_nginx",
    "free_port",
    "installed_version",
    "nginx_config",
    "nginx_version",
    "peer_python",
    "process",
    "stop_group",
]

VENVS = Path.home() / ".cache" / "fleetwarden" / "bench-venvs"
SGLANG_ROUTER = "sglang-router==0.3.2"
#: Unpinned, as the issue asks; the version found is reported beside every figure.
VLLM_ROUTER = "vllm-router"

#: A stuck pip or apt must end in "not run: ...", not in a hung benchmark.
_INSTALL_TIMEOUT_S = 600.0


class PeerUnavailable(RuntimeError):
    """This peer cannot be installed or started here; the message says why."""


#: Ports this process handed out: runs side by side (``bench/replay.py --parallel``) never get
#: the same one between its draw and its bind.
_HANDED: set[int] = set()
_HANDED_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used; this
    one never hands it out twice)."""
    with _HANDED_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED:
                _HANDED.add(port)
                return port


def stop_group(proc: subprocess.Popen[str] | subprocess.Popen[bytes],
               grace_s: float = 10.0) -> None:
    """SIGTERM the process group that ``proc`` leads, SIGKILL it after ``grace_s``, reap."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    # Whatever is left of the group (children of a leader that already exited) goes too.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@contextlib.contextmanager
def process(argv: list[str], **kwargs: object) -> Iterator[subprocess.Popen[str]]:
    """``argv`` in a new session (its own process group), stopped as a group on exit."""
    kwargs.setdefault("stdout", subprocess.PIPE)
    proc = subprocess.Popen(argv, text=True, start_new_session=True,
                            **kwargs)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        stop_group(proc)


def peer_python(requirement: str) -> Path:
    """The Python of a virtual environment holding ``requirement``; created on first use."""
    venv = VENVS / requirement.replace("==", "-")
    python = venv / "bin" / "python"
    marker = venv / ".fleetwarden-installed"
    if marker.exists() and python.exists():
        return python
    print(f"installing {requirement} into {venv} ...", file=sys.stderr, flush=True)
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                           capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", requirement],
                       check=True, capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-3:]
        raise PeerUnavailable(f"pip install {requirement} failed: {' / '.join(tail)}") from None
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"pip install {requirement}: no end after "
                              f"{_INSTALL_TIMEOUT_S:.0f} s") from None
    marker.touch()
    return python


def installed_version(python: Path, distribution: str) -> str:
    out = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, sys; "
                            "print(m.version(sys.argv[1]))", distribution],
        capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "?"


def ensure_nginx() -> str:
    """The nginx binary; installs Debian's package when it is missing and we are root."""
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                      else None)
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PeerUnavailable("nginx is not installed (apt-get install nginx needs root)")
    print("installing nginx (apt-get install -y nginx) ...", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    deadline = time.monotonic() + _INSTALL_TIMEOUT_S
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "nginx"]):
        while True:  # another session may hold dpkg's lock for a while
            done = subprocess.run(argv, capture_output=True, text=True, env=env,
                                  timeout=_INSTALL_TIMEOUT_S)
            if done.returncode == 0:
                break
            if "lock" in done.stderr and time.monotonic() < deadline:
                time.sleep(5)
                continue
            tail = done.stderr.strip().splitlines()[-2:]
            raise PeerUnavailable(f"{' '.join(argv)} failed: {' / '.join(tail)}")
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(found).exists():
        raise PeerUnavailable("apt-get installed nginx, but no nginx binary was found")
    return found


def nginx_version(binary: str) -> str:
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=30)
    return (out.stderr or out.stdout).strip().rpartition("/")[2] or "?"


def nginx_config(folder: Path, port: int, upstreams: list[str], *, max_fails: int,
                 fail_timeout_s: int, read_timeout_s: float, connect_timeout_s: float = 2.0,
                 tries: int = 3,
                 next_upstream: str = "error timeout http_500 http_502 http_503 non_idempotent"
                 ) -> Path:
    """A foreground nginx proxying 127.0.0.1:``port`` to ``upstreams`` with passive health
    checks: an upstream that fails ``max_fails`` times within ``fail_timeout_s`` is left out for
    ``fail_timeout_s``; a response that takes longer than ``read_timeout_s`` between two reads
    is a failure. By default POSTs are re-sent to the next upstream (``non_idempotent``): a
    completion may be repeated safely here, and fleetwarden re-sends them too. ``tries`` 0:
    unbounded (nginx's default)."""
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    servers = "\n".join(
        f"    server {u.removeprefix('http://')} max_fails={max_fails} "
        f"fail_timeout={fail_timeout_s}s;" for u in upstreams)
    # As root the workers would switch to "nobody", who cannot write into our 0700 temp folder.
    user = "user root;\n" if os.geteuid() == 0 else ""
    def ms(seconds: float) -> str:
        return f"{round(seconds * 1000)}ms"

    conf = folder / "nginx.conf"
    conf.write_text(f"""{user}worker_processes 1;
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {folder}/body;
  proxy_temp_path {folder}/proxy;
  fastcgi_temp_path {folder}/fastcgi;
  uwsgi_temp_path {folder}/uwsgi;
  scgi_temp_path {folder}/scgi;
  upstream engines {{
{servers}
    keepalive 32;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_connect_timeout {ms(connect_timeout_s)};
      proxy_send_timeout {ms(read_timeout_s)};
      proxy_read_timeout {ms(read_timeout_s)};
      proxy_next_upstream {next_upstream};
      proxy_next_upstream_tries {tries};
    }}
  }}
}}
""")
    return conf
