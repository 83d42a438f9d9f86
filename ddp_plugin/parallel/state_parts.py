"""Each parallelism's part in a checkpoint: the contract :mod:`ddp_plugin.strategy.checkpointing` asks, without knowing
which parallelisms a fit has.

A checkpoint's model and optimizer state starts as what this rank holds (the sharder's answer through the plugin
hooks, or the module's and optimizer's own); then every part has its say, in the order the components list them
(tensor parallelism, then pipeline stages) when saving, in the reverse order when loading. A part that has
nothing to do for a step inherits :class:`StatePart`'s method, which returns what it was given.

- ``checkpoint="master"`` (one file from global rank 0 under the unsplit model's names and numbering):
  :meth:`~StatePart.whole_module` and :meth:`~StatePart.whole_optimizer` (tensor parallelism: each DTensor's
  whole value; pipeline stages: every stage's state gathered to global rank 0).
- ``checkpoint="sharded"`` (every rank its own part, through DCP): DTensors stay DTensors, which DCP stores as it
  stores them for torch's own ``get_model_state_dict``: each rank's shard with the whole tensor's shape and
  offsets. :meth:`~StatePart.local_optimizer` and :meth:`~StatePart.shapes` (pipeline stages: the optimizer state
  keyed by the unsplit model's names, every stage's shapes on global rank 0).
- Both: :meth:`~StatePart.plugin_state` (pipeline stages: every stage's plugin state merged on global rank 0).
- Loading either kind: :meth:`~StatePart.module_to_load`, :meth:`~StatePart.optimizer_to_load` (before the
  plugins' ``on_load_optimizer_state_dict``) and :meth:`~StatePart.optimizer_fallback` (when no plugin took it).

A new parallelism adds a part here (or in its own package) and lists it in
:meth:`~ddp_plugin.strategy.fit_state.FitState.state_parts`'s components; the routing does not change.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ddp_plugin.parallel import tensor_parallel

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer


class StatePart:
    """One parallelism's say in the checkpoint. Every method returns its input unchanged unless the parallelism
    changes it; the collective ones are called on every rank, in the same order."""

    what = "the model"
    """What the part's collectives gather, for a diagnosis ("the checkpoint's gather of <what>")."""

    def whole_module(self, state: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint="master"``: this rank's module state (whole parameters, ZeRO's gathered) made into the
        unsplit model's, as global rank 0 writes it."""
        return state

    def whole_optimizer(self, state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
        """``checkpoint="master"``: this rank's ``optimizer`` state (the sharder's whole one, if any) made into the
        unsplit model's optimizer state, numbered as an unsplit ``optimizer.state_dict()``."""
        return state

    def local_optimizer(self, local: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
        """``checkpoint="sharded"``: this rank's part of the optimizer state (flat keys ``<index>/<key>``, as
        :func:`ddp_plugin.checkpoints.sharded_checkpoint.save` takes them), keyed so that no other rank's collides."""
        return local

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """``checkpoint="sharded"``: the whole shapes global rank 0 records (of every tensor cut into pieces)."""
        return shapes

    def plugin_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The plugins' ``on_save_state_dict`` state as global rank 0 writes it."""
        return state

    def module_to_load(self, state: dict[str, Any], module: Module) -> dict[str, Any]:
        """The checkpoint's (unsplit) module state cut down to what ``module`` holds here, split as it is."""
        return state

    def optimizer_to_load(self, state: Mapping[str, Any], optimizer: Optimizer) -> Mapping[str, Any]:
        """The checkpoint's (unsplit) optimizer state as this rank's ``optimizer`` numbers and splits it, before
        the plugins' ``on_load_optimizer_state_dict`` sees it."""
        return state

    def optimizer_fallback(self, state: Mapping[str, Any], optimizer: Optimizer) -> Mapping[str, Any]:
        """The optimizer state for ``optimizer.load_state_dict`` when no plugin took it."""
        return state


class TensorParallelState(StatePart):
    """Tensor parallelism's part: DTensor parameters (and the optimizer state of their shape) whole in a master
    checkpoint, split again on load, each rank taking its own part of the file's whole tensors (no communication:
    every rank holds them, or reads only its part of a sharded checkpoint). A sharded checkpoint keeps them
    DTensors: DCP stores each rank's shard.

    ``sharder``: a ZeRO sharder holds the optimizer state; it takes whole tensors on load and splits them itself
    (``optimizer_fallback`` splits them when it declines). Its pieces of a split tensor are pieces of this rank's
    shard (``<key>@<dim>:<offset>#<start>``, an encoding of this library's own: torch has none for a flat piece of
    a DTensor's shard), so a sharded checkpoint records every rank's shard shape."""

    what = "the tensor-parallel model"

    def __init__(self, module: Module, sharder: bool) -> None:
        self.module = module
        self.sharder = sharder

    def shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        if not self.sharder:
            return shapes  # (DCP records a DTensor's shards itself)
        live = self.module.state_dict(keep_vars=True)
        return {**shapes, **{f"model/{key}": shape for key, shape in tensor_parallel.block_shapes(live).items()}}

    def whole_module(self, state: dict[str, Any]) -> dict[str, Any]:
        return tensor_parallel.full_state_dict(state)  # (an all-gather per split tensor, every rank)

    def whole_optimizer(self, state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
        return tensor_parallel.full_state_dict(state)

    def module_to_load(self, state: dict[str, Any], module: Module) -> dict[str, Any]:
        return tensor_parallel.distribute_state_dict(state, module)

    def optimizer_to_load(self, state: Mapping[str, Any], optimizer: Optimizer) -> Mapping[str, Any]:
        return state if self.sharder else tensor_parallel.distribute_optimizer_state(state, optimizer)

    def optimizer_fallback(self, state: Mapping[str, Any], optimizer: Optimizer) -> Mapping[str, Any]:
        return tensor_parallel.distribute_optimizer_state(state, optimizer) if self.sharder else state
