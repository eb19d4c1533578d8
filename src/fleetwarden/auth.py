"""Bearer tokens in 0600 files, created with a random token when missing.

Owns: bearer token files: creating them 0600, refusing ones others can read, comparing in
constant time.
Must not: log a token, or decide who may do what (the admin API and the router's control API
do).

The admin API and a router's control API both take one. A token file others can read is
refused: the token lets its holder retire engines, drain outcomes and empty the serving list.
Tokens are compared in constant time and never written to a log (the servers run without an
access log line that could carry a ``?token=`` query).
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

__all__ = ["TokenFileError", "load_or_create_token", "token_matches"]


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file and the fix."""


def load_or_create_token(path: str | Path) -> str:
    p = Path(path).expanduser()
    if not p.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return load_or_create_token(p)  # another process created it first
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        raise TokenFileError(
            f"token file {p} is readable by others (mode {mode:04o}); run: chmod 600 {p}"
        )
    token = p.read_text().strip()
    if len(token) < 16:
        raise TokenFileError(f"token file {p} holds no usable token (at least 16 "
                              "characters); delete it to have a new one made")
    return token


def token_matches(expected: str, presented: str | None) -> bool:
    if not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())
