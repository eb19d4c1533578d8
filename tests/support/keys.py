"""Watching the data port's key check (router/keys.py) from a test.

Owns: :func:`recorded_comparisons`, the one recorder of ``hmac.compare_digest`` calls the unit
and hostile-input tiers share. Must not: decide what a test asserts of them.
"""

from __future__ import annotations

import hmac

import pytest

from fleetwarden.router import keys as keys_module


def recorded_comparisons(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, bytes]]:
    """Every ``hmac.compare_digest(a, b)`` the key check makes from now on, as (a, b), while
    it still decides as the real one does."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys_module.hmac, "compare_digest", recording)
    return calls
