"""Packaging: the wheel users install holds every package of the source tree and the hook contract.

The suite itself runs on an editable install, where an import finds the source tree whatever the wheel holds; a
wheel once shipped without ``ddp_plugin.sync``. So the wheel is built here and its contents compared with the
tree. (``.ci/wheel_smoke`` goes further: it installs the wheel into a fresh environment and trains with it.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT


def source_packages() -> set[str]:
    """Every folder of Python files under ddp_plugin/ as a dotted name, and the hook contract's installed name."""
    found = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "ddp_plugin").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    return found | {"ddp_plugin.hookspecs"}


def test_source_packages_covers_every_folder_of_python_files():
    # The comparison below is only as good as this list: it must see the subpackages we know of.
    assert {"ddp_plugin", "ddp_plugin.sync", "ddp_plugin.zero", "ddp_plugin.codecs", "ddp_plugin.plugins",
            "ddp_plugin.parallel",
            "ddp_plugin.testing", "ddp_plugin.hookspecs"} <= source_packages()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # From a copy without build outputs: pip builds in the source folder, and setuptools packs a stale build/lib
    # of an earlier build along with what it found this time, which hid the missing subpackage.
    source, out = tmp_path_factory.mktemp("source") / "ddp_plugin", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "lightning_logs", "results"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(out),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("ddp_plugin-*.whl")
    return built


def test_wheel_holds_every_package_and_module_of_the_source_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")}
    missing = source_packages() - packages
    assert not missing, f"the wheel lacks {sorted(missing)}; it holds {sorted(packages)}"
    # Every module, not only each package's __init__.py.
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "ddp_plugin").rglob("*.py") if "__pycache__" not in p.parts}
    modules |= {f"ddp_plugin/hookspecs/{p.name}" for p in (ROOT / "hookspecs").glob("*.py")}
    assert not modules - names, sorted(modules - names)
    # Nothing lands under a generic top-level name (hookspecs, tests, benchmarks), only the package and its metadata.
    tops = {name.split("/", 1)[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"ddp_plugin"}, sorted(tops)
    # The console entry point that launches a replica group.
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "ddp-plugin-group = ddp_plugin.fault_tolerance.launch:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()
