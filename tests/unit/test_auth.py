"""Token files: created 0600, refused when others can read it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fleetwarden.auth import TokenFileError, load_or_create_token, token_matches


def test_a_missing_token_file_is_created_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "admin.token"
    token = load_or_create_token(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(token) >= 32 and load_or_create_token(path) == token


def test_a_token_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "admin.token"
    load_or_create_token(path)
    os.chmod(path, 0o644)
    with pytest.raises(TokenFileError, match="chmod 600"):
        load_or_create_token(path)


def test_an_empty_token_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "admin.token"
    path.write_text("\n")
    os.chmod(path, 0o600)
    with pytest.raises(TokenFileError, match="no usable token"):
        load_or_create_token(path)


def test_token_comparison() -> None:
    assert token_matches("a" * 20, "a" * 20)
    assert not token_matches("a" * 20, "b" * 20)
    assert not token_matches("a" * 20, None)
    assert not token_matches("a" * 20, "")
