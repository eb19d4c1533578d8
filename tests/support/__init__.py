"""Every helper and test double the tests share, in one place (on the path: ``pythonpath``).

- :mod:`support.wait` — ``until``, ``wait_until`` and ``free_port``: the one copy of each.
- :mod:`support.sim` — real ``fleetwarden sim`` processes on 127.0.0.1, their fixtures
  (``spawn``, ``http``), faults, stats and polling waits.
- :mod:`support.fleet` — a whole :class:`~fleetwarden.fleet.Fleet` in the test's loop on
  simulated engines, with compressed timings.
- :mod:`support.links` — :class:`QuietLink`, the base of the router-link doubles.
- :mod:`support.router_rig` — a real router in front of scripted engines, and its client.
- :mod:`support.scripted_engine` — an engine double that answers with real vLLM captures.
- :mod:`support.source` — the package's source read as code (``runtime_nodes``).
- :mod:`support.proxy` — a least-connections proxy, as a load balancer in front of engines.
- :mod:`support.keys` — a recorder of the data port's key comparisons.
- ``support/engines/`` — engine scripts that tests launch as processes by path.

What benchmarks, examples or the CLI use as well stays in :mod:`fleetwarden.testing` (a load
generator, ``fleetwarden up`` as a process, the real-vLLM environment and its tiny model).
"""
