from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ddp_plugin.testing.simcluster import SimulatedCluster
from tests.support import FULL_MATRIX_ENV, ROOT
from tests.zygote import interpreter, start_in_namespaces

# Every Python the tests start (ranks, workers, the zygote and so its forked children, whose stderr is the caller's
# by then) prints each thread's stack when native code crashes, so a rank that dies of a signal in CI says where.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="module")
def cluster():
    """Two simulated nodes (network namespaces) joined by a 1 Gbit/s link, torn down after the module; a zygote in
    each node forks the ranks its launches start (tests/zygote.py)."""
    with SimulatedCluster(nodes=2, rate="1gbit", python=interpreter()) as c:
        start_in_namespaces(lambda node, argv, **kwargs: c.popen(node, argv, env=c.launch_env(node), **kwargs),
                            c.nodes)
        yield c


@pytest.fixture(scope="session")
def heap_env(tmp_path_factory) -> dict[str, str]:
    """The environment that preloads the heap tracker (``ddp_plugin.testing.heap``), compiled once per worker:
    the runs given it are forked from one zygote started with it (``tests.zygote.start_preloaded``)."""
    from ddp_plugin.testing import heap

    return heap.preload_env(heap.build(tmp_path_factory.getbasetemp()), env={})


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
_file_cpu: dict[str, float] = {}
_cpu_mark = [0.0]
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


def _machine_busy() -> tuple[float, float]:
    """(CPU seconds the machine's cores have been busy since boot, by ``/proc/stat``; now, on the wall clock)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return 0.0, time.time()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), time.time()


_started = [(0.0, 0.0)]


def pytest_addoption(parser) -> None:
    parser.addoption("--full-matrix", action="store_true",
                     help="run every combination of the matrices the suite covers pairwise (tests/support.py: "
                          "FULL_MATRIX_ENV; docs/testing.md)")


def pytest_configure(config) -> None:
    if config.getoption("full_matrix"):  # (read by the test modules as they are collected, in every worker)
        os.environ[FULL_MATRIX_ENV] = "1"
    _started[0] = _machine_busy()
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


def _launches() -> dict[str, list[float]]:
    """``{file: [Pythons started, of them fresh interpreters, CPU seconds of the forked ones]}`` from the zygote's
    log."""
    counts: dict[str, list[float]] = {}
    path = _side_file("launches")
    for line in open(path).read().splitlines() if path and os.path.exists(path) else []:
        test, kind, value = line.rsplit("\t", 2)
        row = counts.setdefault(test.split("::", 1)[0] or "(outside a test)", [0, 0, 0.0])
        if kind == "cpu":
            row[2] += float(value)
        else:
            row[0] += 1
            row[1] += value == "0"
    return counts


def _cpu_seconds() -> float:
    """This process's CPU seconds, user and system, those of its children it has waited for (the fresh
    interpreters a test started; the zygote's forked children are counted by the zygote), and those of the ranks of
    the rank pools it closed (the fork server's children, each rank's own as it reported them)."""
    import resource

    from ddp_plugin.testing.ranks import pool_cpu_seconds

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + pool_cpu_seconds()


def pytest_runtest_logstart(nodeid, location) -> None:
    _cpu_mark[0] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    now = _cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_s", now - _cpu_mark[0]))  # (to the controller with xdist)
    _cpu_mark[0] = now


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
    _file_cpu[path] = _file_cpu.get(path, 0.0) + sum(v for k, v in report.user_properties if k == "cpu_s")
    if report.when == "call" or (report.when == "setup" and report.skipped):
        _file_tests[path] = _file_tests.get(path, 0) + 1


def pytest_sessionfinish(session) -> None:
    target = os.environ.get(TIMES_ENV)
    if not target or hasattr(session.config, "workerinput"):  # (the controller writes it, from every report)
        return
    total = sum(_file_seconds.values())
    rows = sorted(_file_seconds.items(), key=lambda item: -item[1])
    launches = _launches()
    cpu = {path: _file_cpu.get(path, 0.0) + launches.get(path, [0, 0, 0.0])[2] for path in _file_seconds}
    lines = ["| file | tests | seconds | share | CPU seconds | Pythons through the zygote (fresh) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| `{path}` | {_file_tests.get(path, 0)} | {seconds:.0f} | {seconds / total:.1%} | {cpu[path]:.0f} |"
              " {:.0f} ({:.0f}) |".format(*launches.get(path, [0, 0])[:2]) for path, seconds in rows]
    started = [sum(row[i] for row in launches.values()) for i in (0, 1)]
    lines.append(f"| all | {sum(_file_tests.values())} | {total:.0f} | 100% | {sum(cpu.values()):.0f} |"
                 f" {started[0]:.0f} ({started[1]:.0f}) |")
    (busy, now), (busy0, then) = _machine_busy(), _started[0]
    cores = os.cpu_count() or 1
    used, offered = busy - busy0, max((now - then) * cores, 1e-9)
    lines += ["", "CPU seconds: each file's tests in the pytest worker, the interpreters they started and waited"
              " for, and every Python the zygote forked for them (a fresh interpreter's own children, ranks its"
              f" launcher did not wait for, are not counted). The machine's {cores} cores were busy {used:.0f} s of"
              f" {offered:.0f} during the session ({used / offered:.0%})."]
    lines += ["", f"Fixtures whose setups took {FIXTURE_SECONDS:.0f} s or more (a module fixture's launches are"
              " counted in its file's row above):", "", *_fixture_rows()]
    with open(target, "w") as out:
        out.write("\n".join(lines) + "\n")


SLOWEST_FIRST = ("test_fault_tolerance.py", "test_tensor_parallel.py", "test_checkpoint.py", "test_default_paths.py",
                 "test_meta_init.py", "test_pipeline_mesh.py", "test_compression_training.py", "test_adaptive.py",
                 "test_reliability.py", "test_memory_cap.py", "test_mesh_faults.py", "test_zero.py", "test_cluster.py",
                 "test_health.py", "test_launch.py", "test_memory_budget.py", "test_pipeline.py", "test_zygote.py",
                 "test_sync.py", "test_equivalence.py", "test_activation_checkpointing.py", "test_checkpoint_io.py")
"""The files that took longest in `.ci/run` (its seconds-per-file table, docs/testing.md), collected first, in this
order: under `--dist loadfile --no-loadscope-reorder` each worker takes the next file of the list as it finishes
one. The fault-tolerance file runs first (about 230-300 s, mostly its groups' sleeps) while the other worker runs
the files that compute the most; after them, the files that wait on timeouts (reliability, the mesh's faults,
health) alternate with files that compute, so that one worker waits while the other computes (they came last, one
beside the other, and the cores were two-thirds idle for 110 s), then the files of 15-25 s, and the short files
follow in their usual order, so that a long file is never left to run alone at the end (`test_zygote.py`, 20 s,
came last, alone for 16 s of a run sampled every 2 s). The adaptive file starts once the fault file's background
jobs (its first 120-190 s, three at a time) are over: its link-slowdown test reads step times, and beside them a
re-plan from the machine's load came before the slowdown, twice in a row."""


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1], len(SLOWEST_FIRST)))
