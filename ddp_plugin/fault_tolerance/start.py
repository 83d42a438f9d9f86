"""The run's first sync across replica groups, with a sync mode: whether every group started from the same bits.

torchft's default (``init_sync``) heals every group but one inside the quorum of the first step it commits: with a
sync mode that is the first outer sync, after ``H`` inner steps, and what crosses is about 20 bytes a parameter a
rank holds (the replica, AdamW's two moments, the global copy, the outer momentum), from one group to every other,
every group waiting, the others' first ``H`` steps thrown away. Groups seeded alike (as users seed them) need none
of it: the global copy each started from is already the same. :class:`StartCheck` compares, in that sync's quorum,
a fingerprint of each rank's part of the global copy (unchanged until the sync's outer step) and of the module's
tensors outside the buckets as they were at setup (buffers, frozen parameters) against the same group rank's on
every other group; only where they differ is the sync retried with torchft's heal (:meth:`ReplicaGroups.init_sync
<ddp_plugin.fault_tolerance.replicas.ReplicaGroups.init_sync>`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_plugin.hookspecs import local_tensor

if TYPE_CHECKING:
    from torch import nn

    from ddp_plugin.fault_tolerance.replicas import ReplicaGroups
    from ddp_plugin.hookspecs import Bucket, Communicator

log = logging.getLogger(__name__)

PRINT_PRIMES = (1048573, 1048571, 1048559)
"""The moduli of :func:`fingerprint`'s hashes: primes below 2**20, so that a quorum's sums of them and of their
squares stay exact in 64-bit integers for up to 1024 groups."""

_CHUNK = 1 << 18
_MULTIPLIERS = ((40503, 7), (52183, 1201), (31337, 40009))


def fingerprint(tensors: Iterable[torch.Tensor], prints: list[int] | None = None) -> list[int]:
    """Three hashes (each below 2**20, :data:`PRINT_PRIMES`) of the tensors' bytes, in order and by position: equal
    on two ranks that hold the same bits in the same layout, and for other bits equal only by a chance of about
    2**-60. ``prints``: hashes to go on from (another part's). A DTensor is hashed by its local part; the scratch
    is a few MB, freed on return."""
    h = list(prints) if prints is not None else [0, 0, 0]
    weights: torch.Tensor | None = None
    for tensor in tensors:
        t = local_tensor(tensor).detach().contiguous().reshape(-1)
        b = t.view(torch.uint8) if t.numel() else t.new_zeros(0, dtype=torch.uint8)
        if b.numel() % 2:
            b = torch.cat([b, b.new_zeros(1)])
        words = b.view(torch.int16)
        if weights is None or weights.device != words.device:
            # (position weights in [1, 2**16): a word times one stays below 2**31, a chunk's sum below 2**50)
            i = torch.arange(_CHUNK, dtype=torch.int64, device=words.device)
            weights = torch.stack([(i * m + a) % 65521 + 1 for m, a in _MULTIPLIERS])
        for lo in range(0, max(words.numel(), 1), _CHUNK):
            x = words[lo : lo + _CHUNK].to(torch.int64)
            sums = (weights[:, : x.numel()] * x).sum(dim=1).tolist()
            h = [(v * 65537 + s + x.numel()) % p for v, s, p in zip(h, sums, PRINT_PRIMES)]
    return h


def same_across(replicas: ReplicaGroups, prints: list[int]) -> bool:
    """Whether this group rank of every group in the quorum holds ``prints`` (each below 2**20): the count, the sums
    and the sums of squares all-reduced over the quorum's groups (torchft's all-reduce), the prints equal exactly
    where ``n * sum(p**2) == sum(p)**2``. ``True`` where the all-reduce failed (a group lost: the sync does not
    commit, and its retry asks again)."""
    from torch.distributed import ReduceOp

    sums = torch.tensor([1, *prints, *(p * p for p in prints)], dtype=torch.int64, device=replicas.device)
    replicas.manager.allreduce(sums, reduce_op=ReduceOp.SUM).wait()
    if replicas.manager.errored():
        return True
    n, k = int(sums[0]), len(prints)
    return all(n * int(sums[1 + k + i]) == int(sums[1 + i]) ** 2 for i in range(k))


class StartCheck:
    """A sync mode's check, at the run's first sync, that its groups started alike (see the module). ``replicas``:
    this rank's :class:`~ddp_plugin.fault_tolerance.replicas.ReplicaGroups`, whose quorums at torchft's step 0
    this turns from healing to not (``init_sync``) until a check finds the groups apart."""

    def __init__(self, replicas: ReplicaGroups) -> None:
        self.replicas = replicas
        self.prints: list[int] | None = None
        """The fingerprint of this rank's module tensors outside the buckets, at setup."""
        self.group: Any = None
        """The group's ranks (gloo), on which they agree on what they found (the outer thread's own)."""
        replicas.init_sync(False)

    def setup(self, module: nn.Module, buckets: list[Bucket], comm: Communicator) -> None:
        """At setup, every rank (making a group is collective): the module's tensors outside ``buckets``
        fingerprinted as they start."""
        if dist.get_world_size() > 1:
            self.group = comm.new_group(backend="gloo")
        synced = {id(p) for bucket in buckets for p in bucket.params}
        self.prints = fingerprint(v for v in module.state_dict(keep_vars=True).values() if id(v) not in synced)

    def alike(self, outer: list[torch.Tensor]) -> bool:
        """In a sync's quorum, before anything crosses (``outer``: this rank's parts of the global copy): ``False``
        where this is the run's first sync, in a quorum that heals no group, and some rank of some group did not
        start as its peers; the quorums then heal every group but one at step 0 (this sync is to be refused, and
        retried so). ``True`` otherwise, also in any quorum that heals (the groups then start from one state)."""
        replicas = self.replicas
        if replicas.heals_at_start or replicas.manager.current_step() != 0:
            return True
        apart = torch.tensor([int(not same_across(replicas, fingerprint(outer, self.prints)))], dtype=torch.int64)
        if self.group is not None:
            dist.all_reduce(apart, op=dist.ReduceOp.MAX, group=self.group)  # (not data: not counted)
        if not apart.item():
            return True
        replicas.init_sync(True)
        replicas.started_apart = True
        if replicas.rank == 0:
            log.warning("ddp_plugin: replica group %d: the replica groups started from different parameters; their"
                        " first sync heals every group but one from it (torchft's init_sync). Seed every group alike"
                        " (lightning.seed_everything) and that sync heals none", replicas.options.replica_group)
        return False
