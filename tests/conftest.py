from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

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
FIXTURE_SECONDS = 5.0
"""A fixture whose setup took at least this long gets a row of its own in the table."""


def _side_file(kind: str) -> str | None:
    """Beside the table: ``.fixtures`` (each worker's fixture setups) and ``.launches`` (the zygote's log of the
    Pythons the tests started, :data:`tests.zygote.LAUNCHES_ENV`)."""
    target = os.environ.get(TIMES_ENV)
    return f"{target}.{kind}" if target else None


if os.environ.get(TIMES_ENV):
    from tests.zygote import LAUNCHES_ENV

    os.environ[LAUNCHES_ENV] = _side_file("launches")


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # (the controller, before any worker runs a test: a fresh log)
        for kind in ("fixtures", "launches"):
            if _side_file(kind):
                open(_side_file(kind), "w").close()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    target = _side_file("fixtures")
    if target and seconds >= 1.0:
        with open(target, "a") as out:  # (one short line per write: the workers' lines do not interleave)
            out.write(f"{request.node.nodeid.split('::', 1)[0]}\t{fixturedef.argname}\t{fixturedef.scope}"
                      f"\t{seconds:.3f}\n")


def _launches() -> dict[str, list[int]]:
    """``{file: [Pythons started, of them fresh interpreters]}`` from the zygote's log."""
    counts: dict[str, list[int]] = {}
    path = _side_file("launches")
    for line in open(path).read().splitlines() if path and os.path.exists(path) else []:
        test, _, forked = line.rpartition("\t")
        row = counts.setdefault(test.split("::", 1)[0] or "(outside a test)", [0, 0])
        row[0] += 1
        row[1] += forked == "0"
    return counts


def _fixture_rows() -> list[str]:
    """The fixtures whose setups took :data:`FIXTURE_SECONDS` or more, summed over their instances."""
    path = _side_file("fixtures")
    found: dict[tuple[str, str, str], list[float]] = {}
    for line in open(path).read().splitlines() if path and os.path.exists(path) else []:
        file, name, scope, seconds = line.split("\t")
        found.setdefault((file, name, scope), []).append(float(seconds))
    rows = sorted(((sum(v), len(v), k) for k, v in found.items() if sum(v) >= FIXTURE_SECONDS), reverse=True)
    lines = ["| file | fixture (scope) | setups | seconds |", "| --- | --- | ---: | ---: |"]
    lines += [f"| `{file}` | `{name}` ({scope}) | {count} | {total:.0f} |"
              for total, count, (file, name, scope) in rows]
    return lines


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
    launches = _launches()
    lines = ["| file | tests | seconds | share | Pythons through the zygote (fresh) |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| `{path}` | {_file_tests.get(path, 0)} | {seconds:.0f} | {seconds / total:.1%} |"
              " {} ({}) |".format(*launches.get(path, [0, 0])) for path, seconds in rows]
    started = [sum(row[i] for row in launches.values()) for i in (0, 1)]
    lines.append(f"| all | {sum(_file_tests.values())} | {total:.0f} | 100% | {started[0]} ({started[1]}) |")
    lines += ["", f"Fixtures whose setups took {FIXTURE_SECONDS:.0f} s or more (a module fixture's launches are"
              " counted in its file's row above):", "", *_fixture_rows()]
    with open(target, "w") as out:
        out.write("\n".join(lines) + "\n")


SLOWEST_FIRST = ("test_fault_tolerance.py", "test_tensor_parallel.py", "test_adaptive.py", "test_default_paths.py",
                 "test_compression_training.py", "test_pipeline_mesh.py", "test_cluster.py", "test_checkpoint.py",
                 "test_meta_init.py", "test_reliability.py", "test_launch.py", "test_benchmark_scripts.py")
"""The files that took longest in `.ci/run` (its seconds-per-file table, docs/testing.md), slowest first: collected
first, so that under `--dist loadfile` the two workers start with them and end together (a long file started
last would run alone at the end). Every other file keeps its place after them."""


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1], len(SLOWEST_FIRST)))
