"""Config: defaults with reasons, a commented example, errors that name the key."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fleetwarden.config import (
    Config,
    ConfigError,
    FleetConfig,
    RouterConfig,
    example_toml,
    load_config,
    parse_config,
)
from fleetwarden.judge import WatchdogPolicy
from fleetwarden.ledger import Policy
from fleetwarden.router.settings import RouterSettings


def test_the_example_is_valid_toml_and_equals_the_defaults() -> None:
    text = example_toml()
    assert parse_config(tomllib.loads(text)) == Config()
    assert "# The floor of the stall limit" in text  # reasons come along, from where they live
    assert "# Seconds between controller ticks" in text


def test_invalid_config_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[router]\nport = "eighty"\nbogus = 1\n[fleet]\nweights = "dynamic"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert str(path) in text
    assert "router.port = 'eighty'" in text and "integer" in text
    assert "router.bogus" in text and "allowed here:" in text and "max_retries" in text
    assert "fleet.weights = 'dynamic'" in text and "'static' or 'trainer'" in text


def test_504_is_never_a_configured_status() -> None:
    with pytest.raises(ConfigError, match="504"):
        parse_config({"router": {"status_when_others_serve": 504}})


def test_a_fleet_without_engines_or_backends_is_refused() -> None:
    with pytest.raises(ConfigError, match="engines > 0, a group, or at least one backends URL"):
        parse_config({"fleet": {"engines": 0}})


def test_an_engine_command_without_a_port_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"\{port\}"):
        parse_config({"fleet": {"engine_cmd": "vllm serve m"}})


def test_bad_toml_and_missing_files_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[fleet\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_restart_cap_defaults_to_a_quarter_of_the_fleet() -> None:
    sup = Config().supervisor
    assert [sup.concurrency_cap(n) for n in (1, 4, 8, 64)] == [1, 1, 2, 16]


def test_config_example_command_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "fleetwarden", "config", "--example"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert parse_config(tomllib.loads(out.stdout)) == Config()


def test_the_ray_launcher_is_chosen_in_the_fleet_section() -> None:
    fleet = Config().fleet
    assert fleet.launcher == "local"  # nothing but this machine by default
    assert fleet.ray_resources == {"GPU": 1.0} and fleet.ray_scheduling == "SPREAD"
    cfg = parse_config({"fleet": {"launcher": "ray", "ray_address": "10.0.0.1:6379",
                                  "ray_resources": {"engine_slot": 1, "CPU": 2}}})
    assert cfg.fleet.ray_resources == {"engine_slot": 1.0, "CPU": 2.0}
    assert cfg.fleet.ray_address == "10.0.0.1:6379"


def test_bad_ray_settings_name_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"fleet": {"launcher": "k8s", "ray_resources": {"GPU": 0},
                                "ray_scheduling": "PACK"}})
    text = str(err.value)
    assert "fleet.launcher = 'k8s'" in text and "'local' or 'ray'" in text
    assert "fleet.ray_resources.GPU = 0" in text and "greater than 0" in text
    assert "fleet.ray_scheduling = 'PACK'" in text


def test_backend_urls_are_normalised_once_at_the_config() -> None:
    """A URL written with a trailing slash is the same engine: the router, the ledger and the
    watchdog must all use one spelling, or outcomes match no shard."""
    fleet = FleetConfig(engines=0, backends=["http://127.0.0.1:8000/", " http://10.0.0.2:8000//"])
    assert fleet.backends == ["http://127.0.0.1:8000", "http://10.0.0.2:8000"]
    with pytest.raises(ValueError, match="same engine"):
        FleetConfig(engines=0, backends=["http://127.0.0.1:8000/", "http://127.0.0.1:8000"])


@pytest.mark.parametrize("url", ["http://10.0.0.2:8000/v1", "http://10.0.0.2:8000/v1/",
                                 "http://10.0.0.2:8000?x=1", "http://10.0.0.2:8000#top"])
def test_a_backend_url_with_a_path_is_refused_naming_the_field(url: str) -> None:
    """The router, the watchdog and the supervisor add their paths (``/v1/completions``,
    ``/metrics``, ``/health``) to a backend's URL: one with a path of its own
    (``http://host:8000/v1``) would be read at ``/v1/v1/completions`` and judged dead."""
    with pytest.raises(ValueError, match=r"backends: .* engine's root"):
        FleetConfig(engines=0, backends=[url])


def test_a_backend_table_declares_its_output_cap() -> None:
    """An attached engine that says nothing of its server cap (no vLLM dev mode) has it
    declared on its `[[fleet.backends]]` table: tokens, or "none" (docs/configuration.md)."""
    config = parse_config(tomllib.loads(
        '[fleet]\nengines = 1\noutput_cap = 32\n'
        '[[fleet.groups]]\nengine_cmd = "vllm serve m --port {port}"\noutput_cap = "none"\n'
        '[[fleet.backends]]\nurl = "http://10.0.0.5:8000/"\noutput_cap = 64\n'
        '[[fleet.backends]]\nurl = "http://10.0.0.6:8000"\n'
        '[[fleet.backends]]\nurl = "http://10.0.0.7:8000"\noutput_cap = "none"\n'))
    fleet = config.fleet
    assert fleet.backends == ["http://10.0.0.5:8000", "http://10.0.0.6:8000",
                              "http://10.0.0.7:8000"]
    assert [fleet.declared_output_cap(i) for i in range(5)] == [32, "none", 64, None, "none"]
    mixed = FleetConfig.model_validate({"engines": 0, "backends": [
        "http://a:1", {"url": "http://b:1", "output_cap": 8}]})
    assert mixed.backends == ["http://a:1", "http://b:1"]
    assert mixed.backend_output_caps == {"http://b:1": 8}


def test_a_model_default_is_declared_where_this_host_cannot_read_it() -> None:
    """A chat that names no limit gets its model's generation config default; where this host
    cannot read it, `output_default` declares it (tokens, or "none"), as `output_cap`."""
    config = parse_config(tomllib.loads(
        '[fleet]\nengines = 1\noutput_default = 512\n'
        '[[fleet.groups]]\nengine_cmd = "vllm serve m --port {port}"\noutput_default = "none"\n'
        '[[fleet.backends]]\nurl = "http://10.0.0.5:8000"\noutput_default = 256\n'
        'output_cap = 1024\n'
        '[[fleet.backends]]\nurl = "http://10.0.0.6:8000"\n'))
    fleet = config.fleet
    assert [fleet.declared_output_default(i) for i in range(4)] == [512, "none", 256, None]
    assert [fleet.declared_output_cap(i) for i in range(4)] == [None, None, 1024, None]
    assert fleet.backend_output_defaults == {"http://10.0.0.5:8000": 256}


@pytest.mark.parametrize(("toml", "error"), [
    ('[[fleet.backends]]\nurl = "http://a:1"\noutput_cap = 0\n',
     'backends[0].output_cap: must be an integer >= 1 (tokens) or "none", got 0'),
    ('[[fleet.backends]]\nurl = "http://a:1"\noutput_cap = "unbounded"\n',
     "backends[0].output_cap: must be"),
    ('[[fleet.backends]]\nurl = "http://a:1"\noutput_cap = true\n',
     "backends[0].output_cap: must be"),
    ('[[fleet.backends]]\nurl = "http://a:1"\ncap = 3\n',
     "backends[0]: unknown field(s) cap"),
    ('[[fleet.backends]]\noutput_cap = 3\n', "backends[0].url: give the engine's URL"),
    ('[fleet]\noutput_cap = -1\n', "output_cap: must be an integer >= 1"),
    ('[fleet]\noutput_default = 0\n', "output_default: must be an integer >= 1"),
    ('[[fleet.groups]]\nengine_cmd = "x {port}"\noutput_default = "all"\n',
     "output_default: must be an integer >= 1"),
    ('[[fleet.backends]]\nurl = "http://a:1"\noutput_default = false\n',
     "backends[0].output_default: must be"),
    ('[fleet]\nengines = 0\nbackends = ["http://a:1"]\n[fleet.backend_output_defaults]\n'
     '"http://b:1" = 4\n', "backend_output_defaults: 'http://b:1' is not one of the backends"),
    ('[fleet]\nengines = 0\nbackends = ["http://a:1"]\n[fleet.backend_output_caps]\n'
     '"http://b:1" = 4\n', "'http://b:1' is not one of the backends"),
])
def test_a_bad_output_cap_is_refused_naming_the_field(toml: str, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        parse_config(tomllib.loads(toml))


def test_engine_kinds_are_the_profiles_names() -> None:
    from typing import get_args

    from fleetwarden.config import EngineName
    from fleetwarden.engines import ENGINE_NAMES

    assert get_args(EngineName) == ENGINE_NAMES


def test_groups_number_their_shards_after_the_fleets_own() -> None:
    cfg = parse_config({"fleet": {
        "engines": 2, "engine": "vllm", "backends": ["http://10.0.0.9:8000"],
        "groups": [{"engines": 2, "engine": "llamacpp", "engine_cmd": "llama-server --port {port}"},
                   {"engine": "sglang", "engine_cmd": "sglang --port {port}"}]}})
    f = cfg.fleet
    assert f.launched == 5
    assert [f.engine_of(i) for i in range(6)] == [
        "vllm", "vllm", "llamacpp", "llamacpp", "sglang", "vllm"]
    group = f.group_of(4)
    assert group is not None and group.engine_cmd == "sglang --port {port}"
    assert f.group_of(0) is None and f.group_of(5) is None


def test_a_bad_engine_kind_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"fleet.groups.0.engine = 'ollama': must be one of"):
        parse_config({"fleet": {"groups": [{"engine": "ollama", "engine_cmd": "x {port}"}]}})
    with pytest.raises(ConfigError, match=r"fleet.engine = 'vlm'"):
        parse_config({"fleet": {"engine": "vlm"}})


def test_a_group_command_needs_its_port() -> None:
    with pytest.raises(ConfigError, match=r"must contain \{port\}"):
        parse_config({"fleet": {"groups": [{"engine": "llamacpp", "engine_cmd": "llama"}]}})


def test_hedges_are_on_by_default_and_0_turns_them_off() -> None:
    assert Config().health.hedge_after_s == 1.0
    assert parse_config({"health": {"hedge_after_s": 0}}).health.hedge_after_s == 0
    with pytest.raises(ConfigError) as err:
        parse_config({"health": {"hedge_after_s": -1}})
    assert "health.hedge_after_s = -1" in str(err.value)


def _check(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """``fleetwarden config --check`` on a file holding ``text``."""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return subprocess.run([sys.executable, "-m", "fleetwarden", "config", "--check", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_config_check_refuses_an_ejection_base_above_its_max(tmp_path: Path) -> None:
    done = _check(tmp_path, "[health]\nejection_base_s = 90\nejection_max_s = 60\n")
    assert done.returncode != 0
    assert "health" in done.stderr and "ejection_base_s (90)" in done.stderr
    assert "ejection_max_s (60)" in done.stderr
    assert _check(tmp_path, "[health]\nejection_base_s = 60\nejection_max_s = 60\n"
                  ).returncode == 0


@pytest.mark.parametrize(("text", "named"), [
    ('[fleet]\nengine_cmd = "vllm serve {model} --port {port}"\n', "engine_cmd: {model}"),
    ('[fleet]\nengine_cmd = "run --port {port} --json {\\"a\\": 1}"\n', "engine_cmd: "),
    ('[fleet]\nengine_cmd = "run --port {port}"\nengine_env = { TAG = "s{shards}" }\n',
     "engine_env.TAG: {shards}"),
    ('[fleet]\nengines = 0\nbackends = ["http://a:8000"]\n'
     'restart_command = "kubectl delete pod {pod}"\n', "restart_command: {pod}"),
    ('[[fleet.groups]]\nengine_cmd = "llama-server --port {port} -m {0}"\n',
     "engine_cmd: {0}"),
])
def test_config_check_refuses_a_brace_that_is_no_placeholder(tmp_path: Path, text: str,
                                                              named: str) -> None:
    done = _check(tmp_path, text)
    assert done.returncode != 0, done.stdout
    assert named in done.stderr


def test_doubled_braces_and_known_placeholders_pass_the_check(tmp_path: Path) -> None:
    done = _check(tmp_path, '[fleet]\nengine_cmd = "run --host {host} --port {port} '
                  '--json {{\\"shard\\": {shard}}} --py {python}"\n'
                  'restart_command = "systemctl restart vllm@{shard} # {url} {name}"\n')
    assert done.returncode == 0, done.stderr


def _exposed() -> list[tuple[str, str, type, str]]:
    """Every policy setting the file exposes: (section, key, policy, the policy's name)."""
    out = []
    for section, field in Config.model_fields.items():
        model = field.annotation
        assert isinstance(model, type)
        for key in model.model_fields:
            owner = model.owner_of(key)  # type: ignore[attr-defined]
            if owner is not None:
                out.append((section, key, *owner))
    return out


def test_a_policy_setting_takes_its_default_from_the_policy_that_owns_it() -> None:
    exposed = _exposed()
    assert ("health", "probe_timeout_s", WatchdogPolicy, "read_timeout_s") in exposed
    assert ("supervisor", "max_restart_attempts", Policy, "max_restart_attempts") in exposed
    assert {policy for _, _, policy, _ in exposed} == {WatchdogPolicy, Policy, RouterSettings}
    defaults = Config()
    for section, key, policy, name in exposed:
        assert getattr(getattr(defaults, section), key) == getattr(policy(), name), (section, key)
    # One field per policy setting: two sections setting one would leave the policy to whichever
    # came last.
    owned = [(policy, name) for _, _, policy, name in exposed]
    assert len(owned) == len(set(owned))


def test_each_policy_is_built_from_the_fields_that_stand_for_it() -> None:
    cfg = parse_config({
        "health": {"probe_timeout_s": 7, "stall_s": 6, "unhealthy_threshold": 4,
                   "ejection_max_s": 90},
        "supervisor": {"max_restart_attempts": 9},
        "fleet": {"weights": "trainer"},
        "router": {"max_retries": 3, "routing": "cache_aware"}})
    watchdog = cfg.health.watchdog_policy()
    assert (watchdog.read_timeout_s, watchdog.stall_s) == (7, 6)
    assert watchdog.check_interval_s == WatchdogPolicy().check_interval_s  # not in the file
    assert cfg.ledger_policy() == Policy(unhealthy_threshold=4, ejection_max_s=90,
                                         max_restart_attempts=9, weights="trainer")
    settings = cfg.router.settings()
    assert (settings.max_retries, settings.routing) == (3, "cache_aware")


def test_the_routing_choices_are_the_routers() -> None:
    from typing import get_args

    from fleetwarden.router.settings import ROUTING_POLICIES

    annotation = RouterConfig.model_fields["routing"].annotation
    assert set(get_args(annotation)) == set(ROUTING_POLICIES)


def test_config_check_reads_the_engines_key_and_never_shows_one(tmp_path: Path) -> None:
    """A key's file or variable that cannot be read fails `config --check` naming the field;
    a literal key is refused without being repeated."""
    done = _check(tmp_path, '[fleet]\napi_key_env = "FLEETWARDEN_TEST_UNSET_KEY"\n')
    assert done.returncode == 2 and "fleet.api_key_env" in done.stderr, done.stderr
    done = _check(tmp_path, f'[fleet]\napi_key_file = "{tmp_path / "none.key"}"\n')
    assert done.returncode == 2 and "fleet.api_key_file: cannot read" in done.stderr
    done = _check(tmp_path, '[fleet]\napi_key = "sk-literal-in-config"\n')
    assert done.returncode == 2 and "api_key_file" in done.stderr
    assert "sk-literal-in-config" not in done.stderr + done.stdout
