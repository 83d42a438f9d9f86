"""Scripts the tests run in fresh processes (``python tests/workers/x.py``; Lightning's launcher or torchrun start
the ranks). A test may import one (``tests.workers.checkpoint_run``) for its model class."""
