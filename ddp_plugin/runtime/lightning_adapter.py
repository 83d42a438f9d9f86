"""Where ddp_plugin reaches past Lightning's public API: every private name of Lightning it uses is in this module
(``tests/test_layout.py`` checks it), so a Lightning release that changes one breaks here and nowhere else.

Checked against Lightning 2.6.5 and 2.6.6 (:data:`CHECKED_VERSIONS`). What is used, and why:

- The launchers ``_SubprocessScriptLauncher`` and ``_MultiProcessingLauncher`` (and their base ``_Launcher``, a
  type): Lightning's own strategies launch through them, and a strategy outside Lightning has no public launcher.
- The process group's start and use as Lightning's DDP strategy does them: ``_init_dist_connection`` (the
  cluster environment's rendezvous), ``_get_default_process_group_backend_for_device``,
  ``_distributed_is_initialized`` and ``_sync_ddp_if_available`` (the strategy's ``reduce``).
- ``_StrategyRegistry`` (a type, for ``register_strategies``) and ``_PATH`` (the path type of ``CheckpointIO``'s
  methods).
- ``_optimizers_to_device``: the optimizers' state moved with the module, as Lightning's DDP strategy moves it.
- ``_collect_rng_states`` / ``_set_rng_states``: the random generators put back after ``pipeline_split="time"``
  ran a step's first batch (a shuffled loader draws from them).
- ``_request_dataloader`` and a loop's ``_data_source``: the first batch of the running entry point's data, before
  its loop starts (the same time split); the module's ``_on_before_batch_transfer`` and
  ``_apply_batch_transfer_handler`` move it as the loop would (:func:`transfer_batch`).
- ``LightningOptimizer._optimizer``: the user's optimizer a ``LightningOptimizer`` wraps (:func:`unwrapped`).
- The training epoch loop's ``_batches_that_stepped`` (:func:`batches_that_stepped`,
  :func:`set_batches_that_stepped`): the counter the loggers' step and per-step schedulers go by, which a replica
  group that heals from a peer takes with the peer's position.
- The fit loop's ``_combined_loader`` (:func:`reload_train_dataloader`): set to ``None`` it makes the loop build the
  training dataloader again at the next epoch's start, as ``reload_dataloaders_every_n_epochs`` does.
- ``LightningModule._device_mesh`` (:func:`set_device_mesh`): what ``configure_model`` reads as
  ``self.device_mesh``, set as Lightning's ``ModelParallelStrategy`` sets it; ``LightningModule._trainer``
  (:func:`has_trainer`): whether a module is attached (``module.trainer`` raises where it is not);
  ``_current_fx_name`` (:func:`current_hook`): which hook the module is in.
- ``Trainer._logger_connector.should_update_logs`` (:func:`logs_this_step`): whether this step's logs are written
  (``log_every_n_steps``), by the Trainer's own rule.

One more is a method, overridden where it must be: ``Precision._after_closure``, in
:mod:`ddp_plugin.strategy.precision` (the clipping that sees every shard runs at Lightning's own place for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import _StrategyRegistry as StrategyRegistry
from lightning.fabric.utilities.distributed import _distributed_is_initialized as distributed_is_initialized
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device as default_backend
from lightning.fabric.utilities.distributed import _init_dist_connection as init_dist_connection
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.fabric.utilities.seed import _collect_rng_states as collect_rng_states
from lightning.fabric.utilities.seed import _set_rng_states as set_rng_states
from lightning.fabric.utilities.types import _PATH as PATH

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch

__all__ = [
    "CHECKED_VERSIONS", "PATH", "StrategyRegistry", "batches_that_stepped", "collect_rng_states", "current_hook",
    "default_backend", "distributed_is_initialized", "first_loader", "has_trainer", "init_dist_connection",
    "launcher_classes", "logs_this_step", "optimizers_to_device", "reload_train_dataloader",
    "set_batches_that_stepped", "set_device_mesh", "set_rng_states", "sync_ddp_if_available", "transfer_batch",
    "unwrapped",
]

CHECKED_VERSIONS = ("2.6.5", "2.6.6")
"""The Lightning releases this module was checked against."""


def launcher_classes() -> tuple[type, type]:
    """Lightning's subprocess script launcher and its multiprocessing launcher (imported on first use: they import
    ``lightning.pytorch``'s trainer side)."""
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    return _SubprocessScriptLauncher, _MultiProcessingLauncher


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimizer, where ``optimizer`` is the ``LightningOptimizer`` that wraps it; else ``optimizer``."""
    return getattr(optimizer, "_optimizer", optimizer)


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The training epoch loop's count of batches that stepped an optimizer (the loggers' step)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: pl.Trainer, value: int) -> None:
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def reload_train_dataloader(trainer: pl.Trainer) -> None:
    """Make the fit loop build the training dataloader again at the next epoch's start (asking the strategy's
    ``distributed_sampler_kwargs`` again)."""
    trainer.fit_loop._combined_loader = None


def first_loader(loop: Any) -> Any | None:
    """The dataloaders ``loop`` runs on (what its data source gives before the loop starts), or ``None`` where the
    entry point was given no data."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    source = loop._data_source
    return _request_dataloader(source) if source.is_defined() else None


def transfer_batch(module: pl.LightningModule, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
    """``batch`` moved to ``device`` through the module's batch hooks, as the loop moves it."""
    batch = module._on_before_batch_transfer(batch, dataloader_idx=dataloader_idx)
    return module._apply_batch_transfer_handler(batch, device=device, dataloader_idx=dataloader_idx)


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """What ``configure_model`` reads as ``self.device_mesh``."""
    module._device_mesh = mesh


def has_trainer(module: pl.LightningModule) -> bool:
    """Whether ``module`` is attached to a Trainer."""
    return module._trainer is not None


def current_hook(module: pl.LightningModule) -> str | None:
    """The name of the hook the module is in (``"training_step"``, ...), or ``None``."""
    return module._current_fx_name


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether the Trainer writes this training step's logs (``log_every_n_steps``), by its own rule; ``True`` where
    that cannot be asked (another Lightning version)."""
    connector = getattr(trainer, "_logger_connector", None)
    try:
        return bool(connector.should_update_logs)
    except Exception:  # noqa: BLE001 - an unknown Lightning: log every step, as before
        return True
