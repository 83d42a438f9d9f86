"""This rank's place among the replica groups: a torchft ``Manager`` per rank, its quorum per step, the commit
that gates the optimizer step, and the state a returning group heals from.

A replica group is one Lightning world (one node's ranks, launched on its own, with its own rendezvous). Rank
``r`` of every live group meets rank ``r`` of the others on torchft's process group, which the Manager
reconfigures over the live groups at each quorum. torchft swallows a failed collective there (the peer died):
the step is then committed nowhere, and the next quorum goes on without the lost group.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import Tensor

    from ddp_plugin.fault_tolerance.options import FaultTolerance

log = logging.getLogger(__name__)


class ReplicaGroups:
    """The torchft Manager of this rank (group rank ``rank`` of ``size``), created when the fit starts.

    ``state`` and ``load_state``: what a returning group receives from a live peer (called by torchft: ``state``
    on a live peer's quorum thread while it runs its forward, ``load_state`` on the returning group's ranks inside
    :meth:`commit`, before the optimizer steps)."""

    def __init__(self, options: FaultTolerance, rank: int, size: int, device: torch.device,
                 state: Callable[[], dict[str, Any]], load_state: Callable[[dict[str, Any]], None],
                 timeout: timedelta | None) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        timeout = timeout or timedelta(seconds=60)
        self.options = options
        self.steps_lost = 0
        """Steps whose gradients no group applied (a group was lost in them, or too few were live)."""
        self.heals = 0
        self._started = False
        self._load_state = load_state
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._healed, state_dict=state, min_replica_size=options.min_replicas,
            rank=rank, world_size=size, replica_id=f"replica_group_{options.replica_group}",
            lighthouse_addr=options.lighthouse, timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout), connect_timeout=timeout,
            # The group's own store (Lightning's and torchrun's rendezvous both serve one there).
            store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        )

    def _healed(self, state: dict[str, Any]) -> None:
        self.heals += 1
        log.warning("ddp_plugin: replica group %d healed from a live peer at step %d",
                    self.options.replica_group, self.manager.current_step())
        self._load_state(state)

    def start_step(self) -> None:
        """The quorum of the coming step, computed while the forward runs (once per optimizer step: the inner
        steps of gradient accumulation find it started)."""
        if not self._started:
            self.manager.start_quorum()
            self._started = True

    def allreduce(self, tensor: Tensor) -> None:
        """``tensor`` averaged over the live groups' rank of this group rank, in place (a group still healing
        adds zeros and is not counted). A failure is swallowed: the step will not commit."""
        self.manager.allreduce(tensor).wait()

    def commit(self) -> bool:
        """Whether every live group applies this step (torchft's ``should_commit``; a returning group loads its
        peer's state here first). Every rank of the group calls it once per optimizer step."""
        self._started = False
        committed = self.manager.should_commit()
        if not committed:
            self.steps_lost += 1
            log.warning("ddp_plugin: replica group %d: step not committed (a group was lost, or fewer than"
                        " min_replicas=%d are live); the next quorum goes on with the live ones",
                        self.options.replica_group, self.options.min_replicas)
        return committed

    def metrics(self) -> dict[str, float]:
        return {"ft/replicas": float(self.manager.num_participants()), "ft/steps_lost": float(self.steps_lost),
                "ft/heals": float(self.heals), "ft/step": float(self.manager.current_step())}

    def close(self) -> None:
        self.manager.shutdown(wait=False)
