"""Fixtures for scenario tests: real processes and sockets on 127.0.0.1 (see support.py)."""

from .support import http, spawn

__all__ = ["http", "spawn"]
