"""The engine profile table: every profile is well-formed, and each engine's body is
recognised as its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetwarden.engine_metrics import Sample, Unreadable, parse
from fleetwarden.engines import (
    ENGINE_NAMES,
    LLAMACPP,
    OPENAI,
    PROFILES,
    SGLANG,
    TGI,
    VLLM,
    CapUnknown,
    EngineProfile,
    Family,
    detect,
    generation_limits,
    output_cap_of,
    output_cap_of_server_info,
    output_default_of,
    output_default_of_server_info,
    profile,
)
from fleetwarden.model_files import generation_config_file
from fleetwarden.testing.model_folders import NO_GENERATION_CONFIG, without_generation_config

FIXTURES = Path(__file__).parent.parent / "fixtures"
BODIES = {
    "vllm": FIXTURES / "vllm" / "metrics-busy-1.txt",
    "llamacpp": FIXTURES / "llamacpp" / "metrics_busy.txt",
    "sglang": FIXTURES / "sglang" / "metrics_busy_1.txt",
    "tgi": FIXTURES / "tgi" / "metrics_busy_1.txt",
}

#: How the shell reads a model folder's generation config (the pure module reads none).
READ = generation_config_file


@pytest.mark.parametrize("name", sorted(BODIES))
def test_each_engines_body_is_recognised_as_its_own(name: str) -> None:
    assert detect(BODIES[name].read_text()) is PROFILES[name]


@pytest.mark.parametrize("name", sorted(BODIES))
def test_each_body_reads_only_under_its_own_profile(name: str) -> None:
    text = BODIES[name].read_text()
    for other in PROFILES.values():
        result = parse(text, profile=other)
        if other.name == name:
            assert isinstance(result, Sample) and not result.idle, other.name
        else:
            assert isinstance(result, Unreadable), other.name


def test_nothing_known_is_recognised_as_nothing() -> None:
    assert detect("# TYPE foo gauge\nfoo 1\n") is None
    assert detect("") is None


def test_every_profile_reads_what_the_judge_needs_or_nothing() -> None:
    for p in PROFILES.values():
        assert p.name in ENGINE_NAMES and p.progress and p.health_path.startswith("/")
        assert p.health_path != "/health_generate"  # a generation, never a liveness read
        if p.has_metrics:
            assert {"running", "waiting", "steps"} <= p.fields
            assert p.detect and all(name.startswith(p.detect) or name.startswith("process_")
                                    for name in p.families)
    assert not OPENAI.has_metrics and OPENAI.limits


def test_a_counter_that_moves_only_on_finish_is_never_the_progress_proof() -> None:
    finish_only = {LLAMACPP: "llamacpp:tokens_predicted_total",
                   SGLANG: "sglang:generation_tokens_total",
                   TGI: "tgi_request_generated_tokens"}
    for p, name in finish_only.items():
        assert p.families[name].field != "steps"
    assert VLLM.families["vllm:iteration_tokens_total"].field == "steps"


def test_a_profile_without_a_progress_counter_is_refused() -> None:
    with pytest.raises(ValueError, match="'steps'"):
        EngineProfile(name="x", title="x", detect="x:", progress="none",
                      families={"x:running": Family("gauge", "x:running", "running", True),
                                "x:waiting": Family("gauge", "x:waiting", "waiting", True)})


def test_an_unknown_engine_name_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of: auto, vllm, llamacpp, sglang, tgi"):
        profile("ollama")


def test_llamacpp_start_header_is_compared_not_read_as_time() -> None:
    text = BODIES["llamacpp"].read_text()
    a = parse(text, profile=LLAMACPP, start_header="2633240348")
    b = parse(text, profile=LLAMACPP, start_header="2680303722")
    assert isinstance(a, Sample) and isinstance(b, Sample)
    assert a.start_time != b.start_time
    garbled = parse(text, profile=LLAMACPP, start_header="soon")
    assert isinstance(garbled, Sample) and garbled.start_time is None


def test_tgi_counters_written_without_total_are_read() -> None:
    sample = parse(BODIES["tgi"].read_text(), profile=TGI)
    assert isinstance(sample, Sample)
    assert (sample.running, sample.waiting, sample.steps) == (4, 2, 9 + 1730)


@pytest.mark.parametrize(("command", "cap"), [
    ("vllm serve m --port {port} --override-generation-config '{{\"max_new_tokens\": 64}}'", 64),
    ("vllm serve m --override-generation-config='{{\"max_new_tokens\": 8, \"temperature\": 0}}'"
     " --port {port}", 8),
    ("vllm serve m --port {port} --override-generation-config '{{\"temperature\": 0.5}}'", None),
    ("vllm serve m --port {port}", None),
    (None, None),
    ("vllm serve m --override-generation-config '{{not json}}' --port {port}", None),
    ("vllm serve m --override-generation-config '{{\"max_new_tokens\": 0}}'", None),
])
def test_the_server_cap_an_engine_command_sets(command: str | None, cap: int | None) -> None:
    assert output_cap_of(command) == cap


#: A real vLLM 0.32 ``GET /server_info?config_format=json``, started with
#: ``--override-generation-config '{"max_new_tokens": 120}'`` (its environment left out:
#: ``tests/fixtures/vllm/server-info/README.md``).
SERVER_INFO = FIXTURES / "vllm" / "server-info" / "server-info-override-120.json"


def _server_info(generation_config: str, override: dict[str, Any]) -> bytes:
    info = json.loads(SERVER_INFO.read_text())
    info["vllm_config"]["model_config"].update(generation_config=generation_config,
                                                override_generation_config=override)
    return json.dumps(info).encode()


def test_the_server_cap_a_real_server_info_shows() -> None:
    assert output_cap_of_server_info(SERVER_INFO.read_bytes()) == 120


# vLLM 0.32's serving classes (entrypoints/openai/chat_completion/serving.py and the others):
#   override_max_tokens = (default_sampling_params.get("max_tokens")
#                          if generation_config not in ("auto", "vllm")
#                          else override_generation_config.get("max_new_tokens"))
# where default_sampling_params is a folder's generation_config.json updated by the override
# (ModelConfig.get_diff_sampling_param). Under "auto" the model's own max_new_tokens is only a
# request's default, never this cap.
@pytest.mark.parametrize(("generation_config", "override", "cap"), [
    ("auto", {"max_new_tokens": 64}, 64),
    ("vllm", {"max_new_tokens": 64, "temperature": 0.5}, 64),
    ("auto", {}, None),
    ("vllm", {"temperature": 0.5}, None),
    ("/models/gen", {"max_new_tokens": 32}, 32),
    ("/models/gen", {"max_new_tokens": None}, None),  # the override unsets the folder's
])
def test_the_server_cap_mirrors_vllms_override_max_tokens(
        generation_config: str, override: dict[str, Any], cap: int | None) -> None:
    assert output_cap_of_server_info(_server_info(generation_config, override)) == cap


@pytest.mark.parametrize(("body", "why"), [
    (_server_info("/models/gen", {}), "generation_config.json caps every request"),
    (_server_info("/models/gen", {"temperature": 0}), "not readable on this host"),
    (_server_info("auto", {"max_new_tokens": 0}), "is not an integer >= 1"),
    (_server_info("auto", {"max_new_tokens": "64"}), "is not an integer >= 1"),
    (b"<html>", "not JSON"),
    (b'{"vllm_config": "ModelConfig(model=...)"}', "no vllm_config.model_config"),
])
def test_a_server_info_that_does_not_tell_the_cap_says_why(body: bytes, why: str) -> None:
    said = output_cap_of_server_info(body)
    assert isinstance(said, CapUnknown) and said.settled and why in said.why


def _model_folder(tmp_path: Path, max_new_tokens: object) -> str:
    """A local model folder whose generation_config.json sets ``max_new_tokens``."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "max_new_tokens": max_new_tokens}))
    return str(tmp_path)


