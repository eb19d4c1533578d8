"""Fixtures for scenario tests: real processes and sockets on 127.0.0.1 (tests/support/sim.py)."""

from support.sim import http, spawn

__all__ = ["http", "spawn"]
