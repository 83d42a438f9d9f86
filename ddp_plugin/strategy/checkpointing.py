"""Checkpoint routing: what the strategy saves and loads, in which layout, through which plugin hook.

``checkpoint="master"`` writes one consolidated file from global rank 0; a sharder's optimizer state arrives
as deferred tensors that rank 0 produces and writes one at a time (:class:`~ddp_plugin.checkpoints.checkpoint_io.
AtomicCheckpointIO`) while every other rank produces its part of each, in the same order, and every rank then
learns whether rank 0's write succeeded, so that all fail together, naming the cause. ``checkpoint="sharded"``
has every rank write its own part (:mod:`ddp_plugin.checkpoints.sharded_checkpoint`). Both kinds load in either mode.

Plugin state goes under ``checkpoint["ddp_plugin"]`` (what ``on_save_state_dict`` returned, the same on every
rank) and ``checkpoint["ddp_plugin_ranks"]`` (every rank's ``on_save_rank_state_dict``, collected to rank 0
with one object gather, and the world size that saved it).

The plugins of the last ``fit`` answer the state hooks during it and after it, until the next ``fit``: the
sharder's layout and the sharded optimizer outlive ``teardown``, so ``trainer.save_checkpoint`` after ``fit``
(or after ``validate``/``test``) writes what a save during ``fit`` writes.

(About 400 lines: the save and the load of each part (model, optimizer, plugin state) sit side by side, so that
a change to one is seen beside the other.)
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import TorchCheckpointIO
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module

from ddp_plugin.runtime import lightning_adapter
from ddp_plugin.checkpoints import sharded_checkpoint

from ddp_plugin.runtime import cpu_memory
from ddp_plugin.runtime.answers import merged_answers
from ddp_plugin.parallel import tensor_parallel
from ddp_plugin.parallel.state_parts import StatePart
from ddp_plugin.hookspecs import local_tensor, pipeline_copies
from ddp_plugin.checkpoints.checkpoint_io import (
    AtomicCheckpointIO,
    agree_with_rank_0,
    deferred_storages,
    diagnosed,
    is_local_path,
    local_path,
    materialize,
    not_a_checkpoint,
    produce_all,
)

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch.optim import Optimizer

    from ddp_plugin.strategy.config import StrategyConfig
    from ddp_plugin.strategy.fit_state import FitState

CHECKPOINT_KEY = "ddp_plugin"
RANK_STATE_KEY = "ddp_plugin_ranks"


class Checkpoints:
    """The checkpoint methods of ``strategy`` (its LightningModule, optimizers, ranks and checkpoint IO), with
    ``config``'s flags, over ``fit``. Where a method returns ``None`` (or ``False``), or is handed Lightning's own,
    Lightning's ``ParallelStrategy`` does the work."""

    def __init__(self, strategy: Strategy, config: StrategyConfig, fit: FitState) -> None:
        self.strategy = strategy
        self.config = config
        self.fit = fit

    def _parts(self) -> list[StatePart]:
        return self.fit.state_parts(self.strategy.lightning_module, sharder=bool(self.config.zero_stage))

    # ------------------------------------------------------------------ what goes in

    def _refuse_master_beyond_memory(self) -> None:
        """``checkpoint="master"`` of a model no rank holds whole gathers its whole state on global rank 0: refused
        on every rank, before anything is gathered or written, when the parameters and the optimizer state alone
        exceed the memory rank 0 has available (the machine's, or what its memory cgroup's limit leaves).
        Collective (one all-reduce of two scalars over the world)."""
        if self.fit.groups is None or not dist.is_initialized():
            return
        total = 0.0
        for p in self.strategy.lightning_module.parameters():  # (a DTensor's numel is the whole tensor's)
            total += p.numel() * p.element_size() / pipeline_copies(p)
        for optimizer in self.strategy.optimizers:
            for p, entries in lightning_adapter.unwrapped(optimizer).state.items():
                for v in entries.values():
                    if isinstance(v, Tensor) and v.dim():
                        same = tuple(local_tensor(v).shape) == tuple(local_tensor(p).shape)
                        total += (p.numel() if same else local_tensor(v).numel()) * v.element_size() / pipeline_copies(p)
        # One sum over the world: every stage's state (once per data and tensor position) and rank 0's headroom.
        available = cpu_memory.available_bytes() if self.strategy.is_global_zero else None
        mine = [total, (-1.0 if available is None else float(available)) if self.strategy.is_global_zero else 0.0]
        summed = torch.tensor(mine, dtype=torch.float64, device=self.strategy.root_device)
        dist.all_reduce(summed)
        needed = float(summed[0]) * self.fit.groups.layout.pipeline_parallel_size / dist.get_world_size()
        available = float(summed[1])
        if 0 <= available < needed:
            raise MemoryError(
                f"`checkpoint='master'` gathers the whole model's state on global rank 0 to write one file:"
                f" {needed / 2**30:.2f} GiB of parameters and optimizer state here, more than the"
                f" {available / 2**30:.2f} GiB rank 0 has available (the machine's, or its memory cgroup's limit)."
                " Nothing was written. Use `checkpoint='sharded'`: each rank writes its own part"
                " (`ddp_plugin.checkpoints.sharded_checkpoint.consolidate` makes one file of it where memory allows)."
            )

    def module_state(self) -> dict[str, Any] | None:
        pm = self.fit.plugin_manager
        parts = self._parts()
        if self.config.checkpoint == "sharded":
            # Each rank its pieces (ZeRO's, of a split tensor's local shard if split) or its own tensors; DTensors
            # stay DTensors, which DCP stores as each rank's shard of the whole tensor.
            state = pm.hook.on_local_module_state_dict(module=self.strategy.lightning_module) if pm is not None else None
            return state if state is not None else self.strategy.lightning_module.state_dict()
        if parts:  # a model no rank holds whole: made whole by its parts, rank 0 writes it
            self._refuse_master_beyond_memory()
            with diagnosed(f"the checkpoint's gather of {_what(parts)}"), self.fit.lent("on_gather_full_parameters"):
                state = self.strategy.lightning_module.state_dict()
                if self.config.zero_stage == 3:  # copied before the units are freed again on leaving
                    state = {k: (v.detach().clone() if isinstance(v, Tensor) else v) for k, v in state.items()}
                for part in parts:
                    state = part.whole_module(state)
            return state
        if pm is not None:
            with diagnosed("the checkpoint's gather of the model to rank 0"):
                state = pm.hook.on_module_state_dict(module=self.strategy.lightning_module)
            if state is not None:
                return state
        return None

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any] | None:
        pm = self.fit.plugin_manager
        optimizer = lightning_adapter.unwrapped(optimizer)  # a LightningOptimizer wraps the user's
        parts = self._parts()
        if self.config.checkpoint == "sharded":
            local = pm.hook.on_local_optimizer_state_dict(optimizer=optimizer) if pm is not None else None
            if local is None:
                sd = optimizer.state_dict()
                flat = {f"{i}/{k}": v for i, st in sd["state"].items() for k, v in st.items()}
                local = {"state": flat, "param_groups": sd["param_groups"], "shapes": {}}
            with diagnosed(f"the checkpoint's gather of the optimizer groups of {_what(parts)}"):
                for part in parts:
                    local = part.local_optimizer(local, optimizer)
            return local
        if parts:
            with diagnosed(f"the checkpoint's gather of the optimizer state of {_what(parts)}"):
                state = pm.hook.on_optimizer_state_dict(optimizer=optimizer) if pm is not None else None
                state = state if state is not None else optimizer.state_dict()
                for part in parts:
                    state = part.whole_optimizer(state, optimizer)
            return state
        if pm is not None:
            with diagnosed("the checkpoint's gather of the optimizer state's layout to rank 0"):
                state = pm.hook.on_optimizer_state_dict(optimizer=optimizer)
            if state is not None:
                return state
        return None

    def _plugin_state(self, checkpoint: dict[str, Any]) -> None:
        pm = self.fit.plugin_manager
        if pm is None:
            return
        checkpoint[CHECKPOINT_KEY] = merged_answers(pm.hook.on_save_state_dict(), "saved state")
        parts = self._parts()
        with diagnosed(f"the checkpoint's gather of the plugin state of {_what(parts)} to rank 0"):
            for part in parts:
                checkpoint[CHECKPOINT_KEY] = part.plugin_state(checkpoint[CHECKPOINT_KEY])
        rank_states = [state for state in pm.hook.on_save_rank_state_dict() if state]
        if rank_states:  # the same answer on every rank (the contract), so every rank takes part in the gather
            mine = merged_answers(rank_states, "saved state")
            ranks: list[Any] | None = [mine]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                # To rank 0 only: it writes the file, and no other rank holds every rank's state.
                ranks = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
                with diagnosed("the checkpoint's gather of the plugins' per-rank state to rank 0"):
                    dist.gather_object(mine, ranks, dst=0)
            if ranks is not None:
                checkpoint[RANK_STATE_KEY] = {"world_size": len(ranks), "ranks": ranks}

    # ------------------------------------------------------------------ saving

    def save(self, checkpoint: dict[str, Any], filepath: Any, write: Callable[[dict[str, Any]], None]) -> None:
        """Save ``checkpoint`` to ``filepath``; ``write``: Lightning's write of a checkpoint there."""
        self._plugin_state(checkpoint)
        if self.config.checkpoint == "sharded":
            self._save_sharded(checkpoint, filepath)
            return
        # At stages 1-3 and in sync modes on every rank (with shard_scope="node", or the outer state of a sync mode,
        # the ranks of other nodes have nothing to produce): whether every rank waits for rank 0's write must not
        # depend on what one rank holds, or the ranks would disagree on the collectives that follow.
        deferred = deferred_storages(checkpoint)
        if not self.config.zero_stage and self.config.sync_every == 1:
            write(checkpoint)
            return
        what = f"write the checkpoint `{filepath}`"
        if not self.strategy.is_global_zero:
            produce_all(deferred)
            agree_with_rank_0(None, what)
            return
        error: Exception | None = None
        try:
            if deferred and not isinstance(self.strategy.checkpoint_io, AtomicCheckpointIO):
                checkpoint = materialize(checkpoint)  # another CheckpointIO gets ordinary tensors
            write(checkpoint)
        except Exception as err:  # noqa: BLE001 - raised below, after the other ranks are told
            error = err
        agree_with_rank_0(error, what)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        if not is_local_path(filepath):
            raise ValueError(f'`checkpoint="sharded"` writes to a local (or shared) filesystem; got `{filepath}`.')
        live = self.strategy.lightning_module.state_dict(keep_vars=True)
        shapes: dict[str, tuple[int, ...]] = {
            f"model/{name}": tuple(value.shape) for name, value in live.items() if isinstance(value, Tensor)
        }
        if deferred_storages({k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}):
            # Plugin state to be gathered (a sync mode's outer state): gathered now, on every rank, into what rank 0
            # writes beside the shards (the sharded layout keeps only model and optimizer tensors per rank).
            checkpoint = {**checkpoint, CHECKPOINT_KEY: materialize(checkpoint[CHECKPOINT_KEY])}
        optimizers = checkpoint.get("optimizer_states", [])
        for j, opt in enumerate(optimizers):
            shapes.update({f"optim/{j}/{k}": v for k, v in opt.get("shapes", {}).items()})
        parts = self._parts()
        with diagnosed(f"the checkpoint's gather of the shapes of {_what(parts)} to rank 0"):
            for part in parts:
                shapes = part.shapes(shapes)
        sharded_checkpoint.save(checkpoint, checkpoint["state_dict"], optimizers, shapes, local_path(filepath))

    def remove(self, filepath: Any) -> bool:
        """Remove a sharded checkpoint (its folder, by global rank 0); ``False`` for a file."""
        if not sharded_checkpoint.is_sharded_checkpoint(filepath):
            return False
        if self.strategy.is_global_zero:
            shutil.rmtree(str(filepath))
        return True

    # ------------------------------------------------------------------ loading

    def load(self, checkpoint_path: Any, weights_only: bool | None, read: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """Read the checkpoint at ``checkpoint_path``; ``read``: Lightning's read of a file."""
        if is_local_path(checkpoint_path) and not os.path.exists(local_path(checkpoint_path)):
            raise FileNotFoundError(
                f"Checkpoint not found: `{checkpoint_path}` does not exist (resolved from the current directory"
                f" {os.getcwd()}). Pass the path of a `.ckpt` file written by `trainer.save_checkpoint` or"
                " `ModelCheckpoint`."
            )
        if is_local_path(checkpoint_path) and sharded_checkpoint.is_sharded_checkpoint(local_path(checkpoint_path)):
            # A model no rank holds whole (pipeline stages, tensor parallelism) reads its own part only: the
            # tensors are read as `load_model_state_dict` and `load_optimizer_state_dict` take them.
            lazy = bool(self._parts())
            checkpoint = sharded_checkpoint.load(local_path(checkpoint_path), lazy=lazy)
        else:
            try:
                if self._mapped_load(checkpoint_path):
                    # Memory-mapped: each rank's pages are read as it takes its stage's and its shard's part, and
                    # the ranks of a machine share them (the page cache) instead of holding a copy each.
                    checkpoint = torch.load(local_path(checkpoint_path), map_location="cpu", mmap=True,
                                            weights_only=False if weights_only is None else weights_only)
                else:
                    checkpoint = read(checkpoint_path, weights_only=weights_only)
            except Exception as err:
                # Empty, random or cut-short files make torch.load say "Ran out of input" or suggest
                # `weights_only=False`: say what it is instead.
                bad = not_a_checkpoint(checkpoint_path, err) if is_local_path(checkpoint_path) else None
                if bad is not None:
                    raise bad from err
                raise
        state, ranks = checkpoint.get(CHECKPOINT_KEY), checkpoint.get(RANK_STATE_KEY)
        if state is not None or ranks is not None:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            mine = None
            if ranks is not None and ranks["world_size"] == world:
                mine = ranks["ranks"][dist.get_rank() if world > 1 else 0]
            # (Lightning restores before `setup`: then the state waits for this fit's plugins)
            self.fit.hand_plugin_state(state or {}, mine)
        return checkpoint

    def _mapped_load(self, checkpoint_path: Any) -> bool:
        """Whether a consolidated checkpoint is read by memory mapping: a local file in ``torch.save``'s zip format,
        read through this library's or Lightning's own checkpoint IO, into a model no rank holds whole."""
        if not self._parts():
            return False
        if type(self.strategy.checkpoint_io) not in (AtomicCheckpointIO, TorchCheckpointIO) or not is_local_path(checkpoint_path):
            return False
        return zipfile.is_zipfile(local_path(checkpoint_path))

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        state = checkpoint["state_dict"]
        for part in reversed(self._parts()):  # this rank's part of the unsplit model's state, split as here
            state = part.module_to_load(state, self.strategy.lightning_module)
        missing, unexpected, mismatched = _compare_state_dicts(self.strategy.lightning_module.state_dict(), state)
        if strict and (missing or unexpected or mismatched):
            details = []
            if missing:
                details.append(f"missing from the checkpoint: {_some(missing)}")
            if unexpected:
                details.append(f"not in this model: {_some(unexpected)}")
            if mismatched:
                details.append(f"different shapes: {_some(mismatched)}")
            raise ValueError(
                f"The checkpoint does not fit {type(self.strategy.lightning_module).__name__}: {'; '.join(details)}. Was it"
                " saved from another model (or other hyperparameters)?"
            )
        if any(isinstance(v, sharded_checkpoint.StoredTensor) for v in state.values()):
            _load_stored(self.strategy.lightning_module, state, strict)
            return
        self.strategy.lightning_module.load_state_dict(state, strict=strict)

    def load_optimizer_state(self, checkpoint: Mapping[str, Any], read: Callable[[Mapping[str, Any]], None]) -> None:
        """Restore the optimizers' state; ``read``: Lightning's restore (outside a ``fit``)."""
        session = self.fit.running()
        if session is None:
            read({**checkpoint, "optimizer_states": sharded_checkpoint.materialized(checkpoint["optimizer_states"])})
            return
        pm = session.plugin_manager
        parts = list(reversed(self._parts()))
        for optimizer, state in zip(self.strategy.optimizers, checkpoint["optimizer_states"]):
            for part in parts:  # the unsplit model's optimizer state: this rank's part, numbered and split as here
                state = part.optimizer_to_load(state, optimizer)
            state = sharded_checkpoint.materialized(state)  # (what is left, whole: the hooks take tensors)
            if not pm.hook.on_load_optimizer_state_dict(optimizer=optimizer, state_dict=state):
                for part in parts:
                    state = part.optimizer_fallback(state, optimizer)
                optimizer.load_state_dict(state)
            lightning_adapter.optimizers_to_device([optimizer], self.strategy.root_device)


def _load_stored(module: Module, state: Mapping[str, Any], strict: bool) -> None:
    """``module.load_state_dict(state)`` for a sharded checkpoint read lazily: tensor by tensor, each parameter's
    and buffer's part read (a DTensor's local part only) and copied in place, so that the rank never holds more
    than its parameters plus one tensor. Entries that are no tensors go through ``load_state_dict``."""
    live = module.state_dict(keep_vars=True)
    rest = {}
    with torch.no_grad():
        for name, value in state.items():
            target = live.get(name)
            if not isinstance(target, Tensor):
                rest[name] = sharded_checkpoint.materialized(value)
                continue
            if isinstance(value, sharded_checkpoint.StoredTensor):
                value = value.read_like(target) if isinstance(target, DTensor) else value.load()
            elif isinstance(target, DTensor) and not isinstance(value, DTensor):
                value = tensor_parallel.distribute_like(value, target)
            local_tensor(target).copy_(local_tensor(value))
            del value
    if rest:
        module.load_state_dict(rest, strict=False)


def _what(parts: list[StatePart]) -> str:
    return " and ".join(part.what for part in parts) or "the model"


def _compare_state_dicts(mine: Mapping[str, Tensor], theirs: Mapping[str, Any]
                         ) -> tuple[list[str], list[str], list[str]]:
    missing = [k for k in mine if k not in theirs]
    unexpected = [k for k in theirs if k not in mine]
    mismatched = [
        f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}"
        for k, v in mine.items()
        if k in theirs and isinstance(theirs[k], (Tensor, sharded_checkpoint.StoredTensor))
        and tuple(theirs[k].shape) != tuple(v.shape)
    ]
    return missing, unexpected, mismatched


def _some(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
