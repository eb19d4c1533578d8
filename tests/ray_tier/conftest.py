"""The Ray tier: a real two-node Ray cluster on this machine (see cluster.py).

Ray is part of the test environment (`make test` installs the `ray` extra). Without it this
tier fails, naming the cause: it is never skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

try:
    import ray  # noqa: F401
except ImportError as exc:  # a failure with its cause, never a skip
    raise ImportError(f"the Ray tier needs Ray: pip install -e '.[dev,ray]' "
                      f"(`make test` does): {exc}") from exc

from .cluster import ENV, RayCluster


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """One cluster for the module (starting one takes seconds); stopped whatever happened."""
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # this process is a Ray driver too
    cluster = RayCluster(tmp_path_factory.mktemp("ray-cluster"))
    try:
        cluster.start_head()
        cluster.start_second()
        yield cluster
    finally:
        problems = cluster.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert not problems, problems


@pytest.fixture
def cluster(ray_cluster: RayCluster) -> RayCluster:
    """The module's cluster with both nodes up (a test before may have lost the second)."""
    if not ray_cluster.second.running or ray_cluster.second.raylet() is None:
        ray_cluster.start_second()
    return ray_cluster
