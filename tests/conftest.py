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


# ---------------------------------------------------------------------------------------------- where the time goes

TIMES_ENV = "DDP_PLUGIN_TEST_TIMES"
"""A path: the suite writes there a table of the seconds each test file took (its tests' setup, call and teardown,
module fixtures included, summed over the tests of the file as the workers ran them). `.ci/run` sets it."""
_file_seconds: dict[str, float] = {}
_file_tests: dict[str, int] = {}


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _file_tests[path] = _file_tests.get(path, 0) + 1


def pytest_sessionfinish(session) -> None:
    target = os.environ.get(TIMES_ENV)
    if not target or hasattr(session.config, "workerinput"):  # (the controller writes it, from every report)
        return
    total = sum(_file_seconds.values())
    rows = sorted(_file_seconds.items(), key=lambda item: -item[1])
    lines = ["| file | tests | seconds | share |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| `{path}` | {_file_tests.get(path, 0)} | {seconds:.0f} | {seconds / total:.1%} |"
              for path, seconds in rows]
    lines.append(f"| all | {sum(_file_tests.values())} | {total:.0f} | 100% |")
    with open(target, "w") as out:
        out.write("\n".join(lines) + "\n")


SLOWEST_FIRST = ("test_fault_tolerance.py", "test_tensor_parallel.py", "test_cluster.py", "test_default_paths.py",
                 "test_compression_training.py", "test_pipeline_mesh.py", "test_meta_init.py", "test_launch.py",
                 "test_adaptive.py", "test_reliability.py", "test_checkpoint.py", "test_benchmark_scripts.py")
"""The files that took longest in `.ci/run` (its seconds-per-file table, docs/testing.md), slowest first: collected
first, so that under `--dist loadfile` the two workers start with them and end together (a long file started
last would run alone at the end). Every other file keeps its place after them."""


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1], len(SLOWEST_FIRST)))
