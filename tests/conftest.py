from __future__ import annotations

import pytest

from ddp_plugin.testing.simcluster import SimulatedCluster


@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes (network namespaces) joined by a 1 Gbit/s link, torn down after the module."""
    with SimulatedCluster(nodes=2, rate="1gbit") as c:
        yield c
