"""The engines' API keys: read from a file or a variable, refused as a literal, never shown
(``fleetwarden.credentials``, the config's fields, the router's push)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetwarden.config import ConfigError, parse_config
from fleetwarden.credentials import CredentialError, EngineKeys, Secret, read_key
from fleetwarden.launchers.local import redacted
from fleetwarden.router.pool import BackendFacts

KEY = "sk-unit-7c1d0e"


def key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    p = tmp_path / "engine.key"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_a_secret_never_shows_itself() -> None:
    s = Secret(KEY)
    assert KEY not in repr(s) and KEY not in str(s) and KEY not in f"{s}" and KEY not in repr([s])
    assert s.reveal() == KEY and s.bearer() == {"Authorization": f"Bearer {KEY}"}


def test_a_key_is_read_from_a_file_or_a_variable(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert read_key("fleet", key_file(tmp_path), None) == Secret(KEY)
    monkeypatch.setenv("ENGINE_KEY_TEST", f"  {KEY} ")
    assert read_key("fleet", None, "ENGINE_KEY_TEST") == Secret(KEY)
    assert read_key("fleet", None, None) is None


@pytest.mark.parametrize(("case", "says"), [
    ("readable by others", "chmod 600"),
    ("empty", "holds no key"),
    ("missing", "cannot read"),
    ("unset variable", "unset or empty"),
    ("both", "both set"),
])
def test_a_key_that_cannot_be_had_names_the_field_and_the_fix(
        tmp_path: Path, case: str, says: str) -> None:
    file: Path | None = None
    env: str | None = None
    if case == "readable by others":
        file = key_file(tmp_path, mode=0o644)
    elif case == "empty":
        file = key_file(tmp_path, text="\n")
    elif case == "missing":
        file = tmp_path / "nowhere.key"
    elif case == "unset variable":
        env = "ENGINE_KEY_TEST_UNSET"
    else:
        file, env = key_file(tmp_path), "ENGINE_KEY_TEST"
    with pytest.raises(CredentialError, match=says) as caught:
        read_key("fleet.groups[1]", file, env)
    assert "fleet.groups[1]" in str(caught.value) and KEY not in str(caught.value)


def test_a_literal_key_in_the_config_is_refused_without_being_repeated() -> None:
    for data in ({"fleet": {"api_key": KEY}},
                 {"fleet": {"groups": [{"engine_cmd": "x --port {port}", "api_key": KEY}]}}):
        with pytest.raises(ConfigError) as caught:
            parse_config(data, "t")
        message = str(caught.value)
        assert "api_key" in message and "api_key_file" in message and KEY not in message


def test_a_groups_key_replaces_the_fleets_for_its_shards(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_KEY_TEST", "sk-group")
    config = parse_config({"fleet": {
        "engines": 1, "api_key_file": str(key_file(tmp_path)),
        "groups": [{"engine_cmd": "a --port {port}", "engines": 2, "api_key_env": "GROUP_KEY_TEST"},
                   {"engine_cmd": "b --port {port}", "engines": 1}],
        "backends": ["http://10.0.0.9:8000"]}}, "t")
    keys = EngineKeys.of(config.fleet)
    assert [keys.of_shard(i) for i in range(5)] == [
        Secret(KEY), Secret("sk-group"), Secret("sk-group"), Secret(KEY), Secret(KEY)]
    assert not keys.uniform and keys.any
    assert all(KEY not in s and "sk-group" not in s for s in keys.sources), keys.sources


def test_a_key_in_an_engine_command_is_not_copied_into_its_log() -> None:
    assert redacted(["vllm", "serve", "m", "--api-key", KEY, "--port", "1"]) == [
        "vllm", "serve", "m", "--api-key", "***", "--port", "1"]
    assert redacted(["llama-server", f"--api-key={KEY}"]) == ["llama-server", "--api-key=***"]


def test_the_routers_facts_never_show_the_key() -> None:
    from fleetwarden.router.ops import facts_of

    facts = BackendFacts(0, 1, key=KEY)
    assert KEY not in repr(facts) and KEY not in str(facts.to_dict())
    parsed = facts_of({"http://e": {"shard": 0, "weight_version": 1}}, {"http://e": KEY})
    assert parsed is not None and parsed["http://e"].key == KEY
