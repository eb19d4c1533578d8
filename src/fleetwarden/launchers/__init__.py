"""Launchers start and stop engine processes for the supervisor; ``procs`` reads them from
``/proc``."""