@pytest.mark.parametrize(("template", "limits"), [
    # auto (vLLM's default): the model folder's file is the default of a request naming none,
    # no cap; vLLM's serve takes its positional model over --model
    ("vllm serve {m} --port {{port}}", (None, 48)),
    ("python -m vllm.entrypoints.openai.api_server --model={m} --port {{port}}", (None, 48)),
    ("vllm serve {m} --model /elsewhere", (None, 48)),
    ("vllm serve other --hf-config-path {m}", (None, 48)),  # auto reads hf_config_path's
    # an override's max_new_tokens replaces the file's, and caps every request under auto
    ("vllm serve {m} --override-generation-config '{{{{\"max_new_tokens\": 20}}}}'", (20, 20)),
    ("vllm serve {m} --override-generation-config '{{{{\"max_new_tokens\": null}}}}'",
     (None, None)),
    # vllm: the file is ignored
    ("vllm serve {m} --generation-config vllm", (None, None)),
    # a folder: its file is both the default and the cap on every request
    ("vllm serve hub/name --generation-config {m}", (48, 48)),
    ("vllm serve hub/name --generation-config={m} --override-generation-config "
     "'{{{{\"max_new_tokens\": 30}}}}'", (30, 30)),
    # no readable file: the default is not known (a hub name, another host's path)
    ("vllm serve hub/name --port {{port}}", (None, "unknown")),
])
def test_an_engine_commands_limits_mirror_vllms_generation_config(
        tmp_path: Path, template: str, limits: tuple[int | None, int | None]) -> None:
    command = template.format(m=_model_folder(tmp_path, 48))
    default = output_default_of(command, READ)
    assert (output_cap_of(command, READ),
            "unknown" if isinstance(default, CapUnknown) else default) == limits


