"""The suite's own scheduling: under ``pyproject.toml``'s ``addopts`` (``-n 2 --dist loadfile``) the files reach the
two workers in the order ``tests/conftest.py`` collects them, the slowest first (``SLOWEST_FIRST``). pytest-xdist
3.5 to 3.7 always reordered the files by their number of tests, most first, and 3.8 still does unless told
``--no-loadscope-reorder``: a file of 3 tests taking 45 s (``test_memory_cap.py``) was handed out among the last,
and ran alone at the end."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import SLOWEST_FIRST
from tests.support import ROOT


def test_the_workers_take_the_files_in_the_order_they_were_collected(tmp_path):
    # A file of one test collected first, then files of more tests each; each test notes its file as it starts.
    log = tmp_path / "started.txt"
    for name, tests in (("test_a", 1), ("test_b", 5), ("test_c", 9)):
        (tmp_path / f"{name}.py").write_text("".join(
            f"import os\n\n\ndef test_{i}():\n    open({str(log)!r}, 'a').write(os.environ['PYTEST_XDIST_WORKER']"
            f" + ' ' + {name!r} + '\\n')\n\n\n" for i in range(tests)))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", "-q", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    started = [line.split() for line in log.read_text().splitlines()]
    first = {}
    for worker, name in started:
        first.setdefault(worker, name)
    assert len(started) == 15 and sorted(first.values()) == ["test_a", "test_b"], started


def test_the_slowest_files_exist():
    assert all((ROOT / "tests" / name).is_file() for name in SLOWEST_FIRST), SLOWEST_FIRST
