"""``fault_tolerance={"data_split": "quorum"}``: the data split over the live groups, epoch by epoch.

Each rank's ``DistributedSampler`` takes one share of ``n * len(groups)`` (``n`` the group's data-parallel ranks):
the ``i``-th group in id order holds the ``i``-th block of ``n`` (:func:`sampler_split`). The groups are the launch's
(ids 0 to ``replica_groups`` - 1) until a quorum is known; at each epoch's end, those of the group's last quorum
(:class:`QuorumDataSplit`), and always the group itself (one that joined between syncs is in none yet). Where they
changed, Lightning builds the training dataloader again at the next epoch's start, on its own path for
``reload_dataloaders_every_n_epochs``, with the sampler split over them. The groups of one quorum read the same
groups at an epoch's end; a returning or new group takes its peers' epoch number when it heals
(:func:`~ddp_plugin.fault_tolerance.healing.load_position`), so that their epochs are shuffled alike and their
shares do not overlap."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import Callback

from ddp_plugin.runtime import lightning_adapter

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ddp_plugin.fault_tolerance.options import FaultTolerance

log = logging.getLogger(__name__)


def group_id(replica_id: str) -> int | None:
    """The group id of a torchft replica id (``replica_group_<id>:<uuid>``, as :class:`ReplicaGroups` names them)."""
    found = re.fullmatch(r"replica_group_(\d+)(:.*)?", replica_id)
    return int(found.group(1)) if found else None


def data_groups(options: FaultTolerance, members: Iterable[str]) -> list[int]:
    """The groups the data is split over: those of ``members`` (a quorum's replica ids; none known: the launch's
    groups), with this one, in id order."""
    ids = {i for i in map(group_id, members) if i is not None} or set(range(options.replica_groups))
    return sorted(ids | {options.replica_group})


def sampler_split(options: FaultTolerance, groups: list[int] | None, ranks: int, rank: int) -> dict[str, int]:
    """The ``DistributedSampler``'s ``num_replicas`` and ``rank`` of data-parallel rank ``rank`` of ``ranks`` in this
    group: over ``groups`` (``data_split="quorum"``; ``None``: the launch's), or over ``replica_groups`` shares."""
    if options.data_split != "quorum":
        return {"num_replicas": ranks * options.replica_groups, "rank": options.replica_group * ranks + rank}
    groups = groups if groups is not None else data_groups(options, ())
    return {"num_replicas": ranks * len(groups), "rank": groups.index(options.replica_group) * ranks + rank}


class QuorumDataSplit(Callback):
    """At each training epoch's end, the groups of the last quorum (``members()``, on the group's rank 0, broadcast
    to its other ranks: every rank of a group must split alike) become the next epoch's (``state.data_groups``);
    where they changed, the training dataloader is built again at the next epoch's start."""

    def __init__(self, options: FaultTolerance, state: Any, members: Callable[[], list[str]]) -> None:
        self.options, self.state, self.members = options, state, members

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        groups = trainer.strategy.broadcast(data_groups(self.options, self.members()), src=0)
        if groups == (self.state.data_groups or data_groups(self.options, ())):
            return
        log.info("ddp_plugin: replica group %d: the data is split over groups %s from the next epoch on",
                 self.options.replica_group, groups)
        self.state.data_groups = groups
        # (Lightning's fit loop builds the training dataloader again at the next epoch's start when it has none,
        # asking the strategy's distributed_sampler_kwargs: as for `reload_dataloaders_every_n_epochs`)
        lightning_adapter.reload_train_dataloader(trainer)


def attach(trainer: pl.Trainer, options: FaultTolerance | None, state: Any) -> None:
    """At a fit's setup: with ``data_split="quorum"``, the launch's groups split the first epoch (``state``: the
    strategy's :class:`~ddp_plugin.strategy.fit_state.FitState`), and :class:`QuorumDataSplit` watches the next."""
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, QuorumDataSplit)]
    state.data_groups = None
    if options is None or options.data_split != "quorum":
        return

    def members() -> list[str]:
        from ddp_plugin.fault_tolerance.plugins import NAME

        session = state.running()
        member = session.plugin_manager.get_plugin(NAME) if session is not None else None
        return member.replicas.pg.quorums.members if member is not None else []

    trainer.callbacks.append(QuorumDataSplit(options, state, members))
