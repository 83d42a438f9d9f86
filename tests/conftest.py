from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ddp_plugin.testing.simcluster import SimulatedCluster
from tests.support import ROOT

# Every Python the tests start (ranks, workers, the zygote and so its forked children, whose stderr is the caller's
# by then) prints each thread's stack when native code crashes, so a rank that dies of a signal in CI says where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes (network namespaces) joined by a 1 Gbit/s link, torn down after the module."""
    with SimulatedCluster(nodes=2, rate="1gbit") as c:
        yield c


@pytest.fixture(scope="module")
def onebit_install(tmp_path_factory):
    """The example codec package (examples/onebit_codec), ``pip install --no-deps --target`` from a copy (so no
    build files land in the checkout); the folder goes on PYTHONPATH (or ``sys.path``) as site-packages would."""
    base = tmp_path_factory.mktemp("onebit")
    source, target = base / "src", base / "site"
    shutil.copytree(ROOT / "examples" / "onebit_codec", source)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(source)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    return target
