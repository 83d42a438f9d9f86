"""The test suite (a package, so tests import helpers as ``tests.support`` and workers as ``tests.workers.x``)."""
