"""Package discovery; everything else is in pyproject.toml.

Every package under ``ddp_plugin/`` is found by ``find_packages`` so a new subpackage cannot be left out of the
wheel, and the hook contract (the repository's top-level ``hookspecs/``) is added as ``ddp_plugin.hookspecs``,
which pyproject.toml's ``package-dir`` maps to that folder.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["ddp_plugin", "ddp_plugin.*"]), "ddp_plugin.hookspecs"])