@pytest.mark.parametrize(("command", "limits"), [
    ("/opt/llama/bin/llama-server -m m.gguf --port {port} -n 8", (None, 8)),
    ("env LD_LIBRARY_PATH=/x llama-server -m m.gguf --n-predict=64 -np 4", (None, 64)),
    ("llama-server -m m.gguf --predict 12 -n 30", (None, 30)),  # the last one named
    ("llama-server -m m.gguf -n -1", (None, None)),  # its default: no limit
    ("llama-server -m m.gguf -n -2", (None, None)),  # until the context is full
    ("llama-server -m m.gguf --port {port}", (None, None)),
    ("llama-server -m m.gguf -n many", (None, "unknown")),
    # a vLLM command's -n is not llama-server's (vLLM has none): its file decides
    ("vllm serve hub/name -n 8", (None, "unknown")),
])
def test_a_llama_server_commands_n_is_its_default_and_caps_nothing(
        command: str, limits: tuple[int | None, int | str | None]) -> None:
    """llama-server's ``-n`` is what a request that names no limit gets; one that names a
    limit is not held to it (tests/llamacpp: the real server agrees)."""
    default = output_default_of(command)
    assert (output_cap_of(command),
            "unknown" if isinstance(default, CapUnknown) else default) == limits


@pytest.mark.parametrize(("source", "override", "limits"), [
    ("auto", {}, (None, 48)),
    ("vllm", {}, (None, None)),
    ("auto", {"max_new_tokens": 9}, (9, 9)),
    ("FOLDER", {}, (48, 48)),
    ("FOLDER", {"max_new_tokens": None}, (None, None)),  # the override unsets the file's
])
def test_generation_limits_mirror_get_diff_sampling_param(
        tmp_path: Path, source: str, override: dict[str, Any],
        limits: tuple[int | None, int | None]) -> None:
    folder = _model_folder(tmp_path, 48)
    assert generation_limits(folder, folder if source == "FOLDER" else source,
                             override, read=READ) == limits


def test_an_unreadable_or_bad_generation_config_leaves_the_default_unknown(
        tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    cap, default = generation_limits(missing, "auto", {}, read=READ)
    assert cap is None and isinstance(default, CapUnknown)
    cap, default = generation_limits("hub/x", missing, {}, read=READ)
    assert isinstance(cap, CapUnknown) and isinstance(default, CapUnknown)
    cap, default = generation_limits(_model_folder(tmp_path, "64"), "auto", {}, read=READ)
    assert cap is None and isinstance(default, CapUnknown) and ">= 1" in default.why
    assert generation_limits(_model_folder(tmp_path, None), "auto", {}, read=READ) == (None, None)


@pytest.mark.parametrize("case", sorted(NO_GENERATION_CONFIG))
def test_a_folder_without_a_generation_config_gives_its_config_jsons_default(
        tmp_path: Path, case: str) -> None:
    """vLLM falls back to the model's config.json (tests/vllm/test_real_oracle.py checks each
    case against vLLM's own ModelConfig)."""
    folder = without_generation_config(tmp_path / "model", case)
    default = NO_GENERATION_CONFIG[case][2]
    assert generation_limits(folder, "auto", {}, read=READ) == (None, default)
    # under --generation-config FOLDER, the same file is also the cap on every request
    assert generation_limits("hub/x", folder, {}, read=READ) == (default, default)
    assert output_default_of(f"vllm serve {folder} --port 8000", READ) == default


def test_a_server_infos_model_folder_gives_its_default(tmp_path: Path) -> None:
    """An attached engine in dev mode: ``/server_info`` names its model's path; where that is
    a folder on this host, its file is read as vLLM did."""
    folder = _model_folder(tmp_path, 48)
    info = json.loads(_server_info("auto", {}))
    info["vllm_config"]["model_config"]["model"] = folder
    body = json.dumps(info).encode()
    assert output_cap_of_server_info(body, READ) is None
    assert output_default_of_server_info(body, READ) == 48
    # the pure module reads no file itself: not known
    assert isinstance(output_default_of_server_info(body), CapUnknown)
    info["vllm_config"]["model_config"]["model"] = str(tmp_path / "elsewhere")
    assert isinstance(output_default_of_server_info(json.dumps(info).encode(), READ), CapUnknown)
    info["vllm_config"]["model_config"].update(model="hub/x", generation_config=folder)
    body = json.dumps(info).encode()
    assert output_cap_of_server_info(body, READ) == 48
    assert output_default_of_server_info(body, READ) == 48
