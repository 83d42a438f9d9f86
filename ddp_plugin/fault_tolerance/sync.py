"""The sync modes across replica groups: a quorum per outer sync, the pseudo-gradients averaged over the live
groups through torchft, the outer step only where the sync commits, and a sync that failed (a group lost inside
it) redone at once over the groups still live."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ddp_plugin.hookspecs import hookimpl
from ddp_plugin.sync import OuterSync

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.sync.parts import Piece, Update

log = logging.getLogger(__name__)

RETRIES = 3
"""Quorums a sync may take after its first failed (a group lost inside it each time) before its round is dropped:
every group then takes the global copy back, as torchft's own DiLoCo does after a failed sync."""


class ReplicaGroupSync(OuterSync):
    """:class:`~ddp_plugin.sync.OuterSync` whose nodes are replica groups: each group is one node of the sync mode
    (its ranks keep their parts of the global copy and of the outer optimizer's state, as on one node), and each
    sync is a torchft step:

    1. its quorum (on the training thread, which waits for the sync anyway);
    2. the pseudo-gradients ``x - s`` averaged over the live groups' ranks of this group rank (torchft's
       all-reduce: a group still healing adds zeros and is not counted; with a codec, the codec on torchft's
       process group, except in a sync a group heals in);
    3. the commit: a returning group loads a live peer's state here (its replica, inner and outer optimizer,
       global copy, the schedule's position and the fit's counters); the outer optimizer steps on every group
       only if the sync committed everywhere. One that did not (a group died inside it) is redone over a new
       quorum from the same replicas (unchanged until a sync is applied), up to :data:`RETRIES` times.

    Nothing crosses groups between syncs (the groups' gradients stay inside them, as the sync modes' do inside a
    node). Without staleness or fragments for now: the sync is applied in the step that sent it."""

    def __init__(self, replicas: ReplicaGroups, **sync: Any) -> None:
        super().__init__(**sync)
        self._replicas = replicas
        self._healed_step: int | None = None
        replicas.add_state("sync", self._state, self._load_state)

    def _send(self, fragment: int) -> None:
        self._replicas.start_step()
        super()._send(fragment)

    def _outer_step(self, pieces: list[Piece], pseudo: list[Tensor], snapshots: list[Tensor] | None
                    ) -> tuple[list[Update], float]:
        local = self._squared_norm(pseudo)
        if self.topology.ranks_per_node > 1:
            self.comm.all_reduce(local, group=self.intra)
        for attempt in range(RETRIES + 1):
            if attempt:
                # Over the groups still live, from the replicas as they were (a sync is applied only once done).
                self._replicas.start_step()
                with torch.no_grad():
                    for piece, g in zip(pieces, pseudo):
                        torch.sub(piece.outer.detach(), self.access.read(piece.bucket, piece.lo, piece.hi), out=g)
            self._replicas.reduce(self.hook, [(g, piece.pseudo, piece.lo) for piece, g in zip(pieces, pseudo)])
            if self._replicas.commit("outer sync"):
                self._outer_optimizer_step(pieces, pseudo)
                return self.updates(pieces, snapshots, pseudo), float(local.sqrt())
        self._replicas.steps_lost += self.schedule.every
        log.warning("ddp_plugin: replica group %d: the outer sync after step %d failed %d times; every group takes"
                    " the global copy back (the %d inner steps since the last sync are lost)",
                    self._replicas.options.replica_group, self.step, RETRIES + 1, self.schedule.every)
        return self.updates(pieces, snapshots), float(local.sqrt())

    @hookimpl(tryfirst=True)
    def on_after_optimizer_step(self, optimizer: Optimizer) -> None:
        super().on_after_optimizer_step(optimizer)
        if self._healed_step is not None:
            # (taken here, once the sync that healed this group is applied: the training thread read the old
            # position to place it)
            self.step, self._healed_step = self._healed_step, None

    def _state(self) -> dict[str, Any]:
        """On a live peer, at the quorum of a sync: references to the global copy and the outer optimizer's state
        (the training thread waits for the sync; the outer thread steps them only after the commit, once the
        transfer is done)."""
        return {"step": self.step, "syncs": self.syncs, "outer": [p.outer.detach() for p in self.pieces],
                "optimizer": self.outer.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        """On the returning group's ranks, inside the sync's commit (on the outer thread, the training thread
        waiting for it): the same group rank's pieces as the peer's (every group has the same layout)."""
        with torch.no_grad():
            for piece, value in zip(self.pieces, state["outer"], strict=True):
                piece.outer.copy_(value)
        self.outer.load_state_dict(state["optimizer"])
        self.syncs = self.syncs_logged = state["syncs"]
        self._healed_step = state["step"]
