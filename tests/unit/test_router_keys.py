"""Keys on the data port (router/keys.py): the file's format and its mistakes, the hash, the
constant-time check, the client's key replaced toward the engines, the reload, and what the
router counts per key. No sockets and no sleeps: the scenario tier
(tests/scenario/test_router_keys.py) drives a real router process."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from fleetwarden.config import RouterConfig
from fleetwarden.router import keys as keys_module
from fleetwarden.router.keys import (
    KEY_PREFIX,
    MAX_KEY_BYTES,
    KeyRing,
    KeysFile,
    KeysFileError,
    add_key,
    hash_secret,
    new_secret,
    parse_keys,
    read_keys,
    remove_key,
    without_client_key,
)
from fleetwarden.router.pool import Pool
from fleetwarden.router.routes import _usage_of
from fleetwarden.router.settings import RouterSettings
from fleetwarden.router.stats import RouterStats, make_registry
from support.keys import recorded_comparisons

HASH_A = hash_secret("sk-fw-alpha")
HASH_B = hash_secret("sk-fw-beta")


def bearer(secret: str) -> bytes:
    return b"Bearer " + secret.encode()


# ---------------------------------------------------------------- the hash and the secret

def test_a_key_is_stored_as_its_sha256_and_never_as_itself() -> None:
    secret = new_secret()
    stored = hash_secret(secret)
    assert stored == "sha256:" + hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in stored


def test_new_secrets_carry_the_prefix_and_256_random_bits() -> None:
    secrets = {new_secret() for _ in range(50)}
    assert len(secrets) == 50
    for secret in secrets:
        assert secret.startswith(KEY_PREFIX)
        assert len(secret) == len(KEY_PREFIX) + 43  # token_urlsafe(32): 43 characters
        assert len(secret) <= MAX_KEY_BYTES


# ---------------------------------------------------------------- the file's format

def test_the_file_holds_one_named_hash_a_line_with_comments_and_blank_lines() -> None:
    text = f"# who may call\n\nalpha {HASH_A}\n  beta   {HASH_B}   # the trainer\n"
    assert parse_keys(text) == {"alpha": HASH_A, "beta": HASH_B}


@pytest.mark.parametrize(("text", "names"), [
    (f"alpha {HASH_A} extra\n", ("line 1", "3 field(s)")),
    (f"ok {HASH_A}\nalpha\n", ("line 2", "1 field(s)")),
    (f"-alpha {HASH_A}\n", ("line 1", "name '-alpha'")),
    (f"al/pha {HASH_A}\n", ("line 1", "name 'al/pha'")),
    ("alpha sk-fw-plaintext\n", ("line 1", "hash of 'alpha'", "fleetwarden keys add")),
    ("alpha sha256:ABCDEF\n", ("line 1", "hash of 'alpha'")),
    (f"alpha {HASH_A}\n\nalpha {HASH_B}\n", ("line 3", "name 'alpha'", "another line")),
    (f"alpha {HASH_A}\nbeta {HASH_A}\n", ("line 2", "'beta'", "same secret as 'alpha'")),
])
def test_a_mistake_in_the_file_names_its_line_and_field(text: str,
                                                        names: tuple[str, ...]) -> None:
    with pytest.raises(KeysFileError) as caught:
        parse_keys(text, "keys file k.txt")
    message = str(caught.value)
    assert message.startswith("keys file k.txt ")
    for part in names:
        assert part in message, (part, message)


def test_a_missing_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match=r"does not exist.*fleetwarden keys add"):
        read_keys(tmp_path / "keys")


# ---------------------------------------------------------------- checking a presented key

def test_a_bearer_key_of_the_ring_is_named_and_anything_else_is_not() -> None:
    ring = KeyRing({"alpha": HASH_A, "beta": HASH_B})
    assert ring.name_for(bearer("sk-fw-alpha")) == "alpha"
    assert ring.name_for(bearer("sk-fw-beta")) == "beta"
    assert ring.name_for(b"bearer sk-fw-alpha") == "alpha"  # the scheme is case-insensitive
    assert ring.name_for(bearer("sk-fw-alph")) is None
    assert ring.name_for(b"Basic c2stZnctYWxwaGE=") is None
    assert ring.name_for(b"sk-fw-alpha") is None  # a bare key: not Bearer
    assert ring.name_for(b"Bearer ") is None
    assert ring.name_for(b"") is None
    assert ring.name_for(HASH_A.encode()) is None  # the stored hash is no key


def test_a_presented_key_past_the_longest_one_is_refused_without_hashing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ring = KeyRing({"alpha": HASH_A})
    hashed: list[int] = []
    real = hashlib.sha256

    def counting(data: bytes = b"") -> object:
        hashed.append(len(data))
        return real(data)

    monkeypatch.setattr(keys_module.hashlib, "sha256", counting)
    assert ring.name_for(b"Bearer " + b"k" * (MAX_KEY_BYTES + 1)) is None
    assert hashed == []
    assert ring.name_for(b"Bearer " + b"k" * 60_000) is None
    assert hashed == []


def test_keys_are_decided_by_hmac_compare_digest_on_whole_digests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ring = KeyRing({"alpha": HASH_A, "beta": HASH_B})
    calls = recorded_comparisons(monkeypatch)
    assert ring.name_for(bearer("sk-fw-alpha")) == "alpha"
    digest = hashlib.sha256(b"sk-fw-alpha").digest()
    assert calls == [(digest, digest)]  # the whole 32-byte digest, never the secret
    # A digest whose first bytes match a stored one is still decided by compare_digest.
    calls.clear()
    monkeypatch.setattr(keys_module, "_PREFIX_BYTES", 0)  # every key shares the lookup
    ring = KeyRing({"alpha": HASH_A, "beta": HASH_B})
    assert ring.name_for(bearer("sk-fw-gamma")) is None
    assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)


# ---------------------------------------------------------------- toward the engines

def test_the_clients_key_never_goes_on_and_the_engines_key_takes_its_place() -> None:
    headers = [(b"Host", b"router"), (b"Authorization", b"Bearer sk-fw-alpha"),
               (b"content-type", b"application/json"), (b"AUTHORIZATION", b"Bearer again")]
    assert without_client_key(headers, None) == [(b"Host", b"router"),
                                                  (b"content-type", b"application/json")]
    assert without_client_key(headers, b"Bearer engine-key") == [
        (b"Host", b"router"), (b"content-type", b"application/json"),
        (b"Authorization", b"Bearer engine-key")]


# ---------------------------------------------------------------- the file as it changes

def test_keys_added_and_removed_are_reread_and_an_unchanged_file_is_not(
        tmp_path: Path) -> None:
    path = tmp_path / "keys"
    alpha = add_key(path, "alpha")
    keys = KeysFile(path)
    assert keys.ring.name_for(bearer(alpha)) == "alpha"
    assert keys.reload_if_changed() is False
    beta = add_key(path, "beta")
    assert keys.reload_if_changed() is True
    assert keys.ring.names() == ["alpha", "beta"]
    assert keys.ring.name_for(bearer(beta)) == "beta"
    remove_key(path, "alpha")
    assert keys.reload_if_changed() is True
    assert keys.ring.name_for(bearer(alpha)) is None
    assert keys.ring.name_for(bearer(beta)) == "beta"


def test_a_broken_or_missing_file_on_a_reload_keeps_the_keys_in_force(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    alpha = add_key(path, "alpha")
    keys = KeysFile(path)
    path.write_text(path.read_text() + "beta sk-fw-not-a-hash\n")
    assert keys.reload_if_changed() is False
    assert keys.ring.name_for(bearer(alpha)) == "alpha"
    assert keys.error is not None and "line 3" in keys.error
    assert "line 3" in caplog.text and "stay in force" in caplog.text
    path.unlink()
    assert keys.reload_if_changed() is False
    assert keys.ring.name_for(bearer(alpha)) == "alpha"
    assert keys.error is not None and "does not exist" in keys.error
    add_key(path, "gamma")
    assert keys.reload_if_changed() is True
    assert keys.error is None
    assert keys.ring.names() == ["gamma"]


def test_a_router_told_to_check_keys_never_starts_without_them(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="does not exist"):
        KeysFile(tmp_path / "nowhere")


def test_keys_add_writes_a_0600_file_of_hashes_and_refuses_a_name_twice(
        tmp_path: Path) -> None:
    path = tmp_path / "sub" / "keys"
    secret = add_key(path, "alpha")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert secret not in text and hash_secret(secret) in text
    assert read_keys(path) == {"alpha": hash_secret(secret)}
    with pytest.raises(KeysFileError, match="already has a key named 'alpha'"):
        add_key(path, "alpha")
    with pytest.raises(KeysFileError, match="name 'no spaces'"):
        add_key(path, "no spaces")
    with pytest.raises(KeysFileError, match="no key named 'beta'"):
        remove_key(path, "beta")
    assert [p.name for p in path.parent.iterdir()] == ["keys"]  # no temporary file left


# ---------------------------------------------------------------- what is counted

def test_per_key_requests_and_tokens_and_refusals_are_in_the_routers_metrics() -> None:
    stats = RouterStats()
    tally = stats.key("alpha")
    tally.requests += 2
    tally.prompt_tokens += 30
    tally.completion_tokens += 7
    stats.key_refusals["wrong"] = 3
    text = generate_latest(make_registry(stats, Pool([]), worker=1)).decode()
    assert 'fleetwarden_router_key_requests_total{key="alpha",worker="1"} 2.0' in text
    assert 'fleetwarden_router_key_prompt_tokens_total{key="alpha",worker="1"} 30.0' in text
    assert 'fleetwarden_router_key_completion_tokens_total{key="alpha",worker="1"} 7.0' in text
    assert 'fleetwarden_router_key_refusals_total{why="wrong",worker="1"} 3.0' in text


def test_a_router_without_keys_shows_no_key_series() -> None:
    text = generate_latest(make_registry(RouterStats(), Pool([]))).decode()
    assert "fleetwarden_router_key_" not in text


@pytest.mark.parametrize(("body", "usage"), [
    ({"id": "c", "choices": [{"text": "x"}],
      "usage": {"prompt_tokens": 12, "total_tokens": 17, "completion_tokens": 5,
                "prompt_tokens_details": None}}, (12, 5)),
    ({"object": "list", "data": [], "usage": {"prompt_tokens": 9, "total_tokens": 9}}, (9, 0)),
    ({"id": "c", "choices": []}, None),
])
def test_a_whole_answers_tokens_are_read_from_its_usage(body: object,
                                                        usage: tuple[int, int] | None) -> None:
    assert _usage_of(json.dumps(body).encode()) == usage
    assert _usage_of(json.dumps(body, separators=(",", ":")).encode()) == usage


# ---------------------------------------------------------------- configuration

def test_the_keys_file_is_a_router_setting_from_the_config() -> None:
    assert RouterSettings().keys_file is None
    assert RouterConfig(keys_file="/etc/fleetwarden/keys").settings().keys_file == \
        "/etc/fleetwarden/keys"
    with pytest.raises(ValueError, match=r"RouterSettings\.keys_file"):
        RouterSettings(keys_file=" ")


def test_the_temporary_file_of_a_write_is_private_from_its_first_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    modes: list[int] = []
    real = os.replace

    def looking(src: str | Path, dst: str | Path) -> None:
        modes.append(stat.S_IMODE(os.stat(src).st_mode))
        real(src, dst)

    monkeypatch.setattr(keys_module.os, "replace", looking)
    add_key(tmp_path / "keys", "alpha")
    assert modes == [0o600]


def test_the_workers_key_counts_add_up_in_the_fleets_view() -> None:
    """Each router process reports its keys in its status; the fleet adds them up (the
    dashboard's table), those of workers that are gone included."""
    from fleetwarden.launchers.routers import _add, _add_status
    from fleetwarden.snapshot import RouterCounters

    gone = RouterStats()
    gone.key("alpha").requests = 1
    total = RouterStats()
    _add(total, gone)
    for status in ({"keys": {"alpha": [2, 20, 4]}, "key_refusals": {"wrong": 1}},
                   {"keys": {"alpha": [1, 10, 2], "beta": [5, 0, 0]},
                    "key_refusals": {"wrong": 2, "missing": 1}}):
        _add_status(total, status)
    counters = RouterCounters.of(total)
    assert counters.keys == {"alpha": (4, 30, 6), "beta": (5, 0, 0)}
    assert counters.key_refusals == {"wrong": 3, "missing": 1}


def test_router_processes_get_the_keys_file_as_an_absolute_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleetwarden up` gives its router processes every setting as JSON; the keys file's
    path is made absolute, so that a worker reads the same file whatever its directory."""
    from fleetwarden.launchers.routers import worker_argv

    monkeypatch.chdir(tmp_path)
    argv = worker_argv(RouterConfig(keys_file="keys", workers=1), 8000, tmp_path / "token",
                       0, 9999)
    settings = json.loads(argv[argv.index("--settings-json") + 1])
    assert settings["keys_file"] == str(tmp_path / "keys")
    assert RouterSettings(**settings).keys_file == str(tmp_path / "keys")
